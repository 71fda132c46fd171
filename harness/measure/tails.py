"""Long-tail figures (DESIGN §4, long-tail protocol): tail percentiles with session-bootstrap
intervals, and the slowest steady samples broken down by boundary and by stage.

A slow interval is explained by comparing the chunk with the *typical* chunk of the same run:

- per boundary B: the chunk's interval B(i) − B(i−1) against the median steady interval at B.
- where the delay entered (``first_late``): every boundary of chunk i measured from the previous
  chunk's reference boundary, B(i) − R(i−1), against its steady median (``lateness``). Walking the
  boundaries in data-flow order, the first one already late by at least half of the reference
  excess is where the delay entered. Anchoring at R(i−1) rather than B(i−1) matters: when chunk
  i−1 was slow, B(i) − B(i−1) at the boundaries upstream of i−1's delay inherits it (a closed-loop
  driver submits chunk i late), though nothing in chunk i was slow there.
- per stage: every stage of ``measure.stages`` of chunk i, plus ``gap`` = cpu_ready(i−1) →
  submit(i) (the driver's reaction, which no segment covers), against that stage's median over the
  steady chunks. ``grew`` is the stage with the largest excess: the one that made the sample slow.

Medians are nearest-rank (``stats``), like every other figure; all times in milliseconds.
"""

from __future__ import annotations

from typing import Sequence

import msgspec
import numpy as np

from harness.measure import metrics as M
from harness.measure import stats as S
from harness.measure.events import BOUNDARIES, ChunkEvent, SessionStart
from harness.measure.stages import GAP as GAP_STAGE
from harness.measure.stages import STAGE_NAMES

DEFAULT_SLOWEST = 10
TAIL_PERCENTILES: tuple[float, ...] = (50, 95, 99)
GAP = GAP_STAGE.name
#: Stages a slow sample is attributed to: the stages that tile submit → delivered, then the gap.
ATTRIBUTED_STAGES: tuple[str, ...] = STAGE_NAMES + (GAP,)
#: A boundary is "late" once its excess reaches this fraction of the reference boundary's excess.
LATE_FRACTION = 0.5


class Excess(msgspec.Struct, frozen=True):
    ms: float
    median_ms: float | None
    #: ms − median_ms; None when the run has no median for it.
    excess_ms: float | None


class SlowSample(msgspec.Struct, frozen=True):
    rank: int
    session: int
    epoch: int
    chunk: int
    boundary: str
    interval_ms: float
    median_ms: float
    excess_ms: float
    #: interval at every boundary both chunks recorded, data-flow order
    boundaries: dict[str, Excess]
    #: duration of every stage (``stages.STAGES`` + gap) this chunk recorded
    stages: dict[str, Excess]
    grew: str | None
    first_late: str | None
    #: B(i) − R(i−1) at every boundary, R = the reference boundary: what ``first_late`` reads
    lateness: dict[str, Excess] = {}


class TailPercentile(msgspec.Struct, frozen=True):
    p: float
    ms: float
    low_ms: float | None
    high_ms: float | None
    #: too few samples for this percentile: it is the maximum
    is_max: bool


class BoundaryTail(msgspec.Struct, frozen=True):
    n: int
    n_sessions: int
    percentiles: list[TailPercentile]
    max_ms: float


class TailSummary(msgspec.Struct, frozen=True):
    reference: str
    slowest_requested: int
    boundaries: dict[str, BoundaryTail]
    slowest: list[SlowSample]
    #: how often each stage was the one that grew, over the slowest samples
    culprits: dict[str, int]
    definition: str


def _ms(ns: float) -> float:
    return float(ns) / 1e6


def _median(values: Sequence[int]) -> float | None:
    return S.nearest_rank(values, 50) if len(values) else None


def _excess(ns: int, median_ns: float | None) -> Excess:
    return Excess(_ms(ns), None if median_ns is None else _ms(median_ns), None if median_ns is None else _ms(ns - median_ns))


def stage_times(cur: ChunkEvent, prev: ChunkEvent | None) -> dict[str, int]:
    """Every stage of chunk ``cur`` (``stages.STAGES``, and ``gap`` when the previous chunk is given)."""
    out = M.stage_durations(cur)
    a, z = (prev.at(GAP_STAGE.start) if prev is not None else None), cur.at(GAP_STAGE.end)
    if a is not None and z is not None:
        out[GAP] = z - a
    return out


