"""Percentiles, session-block bootstrap intervals and the A/B verdict (DESIGN §4).

Rules, stated once:

- **Percentiles use the nearest-rank rule**: P_p of n samples is the ⌈p·n/100⌉-th smallest, so a
  reported value is always one that occurred. A percentile is *flagged* when n is too small for it
  to differ from the maximum (n < 100/(100−p); for P99 that is n < 100): it is then the maximum.
- **Bootstrap over sessions**: intervals of one session share its state (cache placement, clocks,
  neighbours' load), so they are correlated; resampling them one by one would understate the
  spread. A replicate draws whole sessions with replacement (or, optionally, circular blocks of L
  consecutive sessions, for drift across a run) and recomputes the statistic; the interval is the
  percentile interval of the replicates, taken by the same nearest-rank rule, with a fixed seed.
- **A/B statistic**: ratio = P50(candidate steady intervals) / P50(baseline steady intervals),
  both nearest-rank medians over the pooled intervals of each arm; its interval resamples the
  sessions of each arm independently. < 1 means the candidate delivers faster.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable, Literal, Sequence

import msgspec
import numpy as np

#: A statistic over bootstrap replicates: rows are replicates, NaN pads the unused tail of a row.
RowStatistic = Callable[[np.ndarray], np.ndarray]

DEFAULT_BOOT = 2000
DEFAULT_SEED = 0
DEFAULT_CONFIDENCE = 0.95


# ---- percentiles ---------------------------------------------------------------------------


def _check_p(p: float | Fraction) -> Fraction:
    # Exact arithmetic: 0.95 * 20 must give rank 19, not ceil(19.000000000000004) = 20.
    q = p if isinstance(p, Fraction) else Fraction(repr(float(p)))
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    return q


def nearest_rank_index(n: int, p: float | Fraction) -> int:
    """0-based index into the sorted samples of P_p by the nearest-rank rule (P0 is the minimum)."""
    if n <= 0:
        raise ValueError("percentile of no samples")
    return max(math.ceil(_check_p(p) * n / 100), 1) - 1


def min_samples(p: float) -> int:
    """Fewest samples for which P_p is not forced to be the maximum."""
    q = _check_p(p)
    if q == 100:
        return 1
    # rank ⌈p·n/100⌉ equals n exactly when n·(1 − p/100) < 1
    return math.ceil(100 / (100 - q))


def nearest_rank(values: Sequence[float] | np.ndarray, p: float) -> float:
    v = np.sort(np.asarray(values, dtype=np.float64).ravel())
    return float(v[nearest_rank_index(v.size, p)])


class Percentile(msgspec.Struct, frozen=True):
    p: float
    value: float
    n: int
    #: n < min_samples(p): the value is the maximum, not a resolved tail percentile.
    flagged: bool


def percentile(values: Sequence[float] | np.ndarray, p: float) -> Percentile:
    v = np.asarray(values, dtype=np.float64).ravel()
    return Percentile(p=float(p), value=nearest_rank(v, p), n=int(v.size), flagged=v.size < min_samples(p))


def _rowwise_nearest_rank(rows: np.ndarray, p: float) -> np.ndarray:
    """Nearest-rank P_p of every row, ignoring NaN padding (rows of different sample counts)."""
    counts = np.count_nonzero(~np.isnan(rows), axis=1)
    if np.any(counts == 0):
        raise ValueError("percentile of no samples")
    s = np.sort(rows, axis=1)  # NaN sorts last
    q = _check_p(p)
    # ceil(q·n/100) for integer n, in integers: exact for every p written with finitely many digits.
    num, den = q.numerator * counts, q.denominator * 100
    idx = np.maximum(-(-num // den), 1) - 1
    return np.take_along_axis(s, idx[:, None], axis=1)[:, 0]


def p_stat(p: float) -> RowStatistic:
    """Nearest-rank P_p as a bootstrap statistic."""
    _check_p(p)
    return lambda rows: _rowwise_nearest_rank(rows, p)


def mean_stat(rows: np.ndarray) -> np.ndarray:
    return np.nanmean(rows, axis=1)


def rowwise(fn: Callable[[np.ndarray], float]) -> RowStatistic:
    """Adapt any statistic over a 1-D array of samples (slower: one call per replicate)."""
    return lambda rows: np.array([fn(r[~np.isnan(r)]) for r in rows], dtype=np.float64)


# ---- session bootstrap ---------------------------------------------------------------------


class Estimate(msgspec.Struct, frozen=True):
    """A statistic and its bootstrap percentile interval."""

    value: float
    low: float
    high: float
    confidence: float
    n_boot: int
    seed: int
    n_sessions: int
    n_samples: int
    #: "session" or "circular-block:L"
    method: str

    def contains(self, x: float) -> bool:
        return self.low <= x <= self.high


def _pad_sessions(sessions: Sequence[Sequence[float] | np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    arrays = [np.asarray(s, dtype=np.float64).ravel() for s in sessions]
    arrays = [a for a in arrays if a.size]  # a session with no steady samples carries no weight
    if not arrays:
        raise ValueError("bootstrap over no samples")
    if any(np.isnan(a).any() for a in arrays):
        raise ValueError("NaN sample in bootstrap input")
    width = max(a.size for a in arrays)
    table = np.full((len(arrays), width), np.nan)
    for i, a in enumerate(arrays):
        table[i, : a.size] = a
    return table, np.array([a.size for a in arrays])


def session_indices(n_sessions: int, n_boot: int, rng: np.random.Generator, block_length: int | None = None) -> np.ndarray:
    """(n_boot, n_sessions) indices of resampled sessions: iid, or circular blocks of consecutive ones."""
    if block_length is None or block_length <= 1:
        return rng.integers(0, n_sessions, size=(n_boot, n_sessions))
    n_blocks = -(-n_sessions // block_length)
    starts = rng.integers(0, n_sessions, size=(n_boot, n_blocks, 1))
    idx = (starts + np.arange(block_length)) % n_sessions
    return idx.reshape(n_boot, n_blocks * block_length)[:, :n_sessions]


def _replicates(table: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return table[idx].reshape(idx.shape[0], -1)


def _interval(reps: np.ndarray, confidence: float) -> tuple[float, float]:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    # (1 − 0.95) / 2 · 100 is 2.500000000000002 in floats, which would take rank 51 of 2000, not 50
    tail = (1 - Fraction(repr(float(confidence)))) / 2 * 100
    s = np.sort(reps)
    return float(s[nearest_rank_index(s.size, tail)]), float(s[nearest_rank_index(s.size, 100 - tail)])


def bootstrap_method(block_length: int | None) -> str:
    return "session" if block_length is None or block_length <= 1 else f"circular-block:{block_length}"


def bootstrap_sessions(
    sessions: Sequence[Sequence[float] | np.ndarray],
    statistic: RowStatistic,
    *,
    n_boot: int = DEFAULT_BOOT,
    seed: int = DEFAULT_SEED,
    confidence: float = DEFAULT_CONFIDENCE,
    block_length: int | None = None,
) -> Estimate:
    """``statistic`` over all samples, with an interval from resampling whole sessions.

    ``sessions`` is one sequence of samples per session, in run order (order matters only for
    circular blocks).
    """
    table, counts = _pad_sessions(sessions)
    point = float(statistic(table.reshape(1, -1))[0])
    rng = np.random.default_rng(seed)
    reps = statistic(_replicates(table, session_indices(len(table), n_boot, rng, block_length)))
    low, high = _interval(reps, confidence)
    return Estimate(point, low, high, confidence, n_boot, seed, len(table), int(counts.sum()), bootstrap_method(block_length))


def bootstrap_percentile(sessions: Sequence[Sequence[float] | np.ndarray], p: float, **kw) -> Estimate:
    return bootstrap_sessions(sessions, p_stat(p), **kw)


# ---- A/B -----------------------------------------------------------------------------------


def ratio_of_medians(
    baseline: Sequence[Sequence[float] | np.ndarray],
    candidate: Sequence[Sequence[float] | np.ndarray],
    *,
    n_boot: int = DEFAULT_BOOT,
    seed: int = DEFAULT_SEED,
    confidence: float = DEFAULT_CONFIDENCE,
    block_length: int | None = None,
) -> Estimate:
    """P50(candidate) / P50(baseline) over per-session steady intervals, arms resampled independently."""
    tb, cb = _pad_sessions(baseline)
    tc, cc = _pad_sessions(candidate)
    med = p_stat(50)
    point = float(med(tc.reshape(1, -1))[0] / med(tb.reshape(1, -1))[0])
    rng = np.random.default_rng(seed)
    rb = med(_replicates(tb, session_indices(len(tb), n_boot, rng, block_length)))
    rc = med(_replicates(tc, session_indices(len(tc), n_boot, rng, block_length)))
    low, high = _interval(rc / rb, confidence)
    return Estimate(
        point, low, high, confidence, n_boot, seed,
        len(tb) + len(tc), int(cb.sum() + cc.sum()), bootstrap_method(block_length),
    )


def split_alternating(sessions: Sequence[Sequence[float]]) -> tuple[list, list]:
    """Baseline sessions of rounds 0, 2, 4 … and 1, 3, 5 …: an A/A pair from one interleaved run."""
    return list(sessions[0::2]), list(sessions[1::2])


VerdictName = Literal["faster", "slower", "no resolvable difference", "no verdict"]


class Verdict(msgspec.Struct, frozen=True):
    verdict: VerdictName
    reason: str
    ab: Estimate | None
    aa: Estimate | None
    #: Largest distance of the A/A interval from 1: a null comparison reaches this far by noise alone.
    noise_floor: float | None
    gate_passed: bool | None


def noise_floor(aa: Estimate) -> float:
    return max(1.0 - aa.low, aa.high - 1.0, 0.0)


def ab_verdict(ab: Estimate | None, aa: Estimate | None, gate_passed: bool | None) -> Verdict:
    """Faster / slower only when the whole A/B interval clears 1 by more than the A/A noise floor.

    No verdict at all unless the candidate's numeric gate passed: a wrong answer delivered sooner
    is not a speed-up. Without an A/A estimate the floor is taken as 0 and the reason says so.
    """
    floor = noise_floor(aa) if aa is not None else None
    if gate_passed is not True:
        why = "numeric gate failed" if gate_passed is False else "numeric gate not run"
        return Verdict("no verdict", why, ab, aa, floor, gate_passed)
    if ab is None:
        return Verdict("no verdict", "no A/B estimate", ab, aa, floor, gate_passed)
    f = floor or 0.0
    notes = []
    if aa is None:
        notes.append("no A/A noise floor")
    elif not aa.contains(1.0):
        notes.append("A/A interval excludes 1: the two halves of the baseline differ (drift between launches or sessions)")
    note = f" ({'; '.join(notes)})" if notes else ""
    band = f"[{1 - f:.4f}, {1 + f:.4f}]"
    ci = f"ratio {ab.value:.4f} [{ab.low:.4f}, {ab.high:.4f}]"
    if ab.high < 1 - f:
        return Verdict("faster", f"{ci} below noise band {band}{note}", ab, aa, floor, gate_passed)
    if ab.low > 1 + f:
        return Verdict("slower", f"{ci} above noise band {band}{note}", ab, aa, floor, gate_passed)
    return Verdict("no resolvable difference", f"{ci} overlaps noise band {band}{note}", ab, aa, floor, gate_passed)


#: Sessions each half of a baseline needs for an A/A interval: one session resamples to a single
#: point, and a floor of zero width would let any A/B interval "clear" it.
MIN_SESSIONS_PER_HALF = 2


def compare_ab(
    baseline: Sequence[Sequence[float]],
    candidate: Sequence[Sequence[float]],
    *,
    gate_passed: bool | None,
    aa: Estimate | None = None,
    n_boot: int = DEFAULT_BOOT,
    seed: int = DEFAULT_SEED,
    confidence: float = DEFAULT_CONFIDENCE,
    block_length: int | None = None,
) -> Verdict:
    """A/B ratio + verdict. Without ``aa``, the noise floor comes from splitting the baseline's
    sessions alternately (needs ≥ 2 baseline sessions with samples)."""
    kw = dict(n_boot=n_boot, seed=seed, confidence=confidence, block_length=block_length)
    ab = ratio_of_medians(baseline, candidate, **kw)
    if aa is None:
        a1, a2 = split_alternating([s for s in baseline if len(s)])
        if min(len(a1), len(a2)) < MIN_SESSIONS_PER_HALF:
            return Verdict("no verdict", f"no A/A noise floor: each half of the baseline needs ≥ {MIN_SESSIONS_PER_HALF} "
                           f"sessions with samples, got {len(a1)} and {len(a2)}", ab, None, None, gate_passed)
        aa = ratio_of_medians(a1, a2, **kw)
    return ab_verdict(ab, aa, gate_passed)
