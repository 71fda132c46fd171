"""GPU telemetry's figures: energy per delivered frame, mean power and whether the clocks were
throttled, over the steady window (``hooks.telemetry`` samples NVML into ``telemetry.*.jsonl``).

A sample is one reading of one GPU on the harness's clock (``measure.clock.now``, the clock of
``events.jsonl``), so a sample can be placed inside a delivery interval. Energy is the trapezoid
integral of the power readings over each steady interval (cpu_ready(i−1), cpu_ready(i)] — the
same samples as ``fps_mean`` — with the power at the interval's ends interpolated between the
readings around them; an interval the readings do not cover is left out and counted, never
extrapolated. GPUs are told apart by their NVML UUID: two processes sharing a GPU (a DiT rank
and a VAE rank in the shared placement) both sample it, into one series, so its energy is counted once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import msgspec
import numpy as np

from harness.measure import figures as F
from harness.measure import metrics as M
from harness.measure.events import ChunkEvent, SessionStart

#: one file per sampling process (``telemetry.dit0.jsonl``, ``telemetry.vae0.jsonl``)
TELEMETRY_GLOB = "telemetry.*.jsonl"

#: The NVML clock-event reasons that lower the clocks below what the work asked for: power and
#: thermal limits and the hardware's own slowdowns. ``GpuIdle`` (nothing to run),
#: ``ApplicationsClocksSetting``/``UserDefinedClocks`` (clocks someone set), ``SyncBoost`` and
#: ``DisplayClockSetting`` are reasons the clocks differ from the maximum that are not a limit the
#: work ran into, so they raise no flag.
THROTTLING = frozenset({"SwPowerCap", "HwSlowdown", "SwThermalSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown"})


class TelemetrySample(msgspec.Struct, frozen=True, kw_only=True):
    """One NVML reading of one GPU (a line of ``telemetry.*.jsonl``)."""

    t_ns: int  # harness clock (measure.clock.now), comparable with events.jsonl
    gpu: str  # NVML UUID
    index: int  # the device's CUDA index in the sampling process
    power_w: float | None = None
    sm_clock_mhz: int | None = None
    memory_used_bytes: int | None = None
    util_gpu_pct: int | None = None
    util_memory_pct: int | None = None
    temperature_c: int | None = None
    #: NVML's clock-event (throttle) reasons bitmask, and its set bits' names
    throttle_mask: int = 0
    throttle: tuple[str, ...] = ()


class TelemetrySummary(msgspec.Struct, frozen=True, kw_only=True):
    """``summary.json``'s ``telemetry``: what the samples say about the steady window."""

    hz: float
    gpus: int
    samples: int
    boundary: str
    #: Σ over steady intervals and GPUs of ∫ power dt ÷ Σ frames of those intervals
    energy_per_frame_j: float | None
    #: Σ energy ÷ Σ interval time (all GPUs together)
    power_mean_w: float | None
    #: steady intervals integrated, and those the samples did not cover (left out)
    intervals: int
    intervals_uncovered: int
    #: a sample inside a steady interval carried a THROTTLING reason
    throttled: bool
    #: the throttling reasons seen inside the steady window, and on how many samples
    throttle_reasons: dict[str, int] = {}
    sm_clock_mhz_min: int | None = None
    sm_clock_mhz_max: int | None = None
    temperature_c_max: int | None = None


# ---- small pure pieces -------------------------------------------------------------------


def reason_table(constants: dict[str, int]) -> dict[int, str]:
    """bit → name from NVML's constants (``nvmlClocksEventReasonSwPowerCap`` → ``SwPowerCap``),
    single bits only (``All`` and ``None`` are not reasons)."""
    out: dict[int, str] = {}
    for name, bit in constants.items():
        for prefix in ("nvmlClocksEventReason", "nvmlClocksThrottleReason"):
            if name.startswith(prefix) and isinstance(bit, int) and bit > 0 and bit & (bit - 1) == 0:
                out.setdefault(bit, name[len(prefix):])
    return out


def throttle_names(mask: int, table: dict[int, str]) -> tuple[str, ...]:
    """The names of the set bits of ``mask``, lowest bit first; a bit NVML's table does not name
    reads ``bit0x…`` rather than vanish."""
    out, bit = [], 1
    while bit <= mask:
        if mask & bit:
            out.append(table.get(bit, f"bit{bit:#x}"))
        bit <<= 1
    return tuple(out)


def energy_j(t_ns: np.ndarray, watts: np.ndarray, start_ns: int, end_ns: int) -> float | None:
    """∫ power dt over [start, end] by the trapezoid rule through the readings inside it and the
    power interpolated at both ends; None when the readings do not reach both ends (never
    extrapolated). ``t_ns`` ascending."""
    if t_ns.size < 2 or start_ns < t_ns[0] or end_ns > t_ns[-1] or end_ns <= start_ns:
        return None
    inside = (t_ns > start_ns) & (t_ns < end_ns)
    grid = np.concatenate(([start_ns], t_ns[inside], [end_ns])).astype(np.float64)
    p = np.interp(grid, t_ns.astype(np.float64), watts)
    return float(np.sum((p[1:] + p[:-1]) * np.diff(grid)) / 2 / 1e9)


def steady_spans(events: Sequence[ChunkEvent], sessions: Sequence[SessionStart], window: M.Window,
                 boundary: str) -> list[tuple[int, int, int]]:
    """(start ns, end ns, frames) of every steady interval at ``boundary``: ``fps_mean``'s samples."""
    table = M.session_table(events)
    sel = M.steady_intervals(events, boundary, window, sessions)
    out = []
    for s in sel.samples:
        end = table[s.key][s.chunk].at(boundary)
        out.append((int(end - s.ns), int(end), s.frames))
    return out