def stage_medians(steady: Sequence[tuple[ChunkEvent, ChunkEvent | None]]) -> dict[str, float]:
    """Median of every stage over (chunk, previous chunk) pairs of the steady window."""
    acc: dict[str, list[int]] = {}
    for cur, prev in steady:
        for k, v in stage_times(cur, prev).items():
            acc.setdefault(k, []).append(v)
    return {k: _median(v) for k, v in acc.items() if v}


def boundary_intervals(cur: ChunkEvent, prev: ChunkEvent) -> dict[str, int]:
    """B(i) − B(i−1) at every boundary both chunks recorded, in data-flow order."""
    return {b: cur.at(b) - prev.at(b) for b in BOUNDARIES if cur.at(b) is not None and prev.at(b) is not None}


def grew(stages: dict[str, Excess]) -> str | None:
    """The stage with the largest positive excess (ties: the earliest in data-flow order)."""
    best, best_x = None, 0.0
    for name in ATTRIBUTED_STAGES:
        x = stages.get(name)
        if x is not None and x.excess_ms is not None and x.excess_ms > best_x:
            best, best_x = name, x.excess_ms
    return best


def since_reference(cur: ChunkEvent, prev: ChunkEvent, reference: str) -> dict[str, int]:
    """B(i) − R(i−1) at every boundary chunk i recorded, in data-flow order (empty without R(i−1))."""
    r = prev.at(reference)
    if r is None:
        return {}
    return {b: cur.at(b) - r for b in BOUNDARIES if cur.at(b) is not None}


def first_late(lateness: dict[str, Excess], reference_excess_ms: float) -> str | None:
    """Earliest boundary late (``since_reference``) by ≥ LATE_FRACTION of the reference excess."""
    if reference_excess_ms <= 0:
        return None
    for b in BOUNDARIES:
        x = lateness.get(b)
        if x is not None and x.excess_ms is not None and x.excess_ms >= LATE_FRACTION * reference_excess_ms:
            return b
    return None


def _steady_pairs(
    events: Sequence[ChunkEvent], sessions: Sequence[SessionStart], window: M.Window
) -> list[tuple[ChunkEvent, ChunkEvent | None]]:
    table = M.session_table(events)
    chunks, _, _ = M.steady_chunks(events, sessions, window)
    return [(e, table[(e.session, e.epoch)].get(e.chunk - 1)) for e in chunks]


def slowest_samples(
    events: Sequence[ChunkEvent],
    sessions: Sequence[SessionStart] = (),
    window: M.Window = M.DEFAULT_WINDOW,
    reference: str = "cpu_ready",
    k: int = DEFAULT_SLOWEST,
) -> list[SlowSample]:
    """The ``k`` longest steady intervals at ``reference``, each broken down by boundary and stage.

    Ties are broken by run order (epoch, session, chunk), so the list is deterministic.
    """
    sel = M.steady_intervals(events, reference, window, sessions)
    if not sel.n or k <= 0:
        return []
    table = M.session_table(events)
    pairs = _steady_pairs(events, sessions, window)
    stage_med = stage_medians(pairs)
    bound_med = {
        b: _median(M.steady_intervals(events, b, window, sessions).ns().tolist()) for b in M.boundaries_seen(events)
    }
    ref_med = bound_med[reference]
    late_acc: dict[str, list[int]] = {}
    for cur, prev in pairs:
        for b, v in (since_reference(cur, prev, reference) if prev is not None else {}).items():
            late_acc.setdefault(b, []).append(v)
    late_med = {b: _median(v) for b, v in late_acc.items()}
    ranked = sorted(sel.samples, key=lambda s: (-s.ns, s.epoch, s.session, s.chunk))[:k]
    out = []
    for rank, s in enumerate(ranked, 1):
        chunks = table[(s.session, s.epoch)]
        cur, prev = chunks[s.chunk], chunks[s.chunk - 1]
        bounds = {b: _excess(v, bound_med.get(b)) for b, v in boundary_intervals(cur, prev).items()}
        stages = {n: _excess(v, stage_med.get(n)) for n, v in stage_times(cur, prev).items()}
        late = {b: _excess(v, late_med.get(b)) for b, v in since_reference(cur, prev, reference).items()}
        excess_ms = _ms(s.ns - ref_med)
        out.append(SlowSample(
            rank=rank, session=s.session, epoch=s.epoch, chunk=s.chunk, boundary=reference,
            interval_ms=_ms(s.ns), median_ms=_ms(ref_med), excess_ms=excess_ms,
            boundaries=bounds, stages=dict(sorted(stages.items(), key=lambda kv: ATTRIBUTED_STAGES.index(kv[0]))),
            # a sample no slower than the median has nothing to explain
            grew=grew(stages) if excess_ms > 0 else None, first_late=first_late(late, excess_ms), lateness=late,
        ))
    return out


