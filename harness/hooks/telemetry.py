"""GPU telemetry through NVML (``--telemetry HZ``, ``runtime.telemetry_hz``): in every process that
owns a GPU, a thread reads the GPU's power, SM clock, memory used, utilisation, temperature and
clock-event (throttle) reasons at a fixed rate into ``telemetry.<role><rank>.jsonl``, one
``measure.telemetry_figures.TelemetrySample`` a line, on the harness's clock. ``measure.telemetry_figures`` turns
the files into energy per frame, mean power and the throttle flag.

NVML is ``nvidia-ml-py`` (``pynvml``, the ``gpu`` extra), imported only when telemetry is asked
for: a run without it, or a machine without a GPU, never loads it. The sampler keeps a deadline
schedule (sample k at t0 + k/HZ; a deadline already missed is skipped, not made up in a burst), so
its rate does not drift with the time a reading takes.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any, Callable

import msgspec

from harness.errors import HarnessError
from harness.measure.clock import now
from harness.measure.telemetry_figures import TelemetrySample, reason_table, throttle_names

#: the highest rate asked for: NVML's power reading itself is refreshed at most every few ms, and
#: each reading takes the sampling process's GIL
MAX_HZ = 100.0


def load_nvml():
    """pynvml, initialised; a HarnessError (one line) where it cannot be."""
    try:
        import pynvml  # optional dependency (the gpu extra): loaded only when telemetry is asked for
    except ImportError:
        raise HarnessError("--telemetry needs NVML's Python bindings: pip install 'harness[gpu]' (nvidia-ml-py)") from None
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as e:
        raise HarnessError(f"--telemetry: NVML cannot start on this machine ({e}): no NVIDIA GPU or driver") from None
    if count < 1:
        pynvml.nvmlShutdown()
        raise HarnessError("--telemetry: NVML sees no GPU on this machine")
    return pynvml


def check_telemetry(hz: float, device: str) -> None:
    """Refuse telemetry that cannot run, before anything is allocated or started: off (0) passes."""
    if hz == 0:
        return
    if not (math.isfinite(hz) and 0 < hz <= MAX_HZ):
        raise HarnessError(f"--telemetry {hz:g}: the rate must be in (0, {MAX_HZ:g}] samples per second")
    if device != "cuda":
        raise HarnessError(f"--telemetry samples GPUs through NVML; this run is on the {device} (it needs --device cuda)")
    load_nvml().nvmlShutdown()


def _read(fn: Callable[[], Any], nvml) -> Any:
    """One NVML field; None where this GPU does not support it (e.g. no power reading on a MIG slice)."""
    try:
        return fn()
    except nvml.NVMLError:
        return None


def nvml_reader(nvml, handle, uuid: str, index: int) -> Callable[[int], TelemetrySample]:
    """A function that reads one sample of ``handle`` stamped with the time it is given."""
    table = reason_table({k: v for k, v in vars(nvml).items() if isinstance(v, int)})
    reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or nvml.nvmlDeviceGetCurrentClocksThrottleReasons

    def read(t_ns: int) -> TelemetrySample:
        power = _read(lambda: nvml.nvmlDeviceGetPowerUsage(handle), nvml)  # milliwatts
        mem = _read(lambda: nvml.nvmlDeviceGetMemoryInfo(handle), nvml)
        util = _read(lambda: nvml.nvmlDeviceGetUtilizationRates(handle), nvml)
        mask = _read(lambda: reasons(handle), nvml) or 0
        return TelemetrySample(
            t_ns=t_ns, gpu=uuid, index=index, power_w=None if power is None else power / 1000.0,
            sm_clock_mhz=_read(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM), nvml),
            memory_used_bytes=None if mem is None else int(mem.used),
            util_gpu_pct=None if util is None else int(util.gpu), util_memory_pct=None if util is None else int(util.memory),
            temperature_c=_read(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU), nvml),
            throttle_mask=int(mask), throttle=throttle_names(int(mask), table),
        )

    return read


class Sampler:
    """A thread that calls ``read(t)`` at ``hz`` and writes each sample as a line of ``path``
    (flushed, so a killed process leaves every whole line it took). ``clock`` and ``wait`` are the
    harness clock and the stop event's wait unless a test drives them."""

    def __init__(self, read: Callable[[int], TelemetrySample], path: str | Path, hz: float,
                 clock: Callable[[], int] = now, wait: Callable[[float], bool] | None = None):
        if not 0 < hz <= MAX_HZ:
            raise ValueError(f"telemetry rate {hz} outside (0, {MAX_HZ}]")
        self.read, self.path, self.period_ns, self.clock = read, Path(path), 1e9 / hz, clock
        self._stop = threading.Event()
        self._wait = wait or self._stop.wait
        self._thread: threading.Thread | None = None
        self.samples = 0
        self.error: str | None = None

    def start(self) -> "Sampler":
        self._thread = threading.Thread(target=self.run, name="harness-telemetry", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def run(self) -> None:
        enc = msgspec.json.Encoder()
        t0, k = self.clock(), 0
        try:
            with open(self.path, "wb") as f:
                while not self._stop.is_set():
                    f.write(enc.encode(self.read(self.clock())) + b"\n")
                    f.flush()
                    self.samples += 1
                    t = self.clock()
                    k = max(k + 1, math.ceil((t - t0) / self.period_ns))  # the next deadline not yet passed
                    if self._wait(max(0.0, (t0 + k * self.period_ns - t) / 1e9)):
                        break
        except Exception as e:  # telemetry must never take the rank down; the gap in the file shows
            self.error = f"{type(e).__name__}: {e}"
