"""Time slices of a long run: the delivery-interval P50 per slice of sessions, and drift.

A run is cut into consecutive slices of N sessions (``sessions:N``, arrival order) or of T seconds
of arrival time (``seconds:T``). Each slice gets the P50 of its sessions' delivery intervals with a
95 % session-bootstrap interval, as the run does (``stats.bootstrap_percentile``). A slice is
flagged **drifted** when its P50 has moved beyond the run's interval *and* its own interval does
not reach back into it: the run's interval is narrower than any slice's (fewer sessions), so
comparing a slice's point with it alone would flag a stationary run's slices by chance.
"""

from __future__ import annotations

from typing import Literal, Sequence

import msgspec

from harness.measure.stats import Estimate, bootstrap_percentile


class SliceSpec(msgspec.Struct, frozen=True):
    kind: Literal["sessions", "seconds"]
    size: float

    def describe(self) -> str:
        return f"{self.size:g} {'sessions' if self.kind == 'sessions' else 's of arrivals'} per slice"


def parse_slice(text: str) -> SliceSpec:
    kind, sep, arg = text.partition(":")
    try:
        size = float(arg)
    except ValueError:
        size = -1.0
    if not sep or kind not in ("sessions", "seconds") or not size > 0 or (kind == "sessions" and size != int(size)):
        raise ValueError(f"--slice {text!r}: expected sessions:N (N ≥ 1) or seconds:T (T > 0)")
    return SliceSpec(kind, size)  # type: ignore[arg-type]


class Slice(msgspec.Struct, frozen=True):
    index: int
    first_session: int  # arrival indices, inclusive
    last_session: int
    start_s: float  # arrival offsets of its first and last session
    end_s: float
    sessions: int  # sessions that gave at least one interval
    samples: int
    p50_ms: float | None
    low_ms: float | None
    high_ms: float | None
    drifted: bool


class SlicesSummary(msgspec.Struct, frozen=True):
    spec: SliceSpec
    figure: str
    run_p50_ms: float | None
    run_low_ms: float | None
    run_high_ms: float | None
    slices: list[Slice]
    drifted: list[int]  # indices of the drifted slices


def group(offsets_s: Sequence[float], spec: SliceSpec) -> list[list[int]]:
    """Session indices per slice, in order (an empty time slice is left out)."""
    out: dict[int, list[int]] = {}
    for i, t in enumerate(offsets_s):
        key = i // int(spec.size) if spec.kind == "sessions" else int(t // spec.size)
        out.setdefault(key, []).append(i)
    return [out[k] for k in sorted(out)]


def _estimate(per_session: list[list[float]]) -> Estimate | None:
    kept = [s for s in per_session if len(s)]
    return bootstrap_percentile(kept, 50) if kept else None


def drifted(s: Estimate, run: Estimate) -> bool:
    """The slice's P50 moved beyond the run's interval and its own interval does not reach it."""
    return (s.value > run.high and s.low > run.high) or (s.value < run.low and s.high < run.low)


def slices(offsets_s: Sequence[float], intervals_ms: Sequence[Sequence[float]], spec: SliceSpec,
           figure: str = "delivery interval P50 ms") -> SlicesSummary:
    """``intervals_ms[i]``: session i's delivery intervals (empty for a session that gave none)."""
    run = _estimate([list(v) for v in intervals_ms])
    out = []
    for k, idx in enumerate(group(offsets_s, spec)):
        est = _estimate([list(intervals_ms[i]) for i in idx])
        out.append(Slice(
            index=k, first_session=idx[0], last_session=idx[-1], start_s=offsets_s[idx[0]], end_s=offsets_s[idx[-1]],
            sessions=sum(1 for i in idx if len(intervals_ms[i])), samples=sum(len(intervals_ms[i]) for i in idx),
            p50_ms=est.value if est else None, low_ms=est.low if est else None, high_ms=est.high if est else None,
            drifted=bool(est and run and drifted(est, run))))
    return SlicesSummary(spec=spec, figure=figure, run_p50_ms=run.value if run else None,
                         run_low_ms=run.low if run else None, run_high_ms=run.high if run else None,
                         slices=out, drifted=[s.index for s in out if s.drifted])
