"""The NVML sampler's mechanics against a fake NVML (the real calls run on the GPU: scripts/gpu_batch.sh
step telemetry): what a reading records, the rate of its deadline schedule, stop, the file; and the
refusal of telemetry where it cannot run."""

from __future__ import annotations

import subprocess
import sys
import threading
from types import SimpleNamespace

import msgspec
import pynvml
import pytest

from harness.errors import HarnessError
from harness.hooks import telemetry as H
from harness.measure.telemetry_figures import TelemetrySample


class FakeNVML:
    """The few pynvml calls the reader makes, with pynvml's own constants and error type."""

    NVMLError = pynvml.NVMLError
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU

    def __init__(self, after=None, at: int = 0):
        self.reads, self.after, self.at = 0, after, at
        for k, v in vars(pynvml).items():
            if k.startswith("nvmlClocksEventReason"):
                setattr(self, k, v)

    def nvmlDeviceGetPowerUsage(self, h):
        self.reads += 1
        if self.after is not None and self.reads == self.at:
            self.after.set()
        return 412_500  # mW

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=7 << 30)

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=97, memory=41)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonSwThermalSlowdown

    def nvmlDeviceGetClockInfo(self, h, which):
        assert which == pynvml.NVML_CLOCK_SM
        return 1755

    def nvmlDeviceGetTemperature(self, h, which):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)  # a field the GPU lacks reads None


def test_a_reading_records_every_field_in_the_samples_units():
    s = H.nvml_reader(FakeNVML(), object(), "GPU-x", 3)(123)
    assert s == TelemetrySample(t_ns=123, gpu="GPU-x", index=3, power_w=412.5, sm_clock_mhz=1755,
                                memory_used_bytes=7 << 30, util_gpu_pct=97, util_memory_pct=41, temperature_c=None,
                                throttle_mask=pynvml.nvmlClocksEventReasonSwPowerCap
                                | pynvml.nvmlClocksEventReasonSwThermalSlowdown,
                                throttle=("SwPowerCap", "SwThermalSlowdown"))


class FakeTime:
    """A clock that moves only when the sampler waits (or a reading takes ``cost`` ns)."""

    def __init__(self, stop_after: int, cost: int = 0):
        self.t, self.waits, self.stop_after, self.cost = 1_000, 0, stop_after, cost

    def clock(self) -> int:
        return self.t

    def read(self, t: int) -> TelemetrySample:
        self.t += self.cost
        return TelemetrySample(t_ns=t, gpu="GPU-x", index=0, power_w=1.0)

    def wait(self, seconds: float) -> bool:
        self.waits += 1
        self.t += round(seconds * 1e9)
        return self.waits >= self.stop_after  # True: stopped


def _lines(path) -> list[TelemetrySample]:
    return [msgspec.json.decode(x, type=TelemetrySample) for x in path.read_bytes().splitlines()]


def test_samples_keep_the_deadline_schedule_and_stop_when_told(tmp_path):
    ft = FakeTime(stop_after=5)
    s = H.Sampler(ft.read, tmp_path / "t.jsonl", 20.0, clock=ft.clock, wait=ft.wait)
    s.run()
    assert [x.t_ns for x in _lines(tmp_path / "t.jsonl")] == [1_000 + k * 50_000_000 for k in range(5)]
    assert s.samples == 5 and s.error is None


def test_a_slow_reading_skips_the_deadlines_it_missed_instead_of_bursting(tmp_path):
    ft = FakeTime(stop_after=4, cost=120_000_000)  # each reading takes 2.4 periods of 50 ms
    H.Sampler(ft.read, tmp_path / "t.jsonl", 20.0, clock=ft.clock, wait=ft.wait).run()
    ts = [x.t_ns - 1_000 for x in _lines(tmp_path / "t.jsonl")]
    assert ts == [0, 150_000_000, 300_000_000, 450_000_000]  # deadlines 0, 3, 6, 9 periods: none made up


def test_the_thread_samples_until_stopped_and_leaves_whole_lines(tmp_path):
    third = threading.Event()
    nvml = FakeNVML(after=third, at=3)
    s = H.Sampler(H.nvml_reader(nvml, object(), "GPU-x", 0), tmp_path / "telemetry.dit0.jsonl", 100.0).start()
    assert third.wait(60), "the sampler did not take three readings"
    s.stop()
    assert not s._thread.is_alive() and s.error is None
    lines = _lines(tmp_path / "telemetry.dit0.jsonl")
    assert len(lines) == s.samples >= 3 and all(x.power_w == 412.5 for x in lines)
    assert [x.t_ns for x in lines] == sorted(x.t_ns for x in lines)
    after = nvml.reads
    assert s.samples == after  # stopped: no reading after stop() returned


def test_refused_where_it_cannot_run(monkeypatch):
    H.check_telemetry(0, "cpu")  # off: nothing checked
    with pytest.raises(HarnessError, match="this run is on the cpu"):
        H.check_telemetry(10, "cpu")
    with pytest.raises(HarnessError, match=r"rate must be in \(0, 100\]"):
        H.check_telemetry(float("nan"), "cuda")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # the gpu extra not installed
    with pytest.raises(HarnessError, match=r"pip install 'harness\[gpu\]'"):
        H.check_telemetry(10, "cuda")


def test_serve_refuses_telemetry_on_the_cpu_in_one_line_before_anything_starts(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "harness", "serve", "--preset", "tiny", "--telemetry", "10", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["error: --telemetry samples GPUs through NVML; this run is on the cpu "
                                             "(it needs --device cuda)"]
    assert not out.exists()