def culprit_counts(samples: Sequence[SlowSample]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in samples:
        if s.grew is not None:
            counts[s.grew] = counts.get(s.grew, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], ATTRIBUTED_STAGES.index(kv[0]))))


def boundary_tail(
    sel: M.Selection, *, n_boot: int = S.DEFAULT_BOOT, seed: int = S.DEFAULT_SEED, confidence: float = S.DEFAULT_CONFIDENCE,
) -> BoundaryTail | None:
    """P50/P95/P99 with session-bootstrap intervals, and the maximum, of one boundary's intervals."""
    per_session = sel.per_session()
    if not per_session:
        return None
    v = sel.ns()
    pct = []
    for p in TAIL_PERCENTILES:
        point = S.percentile(v, p)
        low = high = None
        if n_boot > 0:
            e = S.bootstrap_percentile(per_session, p, n_boot=n_boot, seed=seed, confidence=confidence)
            low, high = _ms(e.low), _ms(e.high)
        pct.append(TailPercentile(p=float(p), ms=_ms(point.value), low_ms=low, high_ms=high, is_max=point.flagged))
    return BoundaryTail(n=int(v.size), n_sessions=len(per_session), percentiles=pct, max_ms=_ms(np.max(v)))


def tail_summary(
    events: Sequence[ChunkEvent],
    sessions: Sequence[SessionStart] = (),
    window: M.Window = M.DEFAULT_WINDOW,
    *,
    reference: str = "cpu_ready",
    boundaries: Sequence[str] = ("cpu_ready", "encoded", "delivered"),
    k: int = DEFAULT_SLOWEST,
    n_boot: int = S.DEFAULT_BOOT,
    seed: int = S.DEFAULT_SEED,
    confidence: float = S.DEFAULT_CONFIDENCE,
) -> TailSummary:
    seen = set(M.boundaries_seen(events))
    tails = {}
    for b in boundaries:
        if b in seen:
            t = boundary_tail(M.steady_intervals(events, b, window, sessions), n_boot=n_boot, seed=seed, confidence=confidence)
            if t is not None:
                tails[b] = t
    slow = slowest_samples(events, sessions, window, reference, k) if reference in seen else []
    return TailSummary(
        reference=reference,
        slowest_requested=k,
        boundaries=tails,
        slowest=slow,
        culprits=culprit_counts(slow),
        definition=(
            f"slowest steady intervals at {reference}; per boundary B: B(i)-B(i-1) vs the median steady interval "
            f"at B; first_late: first boundary B whose B(i)-{reference}(i-1) is late by >= {LATE_FRACTION:g} x the reference "
            f"excess; per stage: "
            f"each segment of chunk i and gap = cpu_ready(i-1) -> submit(i) vs that stage's steady median "
            f"(grew: largest excess); percentiles nearest-rank with session-bootstrap intervals"
        ),
    )


# ---- the tables a person reads (console and report), from summary.json's ``long_tail`` ---------

#: Columns of the slowest-samples table, by ``measure.figures`` name.
SLOWEST_COLUMNS: tuple[str, ...] = ("rank", "epoch", "chunk", "slow_interval", "slow_excess", "slow_grew", "slow_first_late")


def percentile_table(long_tail: dict) -> tuple[tuple[str, ...], list[list[str]]]:
    """(columns by figure name, one row of cells per boundary): the tail percentiles (``*``: the
    maximum, too few samples), the maximum and the sample counts."""
    pcts = [p["p"] for t in list(long_tail["boundaries"].values())[:1] for p in t["percentiles"]]
    cols = ("boundary", *(f"interval_p{p:g}" for p in pcts), "interval_max", "n", "sessions")
    rows = [[b, *(f"{p['ms']:.1f}" + ("*" if p["is_max"] else "") for p in t["percentiles"]), f"{t['max_ms']:.1f}",
             str(t["n"]), str(t["n_sessions"])] for b, t in long_tail["boundaries"].items()]
    return cols, rows


def slowest_table(long_tail: dict, top: int | None = None) -> list[list[str]]:
    """Rows of cells for ``SLOWEST_COLUMNS``, slowest first (``top`` of them)."""
    return [[str(s["rank"]), str(s["epoch"]), str(s["chunk"]), f"{s['interval_ms']:.1f}", f"{s['excess_ms']:+.1f}",
             s["grew"] or "—", s["first_late"] or "—"] for s in long_tail["slowest"][:top]]
