"""``summary.json``: the §4 figures of one run, with their definitions, sample counts and validity flags.

Every duration is in milliseconds (float); a figure with no sample is ``null``, never 0. The shape
is fixed (every key always present) so that reports and comparisons can rely on it; ``schema`` is
bumped when it changes.

Every figure here is defined once, with its label and formula, in ``measure.figures`` (the
keys below are its ``keys``); the report and the console print those labels. In short:
``fps_mean`` is Σ frames ÷ Σ intervals (frames ÷ the *mean* interval), ``fps_median`` the
frames ÷ interval of the nearest-rank median interval (the same sample as ``p50_ms``),
percentiles are nearest-rank, ``stages[*].share`` is of the sum of stage means and
``share_of_interval`` of the mean steady interval (> 1 in total under Case E); ``warmup`` is the
first warm-up session's compiled stages beside their steady P50 (the compile figure).
``blocked`` covers every chunk of every measured session (cancelled ones included: the producer
really was blocked), not only the steady window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import msgspec
import numpy as np

from harness.limits import MAX_JSON_BYTES, read_bounded
from harness.measure import metrics as M
from harness.measure import stats as S
from harness.measure.events import BOUNDARIES, ChunkEvent, SessionStart, validate_events
from harness.measure.goodput import LoadSummary
from harness.measure.slices import SlicesSummary
from harness.measure.stages import STAGES
from harness.measure.tails import TailSummary
from harness.measure.telemetry_figures import TelemetrySummary

#: 2: the headline gained fps_median (FPS P50 per interval) beside fps_steady
#: 3: fps_median is the FPS of the interval-P50 sample; ``warmup`` (the compile figure) added
#: 4: ``fps_steady`` renamed ``fps_mean``, the name of its figure (``upgrade_summary`` reads the old key)
SCHEMA = 4
#: old summary key → the figure's key it was renamed to, in ``boundaries[*]`` and ``headline``
RENAMED_KEYS = {"fps_steady": "fps_mean"}
#: the last schema whose figures changed rule: a summary older than it is recomputed from its events
RULE_SCHEMA = 3
SUMMARY_FILE = "summary.json"
DEFAULT_REFERENCE = "cpu_ready"
MAX_LISTED_VIOLATIONS = 20

FLAG_EMPTY = "empty"
FLAG_NO_MEASURED = "no_measured_sessions"
FLAG_REFERENCE_ABSENT = "reference_boundary_absent"
FLAG_TOO_FEW = "too_few_samples"
FLAG_ONE_SESSION = "one_session_ci_degenerate"
FLAG_MISSING = "missing_boundaries"
FLAG_CANCELLED = "has_cancelled"
FLAG_ORDER = "order_violations"
FLAG_NO_STARTS = "no_session_starts"
#: the driver saw a stage stall (``RunSummary.stalls``)
FLAG_STALLED = "stalled"
#: NVML reported a clock-lowering reason inside the steady window (``RunSummary.telemetry``)
FLAG_THROTTLED = "clocks_throttled"


class Dist(msgspec.Struct, frozen=True):
    n: int
    p50_ms: float | None = None
    p99_ms: float | None = None
    p99_is_max: bool = False
    min_ms: float | None = None
    max_ms: float | None = None
    mean_ms: float | None = None


class BoundarySummary(msgspec.Struct, frozen=True):
    intervals: Dist
    n_sessions: int
    expected: int
    skipped_missing: int
    skipped_nonpositive: int
    p50_ci_ms: tuple[float, float] | None
    p99_ci_ms: tuple[float, float] | None
    fps_mean: float | None
    fps_median: float | None


class StageSummary(msgspec.Struct, frozen=True):
    start: str
    end: str
    durations: Dist
    skipped_missing: int
    share: float | None
    share_of_interval: float | None


class GpuSummary(msgspec.Struct, frozen=True):
    n: int
    p50_ms: float
    mean_ms: float
    max_ms: float


class BlockedSummary(msgspec.Struct, frozen=True):
    total_ms: float
    max_ms: float
    mean_ms_per_chunk: float
    chunks: int
    chunks_blocked: int


class RolloutSummary(msgspec.Struct, frozen=True):
    time: Dist
    fps_median: float | None
    frames_per_session: int | None


class BootstrapDef(msgspec.Struct, frozen=True):
    n_boot: int
    seed: int
    confidence: float
    method: str


class WindowDef(msgspec.Struct, frozen=True):
    first_chunk: int
    last_chunk: int
    warmup_epochs: int
    reference_boundary: str
    definition: str
    percentile_rule: str
    bootstrap: BootstrapDef


class Counts(msgspec.Struct, frozen=True):
    events: int
    sessions_total: int
    sessions_warmup: int
    sessions_measured: int
    sessions_cancelled: int
    #: Measured, non-cancelled sessions that gave at least one steady interval at the reference.
    sessions_steady: int
    steady_intervals: int


class Headline(msgspec.Struct, frozen=True):
    """The reference boundary's figures, for the first line of a report."""

    boundary: str
    fps_mean: float | None
    p50_ms: float | None
    fps_median: float | None = None
    p99_ms: float | None = None
    p99_is_max: bool = False
    ttfc_p50_ms: float | None = None
    n: int = 0