def by_gpu(samples: Iterable[TelemetrySample]) -> dict[str, list[TelemetrySample]]:
    """Per GPU, its samples in time order: the readings of processes sampling one GPU are merged
    into one series of that GPU, so a shared GPU's energy is counted once."""
    out: dict[str, list[TelemetrySample]] = {}
    for s in samples:
        out.setdefault(s.gpu, []).append(s)
    return {g: sorted(v, key=lambda s: s.t_ns) for g, v in out.items()}


def _in_spans(t: int, spans: Sequence[tuple[int, int, int]]) -> bool:
    return any(a < t <= b for a, b, _ in spans)


def throttled_samples(samples: Sequence[TelemetrySample], spans: Sequence[tuple[int, int, int]]) -> dict[str, int]:
    """Per THROTTLING reason, how many samples inside a steady interval carried it."""
    out: dict[str, int] = {}
    for s in samples:
        if _in_spans(s.t_ns, spans):
            for r in s.throttle:
                if r in THROTTLING:
                    out[r] = out.get(r, 0) + 1
    return dict(sorted(out.items()))


def summarize(per_gpu: dict[str, list[TelemetrySample]], spans: Sequence[tuple[int, int, int]], hz: float,
              boundary: str) -> TelemetrySummary:
    """The steady window's energy per frame, mean power and throttle flag over every GPU."""
    total_j = total_ns = frames = covered = uncovered = 0
    series = {g: (np.array([s.t_ns for s in v if s.power_w is not None], dtype=np.int64),
                  np.array([s.power_w for s in v if s.power_w is not None], dtype=np.float64)) for g, v in per_gpu.items()}
    for a, b, f in spans:
        parts = [energy_j(t, w, a, b) for t, w in series.values()]
        if not parts or any(p is None for p in parts):
            uncovered += 1
            continue
        covered += 1
        total_j += sum(parts)
        total_ns += b - a
        frames += f
    steady = [s for v in per_gpu.values() for s in v if _in_spans(s.t_ns, spans)]
    reasons = throttled_samples(steady, spans)
    clocks = [s.sm_clock_mhz for s in steady if s.sm_clock_mhz is not None]
    temps = [s.temperature_c for s in steady if s.temperature_c is not None]
    return TelemetrySummary(
        hz=hz, gpus=len(per_gpu), samples=sum(len(v) for v in per_gpu.values()), boundary=boundary,
        energy_per_frame_j=total_j / frames if frames else None,
        power_mean_w=total_j / (total_ns / 1e9) if total_ns else None,
        intervals=covered, intervals_uncovered=uncovered, throttled=bool(reasons), throttle_reasons=reasons,
        sm_clock_mhz_min=min(clocks) if clocks else None, sm_clock_mhz_max=max(clocks) if clocks else None,
        temperature_c_max=max(temps) if temps else None,
    )


# ---- the run directory ----------------------------------------------------------------------


def read_samples(run_dir: str | Path) -> list[TelemetrySample]:
    """Every complete line of the run's telemetry files (a process killed mid-line leaves a cut
    last line: it is not a sample)."""
    out: list[TelemetrySample] = []
    dec = msgspec.json.Decoder(TelemetrySample)
    for p in sorted(Path(run_dir).glob(TELEMETRY_GLOB)):
        for line in p.read_bytes().splitlines():
            try:
                out.append(dec.decode(line))
            except msgspec.DecodeError:
                continue
    return out


def run_telemetry(run_dir: str | Path, events: Sequence[ChunkEvent], sessions: Sequence[SessionStart],
                  window: M.Window, hz: float, boundary: str) -> TelemetrySummary | None:
    """The run's telemetry summary, or None when it sampled nothing (telemetry off)."""
    samples = read_samples(run_dir)
    if not samples:
        return None
    return summarize(by_gpu(samples), steady_spans(events, sessions, window, boundary), hz, boundary)


#: the figures the telemetry line prints (``measure.figures``)
TELEMETRY_FIGURES = ("energy_per_frame", "power_mean", "telemetry_gpus")


def telemetry_line(tel: dict | None) -> str | None:
    """``energy J/frame 41.2 · GPU power mean W 512.3 · GPUs sampled 1 (10 Hz …)``, labels from
    ``measure.figures``; None when the run sampled nothing."""
    if not tel:
        return None

    def num(x, fmt):
        return "—" if x is None else fmt.format(x)

    clocks = (f"; SM clock {tel['sm_clock_mhz_min']}–{tel['sm_clock_mhz_max']} MHz"
              if tel.get("sm_clock_mhz_min") is not None else "")
    temp = f", max {tel['temperature_c_max']} °C" if tel.get("temperature_c_max") is not None else ""
    return (f"{F.label('energy_per_frame')} {num(tel.get('energy_per_frame_j'), '{:.2f}')} · "
            f"{F.label('power_mean')} {num(tel.get('power_mean_w'), '{:.1f}')} · {F.label('telemetry_gpus')} {tel.get('gpus', 0)} "
            f"({tel.get('hz', 0):g} Hz, {tel.get('samples', 0)} samples; {tel.get('intervals', 0)} steady intervals at "
            f"{tel.get('boundary', '?')}, {tel.get('intervals_uncovered', 0)} not covered{clocks}{temp})")
