"""GPU telemetry's pure figures: energy by trapezoid over the steady window, the throttle flag, the
names of NVML's throttle bits (from pynvml's own constants), and how the summary shows them."""

from __future__ import annotations

import msgspec
import numpy as np
import pynvml
import pytest

from harness.measure import figures as F
from harness.measure import telemetry_figures as T
from harness.measure import run_report as R
from harness.measure.headline import headline
from harness.measure.metrics import Window
from harness.measure.setting import setting_line
from harness.measure.summary import FLAG_THROTTLED, build_summary, run_summary
from helpers.events import MS, make_run

S = 1_000_000_000
RUN = dict(status="complete", hooks=[], candidates=[], probes={}, sessions_completed=3, stalls=[],
           stall_report_s=10.0, protocol="timing")


def test_energy_is_the_trapezoid_of_power_over_the_span_interpolated_at_its_ends():
    t = np.arange(0, 10 * S + 1, S // 10, dtype=np.int64)  # 10 Hz for 10 s
    w = 100.0 + 50.0 * t / S  # a ramp: the trapezoid (and the interpolation) is exact on it
    a, b = int(2.05 * S), int(7.3 * S)
    exact = 100 * (b - a) / S + 25 * ((b / S) ** 2 - (a / S) ** 2)
    assert T.energy_j(t, w, a, b) == pytest.approx(exact, rel=1e-12)
    # a step from 200 W to 400 W half-way between two readings: the trapezoid sees the ramp between them
    t2 = np.array([0, S, 2 * S], dtype=np.int64)
    assert T.energy_j(t2, np.array([200.0, 200.0, 400.0]), 0, 2 * S) == pytest.approx(200 + 300)


def test_energy_is_none_where_the_readings_do_not_cover_the_span():
    t = np.array([S, 2 * S, 3 * S], dtype=np.int64)
    w = np.full(3, 300.0)
    assert T.energy_j(t, w, S // 2, 2 * S) is None  # starts before the first reading: never extrapolated
    assert T.energy_j(t, w, S, 4 * S) is None
    assert T.energy_j(t, w, S, 3 * S) == pytest.approx(600.0)


def _samples(gpu: str, t0: int, t1: int, watts: float, step: int = 10 * MS, throttle_at=(), reason=("SwPowerCap",)):
    return [T.TelemetrySample(t_ns=t, gpu=gpu, index=0, power_w=watts, sm_clock_mhz=1980, temperature_c=40,
                              throttle=reason if any(abs(t - x) < step // 2 for x in throttle_at) else ())
            for t in range(t0, t1 + 1, step)]


def _run():
    events, starts = make_run(3, period=100 * MS)  # 10 chunks a session, intervals of 100 ms, 12 frames a chunk
    window = Window()
    spans = T.steady_spans(events, starts, window, "cpu_ready")
    return events, starts, window, spans


def test_energy_per_frame_over_the_steady_window_counts_a_shared_gpu_once():
    events, starts, window, spans = _run()
    assert len(spans) == 2 * 4 and all(b - a == 100 * MS and f == 12 for a, b, f in spans)
    end = events[-1].delivered + S
    one = _samples("GPU-a", 0, end, 300.0)
    shared = one + _samples("GPU-a", 5 * MS, end, 300.0)  # a DiT and a VAE rank sampling the same GPU
    tel = T.summarize(T.by_gpu(shared), spans, 10.0, "cpu_ready")
    assert tel.gpus == 1 and tel.intervals == 8 and tel.intervals_uncovered == 0
    assert tel.energy_per_frame_j == pytest.approx(300 * 0.1 / 12)
    assert tel.power_mean_w == pytest.approx(300.0)
    two = T.summarize(T.by_gpu(one + _samples("GPU-b", 0, end, 100.0)), spans, 10.0, "cpu_ready")
    assert two.gpus == 2 and two.energy_per_frame_j == pytest.approx(400 * 0.1 / 12)
    assert two.power_mean_w == pytest.approx(400.0)


def test_an_interval_the_samples_miss_is_left_out_and_counted():
    events, starts, window, spans = _run()
    late = _samples("GPU-a", spans[0][0] + MS, events[-1].delivered, 300.0)  # started inside the first interval
    tel = T.summarize(T.by_gpu(late), spans, 10.0, "cpu_ready")
    assert (tel.intervals, tel.intervals_uncovered) == (7, 1)
    assert tel.energy_per_frame_j == pytest.approx(300 * 0.1 / 12)


def test_throttle_flag_only_for_a_clock_lowering_reason_inside_the_steady_window():
    events, starts, window, spans = _run()
    end = events[-1].delivered
    inside = (spans[3][0] + spans[3][1]) // 2
    warmup = events[2].cpu_ready  # session 0 is warm-up: outside every steady interval
    assert not any(a < warmup <= b for a, b, _ in spans)
    hit = T.summarize(T.by_gpu(_samples("GPU-a", 0, end, 300.0, throttle_at=[inside])), spans, 10.0, "cpu_ready")
    assert hit.throttled and hit.throttle_reasons == {"SwPowerCap": 1}
    out = T.summarize(T.by_gpu(_samples("GPU-a", 0, end, 300.0, throttle_at=[warmup])), spans, 10.0, "cpu_ready")
    assert not out.throttled and out.throttle_reasons == {}
    idle = T.summarize(T.by_gpu(_samples("GPU-a", 0, end, 300.0, throttle_at=[inside], reason=("GpuIdle",))),
                       spans, 10.0, "cpu_ready")
    assert not idle.throttled


def test_throttle_bit_names_are_pynvmls():
    table = T.reason_table(vars(pynvml))
    mask = pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown
    assert T.throttle_names(mask, table) == ("SwPowerCap", "HwThermalSlowdown")
    assert T.throttle_names(pynvml.nvmlClocksEventReasonGpuIdle, table) == ("GpuIdle",)
    assert T.THROTTLING <= set(table.values())  # every flagged reason is a name NVML has
    assert T.throttle_names(1 << 40, table) == ("bit0x10000000000",)
    assert T.throttle_names(0, table) == ()


def test_a_throttled_run_is_flagged_and_the_headline_shows_the_flag_defined_and_the_energy():
    events, starts, window, spans = _run()
    inside = (spans[0][0] + spans[0][1]) // 2
    tel = T.summarize(T.by_gpu(_samples("GPU-a", 0, events[-1].delivered, 300.0, throttle_at=[inside])), spans, 10.0,
                      "cpu_ready")
    s = msgspec.to_builtins(run_summary(build_summary(events, starts, window=window), **RUN,
                                        telemetry=msgspec.to_builtins(tel)))
    assert FLAG_THROTTLED in s["flags"] and s["telemetry"]["energy_per_frame_j"] == pytest.approx(2.5)
    text = "\n".join(headline(s))
    assert f"flag {FLAG_THROTTLED}: {F.define(F.flag_figure(FLAG_THROTTLED)).formula}" in text
    assert f"{F.label('energy_per_frame')} 2.50" in text and f"{F.label('power_mean')} 300.0" in text
    plain = msgspec.to_builtins(run_summary(build_summary(events, starts, window=window), **RUN))
    assert "telemetry" not in plain and FLAG_THROTTLED not in plain["flags"]
    assert F.label("energy_per_frame") not in "\n".join(headline(plain))


def test_the_setting_line_says_telemetry_was_on():
    man = {"config": {"runtime": {"device": "cuda", "telemetry_hz": 10.0}}, "hooks": []}
    assert "hooks none · telemetry 10 Hz" in setting_line(man)
    assert "telemetry" not in setting_line({"config": {"runtime": {"device": "cuda", "telemetry_hz": 0.0}}})


def test_report_md_shows_the_telemetry_line_and_defines_its_figures_only_when_sampled():
    events, starts, window, spans = _run()
    tel = T.summarize(T.by_gpu(_samples("GPU-a", 0, events[-1].delivered, 300.0)), spans, 10.0, "cpu_ready")
    fig = msgspec.to_builtins(run_summary(build_summary(events, starts, window=window), **RUN, telemetry=msgspec.to_builtins(tel)))
    plain = msgspec.to_builtins(run_summary(build_summary(events, starts, window=window), **RUN))
    with_tel = R.RunView("a", "a", events, starts, fig, window)
    without = R.RunView("b", "b", events, starts, plain, window)
    assert any(l.startswith(f"- {F.label('energy_per_frame')} 2.50") for l in R.headline_section(with_tel, "a"))
    assert not any(F.label("energy_per_frame") in l for l in R.headline_section(without, "b"))
    assert set(T.TELEMETRY_FIGURES) <= set(R.used_figures([with_tel]))
    assert not set(T.TELEMETRY_FIGURES) & set(R.used_figures([without]))