class WarmupStage(msgspec.Struct, frozen=True):
    #: the stage on chunk 0 of the first warm-up session
    first_ms: float | None
    #: Σ over that session's chunks of (duration − steady P50, when positive)
    excess_ms: float | None
    steady_p50_ms: float | None


class WarmupSummary(msgspec.Struct, frozen=True):
    """The first warm-up session's compiled stages beside their steady medians: what compilation
    (and first-touch allocation) cost, reported as its own figure instead of as a stall."""

    chunks: int
    stages: dict[str, WarmupStage]


class Summary(msgspec.Struct, frozen=True):
    schema: int
    valid: bool
    flags: list[str]
    headline: Headline
    window: WindowDef
    counts: Counts
    boundaries: dict[str, BoundarySummary]
    ttfc: dict[str, Dist]
    rollout: RolloutSummary
    handoff: Dist
    stages: dict[str, StageSummary]
    gpu_ms: dict[str, GpuSummary]
    blocked: dict[str, BlockedSummary]
    absent_boundaries: list[str]
    order_violations: int
    violations: list[str]
    #: absent in summaries written before schema 3
    warmup: WarmupSummary | None = None
    #: chunk 0's setup and stages over the measured sessions (metrics.ttfc_parts); absent in older summaries
    ttfc_parts: dict[str, Dist] | None = None


# ---- small pure pieces ---------------------------------------------------------------------


def ms(ns: float | None) -> float | None:
    return None if ns is None else float(ns) / 1e6


def dist(values_ns: Sequence[int] | np.ndarray) -> Dist:
    v = np.asarray(values_ns, dtype=np.float64)
    if v.size == 0:
        return Dist(0)
    p99 = S.percentile(v, 99)
    return Dist(
        n=int(v.size),
        p50_ms=ms(S.nearest_rank(v, 50)),
        p99_ms=ms(p99.value),
        p99_is_max=p99.flagged,
        min_ms=ms(v.min()),
        max_ms=ms(v.max()),
        mean_ms=ms(v.mean()),
    )


def _ci_ms(per_session: list[list[int]], p: float, boot: BootstrapDef, block_length: int | None) -> tuple[float, float] | None:
    if not per_session or boot.n_boot <= 0:
        return None
    e = S.bootstrap_percentile(per_session, p, n_boot=boot.n_boot, seed=boot.seed, confidence=boot.confidence, block_length=block_length)
    return (ms(e.low), ms(e.high))


def boundary_summary(sel: M.Selection, boot: BootstrapDef, block_length: int | None) -> BoundarySummary:
    per_session = sel.per_session()
    return BoundarySummary(
        intervals=dist(sel.ns()),
        n_sessions=len(per_session),
        expected=sel.expected,
        skipped_missing=sel.skipped_missing,
        skipped_nonpositive=sel.skipped_nonpositive,
        p50_ci_ms=_ci_ms(per_session, 50, boot, block_length),
        p99_ci_ms=_ci_ms(per_session, 99, boot, block_length),
        fps_mean=M.steady_fps(sel.samples),
        fps_median=M.median_interval_fps(sel.samples),
    )


def stage_summaries(stages: dict[str, M.Selection], interval_mean_ms: float | None) -> dict[str, StageSummary]:
    dists = {name: dist(sel.ns()) for name, sel in stages.items()}
    shares = M.stage_shares({n: d.mean_ms for n, d in dists.items() if d.n})
    out = {}
    for name, start, end in STAGES:
        d = dists[name]
        of_interval = d.mean_ms / interval_mean_ms if d.n and interval_mean_ms else None
        out[name] = StageSummary(start, end, d, stages[name].skipped_missing, shares.get(name), of_interval)
    return out


def warmup_summary(events: Sequence[ChunkEvent], window: M.Window, stages: dict[str, StageSummary]) -> WarmupSummary | None:
    if not M.warmup_session(events, window):
        return None
    out = {}
    for st in M.COMPILED_STAGES:
        d = M.warmup_durations(events, st, window)
        p50 = stages[st].durations.p50_ms if st in stages else None
        excess = ms(M.excess_over(list(d.values()), p50 * 1e6)) if d and p50 is not None else None
        out[st] = WarmupStage(ms(d.get(0)), excess, p50)
    return WarmupSummary(len(M.warmup_session(events, window)), out)


def gpu_summaries(gpu: dict[str, list[float]]) -> dict[str, GpuSummary]:
    return {
        k: GpuSummary(len(v), S.nearest_rank(v, 50), float(np.mean(v)), float(np.max(v))) for k, v in gpu.items() if v
    }


def blocked_summaries(blocked: dict[str, M.Blocked]) -> dict[str, BlockedSummary]:
    return {
        k: BlockedSummary(ms(b.total_ns), ms(b.max_ns), ms(b.total_ns / b.chunks), b.chunks, b.chunks_blocked)
        for k, b in blocked.items()
    }


def rollout_summary(per: M.PerSession) -> RolloutSummary:
    rolls = list(per.values.values())
    if not rolls:
        return RolloutSummary(Dist(0), None, None)
    frames = {r.frames for r in rolls}
    return RolloutSummary(
        time=dist([r.ns for r in rolls]),
        fps_median=S.nearest_rank([r.fps for r in rolls], 50),
        frames_per_session=frames.pop() if len(frames) == 1 else None,
    )


# ---- the summary ---------------------------------------------------------------------------


def unique_chunks(events: Sequence[ChunkEvent]) -> list[ChunkEvent]:
    """The first record of every chunk. A duplicated chunk cannot be measured without picking one
    copy; the order violation (and its flag) says the table had one."""
    seen, unique = set(), []
    for e in events:
        if e.key not in seen:
            seen.add(e.key)
            unique.append(e)
    return unique


def session_keys(events: Sequence[ChunkEvent], sessions: Sequence[SessionStart], window: M.Window) -> tuple[set, set]:
    """(every session, the measured ones): sessions of chunks and of session starts alike."""
    all_keys = {(e.session, e.epoch) for e in events} | {s.key for s in sessions}
    return all_keys, {k for k in all_keys if window.measured(k[1])}


def session_counts(events: Sequence[ChunkEvent], sessions: Sequence[SessionStart], window: M.Window,
                   ref: BoundarySummary | None) -> Counts:
    all_keys, measured = session_keys(events, sessions, window)
    return Counts(
        events=len(events),
        sessions_total=len(all_keys),
        sessions_warmup=len(all_keys) - len(measured),
        sessions_measured=len(measured),
        sessions_cancelled=len(measured & M.cancelled_keys(events, sessions)),
        sessions_steady=ref.n_sessions if ref else 0,
        steady_intervals=ref.intervals.n if ref else 0,
    )


def flags_and_validity(events: Sequence[ChunkEvent], sessions: Sequence[SessionStart], window: M.Window,
                       reference: str, boundaries: dict[str, BoundarySummary], counts: Counts,
                       violations: list[str]) -> tuple[list[str], bool]:
    """The summary's flags, and whether it is valid: invalid when there is nothing to report at the
    reference or the table contradicts itself. Few samples, cancellations and absent starts are
    reported, not disqualifying."""
    cancelled = M.cancelled_keys(events, sessions)
    _, measured = session_keys(events, sessions, window)
    flags = set()
    if not events:
        flags.add(FLAG_EMPTY)
    if not measured - cancelled:
        flags.add(FLAG_NO_MEASURED)
    if events and reference not in boundaries:
        flags.add(FLAG_REFERENCE_ABSENT)
    if counts.steady_intervals < S.min_samples(99):
        flags.add(FLAG_TOO_FEW)
    if counts.sessions_steady == 1:
        flags.add(FLAG_ONE_SESSION)
    if any(s.skipped_missing for s in boundaries.values()):
        flags.add(FLAG_MISSING)
    if cancelled:
        flags.add(FLAG_CANCELLED)
    if violations:
        flags.add(FLAG_ORDER)
    if events and not sessions:
        flags.add(FLAG_NO_STARTS)
    valid = not flags & {FLAG_EMPTY, FLAG_NO_MEASURED, FLAG_REFERENCE_ABSENT, FLAG_ORDER} and counts.steady_intervals > 0
    return sorted(flags), valid


def headline_of(reference: str, ref: BoundarySummary | None, ttfc: dict[str, Dist], counts: Counts) -> Headline:
    return Headline(
        boundary=reference,
        fps_mean=ref.fps_mean if ref else None,
        p50_ms=ref.intervals.p50_ms if ref else None,
        fps_median=ref.fps_median if ref else None,
        p99_ms=ref.intervals.p99_ms if ref else None,
        p99_is_max=ref.intervals.p99_is_max if ref else False,
        ttfc_p50_ms=ttfc[reference].p50_ms if reference in ttfc else None,
        n=counts.steady_intervals,
    )


def window_def(window: M.Window, reference: str, boot: BootstrapDef) -> WindowDef:
    return WindowDef(
        window.first_chunk, window.last_chunk, window.warmup_epochs, reference, window.describe(),
        "nearest-rank: P_p is the ceil(p*n/100)-th smallest sample; P99 with n < 100 is the maximum (p99_is_max)",
        boot,
    )


def build_summary(
    events: Sequence[ChunkEvent],
    sessions: Sequence[SessionStart] = (),
    *,
    window: M.Window = M.DEFAULT_WINDOW,
    reference: str = DEFAULT_REFERENCE,
    n_boot: int = S.DEFAULT_BOOT,
    seed: int = S.DEFAULT_SEED,
    confidence: float = S.DEFAULT_CONFIDENCE,
    block_length: int | None = None,
) -> Summary:
    if reference not in BOUNDARIES:
        raise KeyError(f"unknown reference boundary {reference!r}")
    events, sessions = list(events), list(sessions)
    violations = validate_events(events, sessions)
    events = unique_chunks(events)

    boot = BootstrapDef(n_boot, seed, confidence, S.bootstrap_method(block_length))
    seen_b = M.boundaries_seen(events)
    boundaries = {b: boundary_summary(M.steady_intervals(events, b, window, sessions), boot, block_length) for b in seen_b}
    ref = boundaries.get(reference)
    counts = session_counts(events, sessions, window, ref)
    ttfc = {b: dist(M.ttfc(events, sessions, b, window).ns()) for b in seen_b} if sessions else {}
    flags, valid = flags_and_validity(events, sessions, window, reference, boundaries, counts, violations)
    steady, _, _ = M.steady_chunks(events, sessions, window)
    stages = stage_summaries(M.steady_stages(events, window, sessions), ref.intervals.mean_ms if ref else None)
    return Summary(
        schema=SCHEMA,
        valid=valid,
        flags=flags,
        headline=headline_of(reference, ref, ttfc, counts),
        window=window_def(window, reference, boot),
        counts=counts,
        boundaries=boundaries,
        ttfc=ttfc,
        rollout=rollout_summary(M.rollouts(events, sessions, reference, window)) if sessions else RolloutSummary(Dist(0), None, None),
        handoff=dist(M.handoffs(events, window, sessions).ns()),
        stages=stages,
        gpu_ms=gpu_summaries(M.gpu_times(steady)),
        blocked=blocked_summaries(M.blocked_time(M.measured_chunks(events, sessions, window))),
        absent_boundaries=[b for b in BOUNDARIES if b not in seen_b],
        order_violations=len(violations),
        violations=violations[:MAX_LISTED_VIOLATIONS],
        warmup=warmup_summary(events, window, stages),
        ttfc_parts={k: dist(v.ns()) for k, v in M.ttfc_parts(events, sessions, window).items()} if sessions else None,
    )


def summary_to_dict(summary: Summary) -> dict:
    return msgspec.to_builtins(summary)


# ---- the run's summary.json ----------------------------------------------------------------


class RunSummary(Summary, kw_only=True, omit_defaults=True):
    """What ``summary.json`` holds: the figures (``Summary``) and how the run went — written once,
    by the driver when the run ends (``drivers.rundir.write_json``, whole or not at all)."""

    #: how the run ended: "complete", "failed", "interrupted", …
    status: str
    error: str | None = None
    hooks: list[str]
    candidates: list[str]
    #: what the driver measured about the launch (clock offsets, IPC probes)
    probes: dict
    sessions_completed: int
    #: every stall seen (a stage owing a reply silent for ``stall_report_s``)
    stalls: list[dict]
    stall_report_s: float
    #: the measurement protocol (``experiments.serve``) and what it adds
    protocol: str
    long_tail: TailSummary | None = None
    #: the protocol's addition failed: why (the run's own figures are kept)
    summary_extra_error: str | None = None
    #: --telemetry: energy per frame, mean power, throttling over the steady window (measure.telemetry_figures)
    telemetry: TelemetrySummary | None = None
    #: ``load``: offered and served load, outcomes, goodput against the SLO, early stopping
    load: LoadSummary | None = None
    #: ``load --slice``: the delivery-interval P50 per slice of the run, drift flagged
    slices: SlicesSummary | None = None


_RUN_FIELDS = frozenset(RunSummary.__struct_fields__) - frozenset(Summary.__struct_fields__)


def run_summary(summary: Summary, **run: Any) -> RunSummary:
    """``summary`` with how the run went (``RunSummary``'s own fields, checked against their types;
    a protocol's addition may come as plain JSON); a run with stalls gains the ``stalled`` flag, one
    whose GPUs throttled inside the steady window ``clocks_throttled``."""
    unknown = set(run) - _RUN_FIELDS
    if unknown:
        raise TypeError(f"summary.json has no field {', '.join(sorted(unknown))}")
    flags = [*summary.flags, FLAG_STALLED] if run.get("stalls") else list(summary.flags)
    if (run.get("telemetry") or {}).get("throttled"):
        flags.append(FLAG_THROTTLED)
    return msgspec.convert({**msgspec.to_builtins(summary), "flags": flags, **run}, RunSummary)


def upgrade_summary(d: dict) -> dict:
    """A summary of an older schema with its renamed keys under their figures' names (``RENAMED_KEYS``),
    so old run directories read as new ones; the figures themselves are as they were computed."""
    def renamed(x: dict) -> dict:
        return {RENAMED_KEYS.get(k, k): v for k, v in x.items()} if isinstance(x, dict) else x

    out = dict(d)
    if isinstance(d.get("headline"), dict):
        out["headline"] = renamed(d["headline"])
    if isinstance(d.get("boundaries"), dict):
        out["boundaries"] = {b: renamed(x) for b, x in d["boundaries"].items()}
    return out


def read_summary(path: str | Path) -> RunSummary:
    raw = msgspec.json.decode(read_bounded(path, MAX_JSON_BYTES, "summary"))
    return msgspec.convert(upgrade_summary(raw) if isinstance(raw, dict) else raw, RunSummary)
