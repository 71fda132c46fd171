"""Percentiles, session-block bootstrap intervals and the A/B verdict (DESIGN §4; the reasoning
and the alternatives: docs/statistics.md).

Rules, stated once:

- **Percentiles use the nearest-rank rule**: P_p of n samples is the ⌈p·n/100⌉-th smallest, so a
  reported value is always one that occurred. A percentile is *flagged* when n is too small for it
  to differ from the maximum (n < 100/(100−p); for P99 that is n < 100): it is then the maximum.
- **Bootstrap over sessions** (tail percentiles of one run): intervals of one session share its
  state (cache placement, clocks, neighbours' load), so they are correlated; resampling them one by
  one would understate the spread. A replicate draws whole sessions with replacement (or circular
  blocks of L consecutive sessions, for drift across a run) and recomputes the statistic; the
  interval is the percentile interval of the replicates, by the same nearest-rank rule, fixed seed.
- **A/B verdict, launch level**: a launch (one process: placement, clocks, allocator state,
  compiled kernels) shifts every session in it, so sessions of one launch are not independent
  evidence about a candidate. Each launch contributes one unit, the log of the nearest-rank median
  of its pooled steady intervals; ratio = exp(mean log unit of B − of A); its interval is Student's
  t on those units (Welch for independent launches; the one-sample t of per-launch differences when
  A and B share each launch). No verdict with fewer than 2 launches per arm. Faster / slower only
  when the whole interval is below / above 1; equivalent when it lies within 1 ± margin; no
  verdict (not final: more launches narrow it) when its ends lie beyond ×/÷WIDEST_FACTOR of the
  ratio, which is then reported without them. Student's t and the normal are SciPy's.
- **Sequential looks**: ``compare --until-resolved`` looks after every round; each look's interval is
  taken at the nominal level an O'Brien–Fleming-type alpha-spending plan gives it, so the chance of
  any false faster/slower over all looks is about α (the plan's boundaries are a normal
  statistic's, applied to t intervals: 5.3 % measured at α = 5 %, docs/statistics.md).
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Callable, Literal, Sequence

import msgspec
import numpy as np
from scipy.stats import norm as _normal
from scipy.stats import t as _student_t

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


def _rowwise_nearest_rank(rows: np.ndarray, p: float, empty_ok: bool = False) -> np.ndarray:
    """Nearest-rank P_p along the last axis, ignoring NaN padding (rows of different sample
    counts); a row of no samples is an error, or NaN with ``empty_ok``."""
    counts = np.count_nonzero(~np.isnan(rows), axis=-1)
    if not empty_ok and np.any(counts == 0):
        raise ValueError("percentile of no samples")
    s = np.sort(rows, axis=-1)  # NaN sorts last
    q = _check_p(p)
    # ceil(q·n/100) for integer n, in integers: exact for every p written with finitely many digits.
    num, den = q.numerator * counts, q.denominator * 100
    idx = np.maximum(-(-num // den), 1) - 1
    out = np.take_along_axis(s, idx[..., None], axis=-1)[..., 0]
    return np.where(counts > 0, out, np.nan)


def p_stat(p: float) -> RowStatistic:
    """Nearest-rank P_p as a bootstrap statistic."""
    _check_p(p)
    return lambda rows: _rowwise_nearest_rank(rows, p)


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


# ---- distributions ---------------------------------------------------------------------------

def t_two_sided_p(t, df) -> np.ndarray:
    """P(|T| ≥ |t|) for Student's t with ``df`` degrees of freedom (df may be fractional: Welch)."""
    return 2 * _student_t.sf(np.abs(np.asarray(t, dtype=np.float64)), np.asarray(df, dtype=np.float64))


def t_quantile(p_two_sided, df) -> np.ndarray:
    """q with P(|T| ≥ q) = p (SciPy's inverse survival function: accurate down to the 1e-11 of
    an early sequential look)."""
    return _student_t.isf(np.asarray(p_two_sided, dtype=np.float64) / 2, np.asarray(df, dtype=np.float64))


@functools.lru_cache(maxsize=128)
def spending_levels(looks: tuple[int, ...], alpha: float = 0.05) -> tuple[float, ...]:
    """Nominal two-sided level of each look of a group-sequential design, so that the chance of
    crossing at *any* look under no difference is ``alpha``.

    ``looks`` are the launch counts per arm at each look, information growing in proportion. The
    alpha is spent by the Lan–DeMets O'Brien–Fleming-type function α(t) = 2 − 2Φ(z_{α/2}/√t):
    next to nothing at the first looks, nearly the whole α at the last. The crossing boundaries
    come from the exact joint law of the looks (a Brownian motion observed at the look times),
    integrated numerically on a grid; one look gives back ``alpha``.
    """
    if not looks or any(b <= a for a, b in zip(looks, looks[1:])) or looks[0] < 1:
        raise ValueError(f"looks must be increasing positive launch counts, got {looks}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if len(looks) == 1:
        return (alpha,)
    z_half = float(_normal.isf(alpha / 2))
    spent = [2 * float(_normal.sf(z_half / math.sqrt(n / looks[-1]))) for n in looks]
    grid = np.linspace(-10, 10, 1001)
    h = grid[1] - grid[0]
    dens, cont, levels, before = _normal.pdf(grid), None, [], 0.0
    for k, n in enumerate(looks):
        if cont is not None:  # density of Z_k over the paths that crossed no earlier boundary
            s0, s1, sd = math.sqrt(looks[k - 1]), math.sqrt(n), math.sqrt(n - looks[k - 1])
            dens = (_normal.pdf((grid[:, None] * s1 - grid[None, :] * s0) / sd) * (s1 / sd)) @ cont * h
        upper = np.cumsum((dens * h)[::-1])[::-1] - dens * h / 2  # trapezoid: mass above each grid point
        target = max(spent[k] - before, 0.0) / 2
        # boundary c: the right tail beyond c holds half the alpha spent at this look
        i = int(np.searchsorted(-upper, -target))  # first point whose upper mass ≤ target
        c = float(grid[min(i, grid.size - 1)])
        if 0 < i < grid.size:  # linear interpolation between grid points
            m0, m1 = upper[i - 1], upper[i]
            c = float(grid[i - 1] + h * (m0 - target) / (m0 - m1)) if m0 > m1 else c
        levels.append(2 * float(_normal.sf(c)))  # the survival function: no 1 − cdf cancellation far out
        before = spent[k]
        cont = dens * np.clip((c - np.abs(grid)) / h + 0.5, 0, 1)
    return tuple(levels)


# ---- A/B: ratio of launch medians, its interval, the verdict ---------------------------------

#: Launches each arm needs before any verdict: launch-to-launch variance cannot be estimated from one.
MIN_LAUNCHES = 2
DEFAULT_ALPHA = 0.05
#: "equivalent" means the whole interval lies within 1 ± this
DEFAULT_MARGIN = 0.02
POWER = 0.8

#: Rounds ``compare --until-resolved`` may take by default: at 5 % launch-to-launch noise (log
#: sigma) a true 5 % shift is then found with ≥ 80 % power (tests/measure/test_verdict_calibration.py).
DEFAULT_MAX_ROUNDS = 24

Level = Literal["launch", "session"]


def sequential_looks(max_rounds: int) -> tuple[int, ...]:
    """A look after every round from the MIN_LAUNCHES-th to ``max_rounds``."""
    if max_rounds < MIN_LAUNCHES:
        raise ValueError(f"a sequential comparison needs ≥ {MIN_LAUNCHES} rounds, got {max_rounds}")
    return tuple(range(MIN_LAUNCHES, max_rounds + 1))
VerdictName = Literal["faster", "slower", "equivalent", "no resolvable difference", "no verdict"]


def units(x: np.ndarray, level: Level = "launch") -> np.ndarray:
    """Log nearest-rank medians of the units of an arm: ``x`` is (..., launches, sessions, samples),
    NaN-padded. ``launch``: one value per launch (its sessions pooled), so what varies between
    launches (placement, clocks, allocator state) is in the spread; ``session``: one per session,
    as if sessions were independent — blind to launch variance, kept to show what that misses."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim < 3:
        raise ValueError(f"units need (..., launches, sessions, samples), got shape {x.shape}")
    if level == "launch":
        rows = x.reshape(*x.shape[:-2], -1)
    elif level == "session":
        rows = x.reshape(*x.shape[:-3], -1, x.shape[-1])
    else:
        raise ValueError(f"unknown level {level!r}")
    with np.errstate(divide="ignore"):
        return np.log(_rowwise_nearest_rank(rows, 50, empty_ok=True))


def pad_launches(launches: Sequence[Sequence[Sequence[float]]]) -> np.ndarray:
    """Ragged launches → (launches, sessions, samples) with NaN padding."""
    n_s = max((len(l) for l in launches), default=0)
    n_x = max((len(s) for l in launches for s in l), default=0)
    out = np.full((len(launches), max(n_s, 1), max(n_x, 1)), np.nan)
    for i, l in enumerate(launches):
        for j, s in enumerate(l):
            out[i, j, : len(s)] = s
    return out


class Interval(msgspec.Struct, frozen=True):
    """Ratio B/A = exp(mean log unit median of B − of A) and its interval at a nominal level."""

    value: float
    #: None when the interval is too wide to state (``UNBOUNDED``): its ends would be no figure at all
    low: float | None
    high: float | None
    #: 1 − the nominal two-sided level of this look (0.95 for a single look at α = 0.05)
    confidence: float
    se_log: float
    df: float
    n_a: int
    n_b: int
    #: "launch" or "session" (see ``units``); "paired": A and B share each launch (ab-engine)
    level: str
    paired: bool = False
    #: spread (sample sd, log scale) of the units of A and of B; paired: sd_b is that of the
    #: per-launch differences and sd_a is 0 (what ``min_detectable`` needs)
    sd_a: float = 0.0
    sd_b: float = 0.0
    #: geometric means of the unit medians of A and of B (the units the ratio reads): center_b /
    #: center_a is ``value``, so a table printing them beside the ratio agrees with it
    center_a: float | None = None
    center_b: float | None = None


#: An interval whose ends lie more than this factor from its ratio bounds no speed worth stating
#: (at the first look of a 24-round plan the t quantile is ~3·10⁵): its ends are not reported
#: and it is "no verdict" until more launches narrow it.
WIDEST_FACTOR = 10.0
UNBOUNDED = 4


def log_ratio(ua: np.ndarray, ub: np.ndarray, paired: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(point, se, df) of mean(ub) − mean(ua) over the last axis: Welch's t for independent
    launches, the one-sample t of the differences when unit i of A and of B share a launch."""
    na, nb = ua.shape[-1], ub.shape[-1]
    if min(na, nb) < 2:
        raise ValueError(f"an interval needs ≥ 2 units per arm, got {na} and {nb}")
    if paired:
        if na != nb:
            raise ValueError(f"paired units need equal counts, got {na} and {nb}")
        d = ub - ua
        return d.mean(-1), d.std(-1, ddof=1) / math.sqrt(na), np.full(d.shape[:-1], na - 1.0)
    va, vb = ua.var(-1, ddof=1) / na, ub.var(-1, ddof=1) / nb
    with np.errstate(divide="ignore", invalid="ignore"):
        df = (va + vb) ** 2 / (va * va / (na - 1) + vb * vb / (nb - 1))
    df = np.where(np.isfinite(df), df, na + nb - 2.0)  # both spreads zero: any df, the interval is a point
    return ub.mean(-1) - ua.mean(-1), np.sqrt(va + vb), df


def classify(low: np.ndarray, high: np.ndarray, margin: float) -> np.ndarray:
    """What a log interval shows, elementwise: 1 faster (wholly below 1), 2 slower (wholly above
    1), 3 equivalent (wholly within 1 ± margin, bounds included, and not wholly on one side of 1),
    4 too wide to state (``UNBOUNDED``: an end beyond ``WIDEST_FACTOR`` of the ratio), 0 not
    resolved. Only the whole interval decides; its point never does."""
    code = np.where(high < 0, 1, np.where(low > 0, 2, 0))
    inside = (low >= math.log1p(-margin)) & (high <= math.log1p(margin))
    code = np.where((code == 0) & inside, 3, code)
    with np.errstate(invalid="ignore"):
        wide = (high - low) / 2 > math.log(WIDEST_FACTOR)
    return np.where(wide, UNBOUNDED, code)


def decide(point: np.ndarray, se: np.ndarray, df: np.ndarray, level: float, margin: float
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(code, low, high): the log interval at two-sided ``level`` (Student's t) and ``classify``'s code."""
    q = t_quantile(level, df)
    low, high = point - q * se, point + q * se
    return classify(low, high, margin), low, high


_NAMES = {1: "faster", 2: "slower", 3: "equivalent", 0: "no resolvable difference", UNBOUNDED: "no verdict"}


#: Draws of the power simulation (``min_detectable``), fixed seed: the same data give the same MDE.
MDE_DRAWS = 4000


def min_detectable(sd_a: float, sd_b: float, n_a: int, n_b: int, level: float, *, paired: bool = False,
                   power: float = POWER) -> float | None:
    """Relative shift (0.05 = 5 %) this very test finds with probability ``power`` (None when it is
    beyond ``WIDEST_FACTOR``, e.g. at a first look's level of 10⁻¹¹): units of spread
    ``sd_a``, ``sd_b`` (log scale; paired: ``sd_b`` is the spread of the per-launch differences and
    ``sd_a`` is unused), ``n_a`` and ``n_b`` of them, the t interval at two-sided ``level``.

    By simulation rather than the textbook (t_level + z_power)·se: with 2–5 launches per arm the
    interval's own width varies so much (its se and Welch df are estimated) that the textbook shift
    is found only 43–76 % of the time. A shift δ is found when δ > q·se − (noise of the point), so
    the MDE is the ``power`` quantile of that threshold over seeded draws."""
    rng = np.random.default_rng(DEFAULT_SEED)
    zb = rng.normal(0.0, sd_b, (MDE_DRAWS, n_b))
    za = np.zeros((MDE_DRAWS, n_a)) if paired else rng.normal(0.0, sd_a, (MDE_DRAWS, n_a))
    point, se, df = log_ratio(za, zb, paired)
    threshold = nearest_rank(t_quantile(level, df) * se - point, 100 * power)
    # a shift beyond WIDEST_FACTOR is no figure (the first look of a long plan): None, not an overflow
    return math.expm1(threshold) if threshold <= math.log(WIDEST_FACTOR) else None


#: The launch spread (log sd of the launch units) assumed before any is measured: the noise the
#: default budget is sized for (docs/statistics.md "Budget").
PRIOR_LAUNCH_SD = 0.05
#: The shift the budget is sized to find with POWER
TARGET_SHIFT = 0.05


@functools.lru_cache(maxsize=64)
def rounds_needed(sd_a: float, sd_b: float, shift: float = TARGET_SHIFT, *, sequential: bool = True,
                  alpha: float = DEFAULT_ALPHA, budget: int = DEFAULT_MAX_ROUNDS, most: int = 64) -> int | None:
    """Fewest rounds N (launches per arm) whose last look finds a true ``shift`` with POWER at
    launch spreads ``sd_a``, ``sd_b`` — at the level an N-round sequential plan gives its last
    look, or at ``alpha`` for a fixed comparison; None beyond ``most``. The detectable shift falls
    with N, so bisection finds N. A sequential plan's last look is stricter than ``alpha``, so the
    fixed answer (no plan to integrate) bounds the sequential one from below; each sequential N
    tried costs N − 1 numerical integrations, which the bound and ``budget`` (a plan computed
    anyway) keep to a few."""
    def mde_at(n: int, seq: bool) -> float | None:
        return min_detectable(sd_a, sd_b, n, n, spending_levels(sequential_looks(n), alpha)[-1] if seq else alpha)

    def reaches(n: int, seq: bool) -> bool:
        mde = mde_at(n, seq)
        return mde is not None and mde <= shift

    if not reaches(most, False):
        return None
    fixed = _first(lambda n: reaches(n, False), MIN_LAUNCHES - 1, most)
    if not sequential:
        return fixed
    # the budget's plan when it may be enough, else a quarter more than the fixed answer (the last
    # look of a long plan is at about 0.03 for 0.05: some 15-20 % more rounds), growing from there
    lo, hi = fixed - 1, budget if fixed <= budget <= 2 * fixed else min(-(-5 * fixed // 4), most)
    while not reaches(hi, True):
        if hi >= most:
            return None
        lo, hi = hi, min(-(-5 * hi // 4), most)
    return _first(lambda n: reaches(n, True), lo, hi)


def _first(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """Smallest n in (lo, hi] with ``ok(n)``, for a monotone ``ok`` that holds at hi (bisection)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def one_launch_reason(n_a: int, n_b: int) -> str | None:
    """The launch rule, for every command: None when both arms have ≥ MIN_LAUNCHES launches."""
    if min(n_a, n_b) >= MIN_LAUNCHES:
        return None
    return (f"one launch: {n_a} baseline and {n_b} candidate launch(es); launch-to-launch variance "
            f"needs ≥ {MIN_LAUNCHES} per arm")


class Verdict(msgspec.Struct, frozen=True):
    verdict: VerdictName
    reason: str
    #: the launch-level interval the verdict read (None without ≥ 2 launches per arm)
    ab: Interval | None
    #: baseline against itself (even vs odd launches), the same interval: a diagnostic, not a floor
    aa: Interval | None
    gate_passed: bool | None
    #: shift detectable with 80 % power at this look's spread and level (None: beyond WIDEST_FACTOR)
    mde: float | None = None
    #: the session-level interval, for a single launch: describes it, decides nothing
    within_launch: Interval | None = None
    #: False for a "no verdict" that more launches can change (one launch, an interval too wide
    #: to state): a sequential comparison keeps looking
    final: bool = True


def decimals(width: float, most: int = 4) -> int:
    """Decimals that show a figure to the resolution its interval supports: two significant
    digits of the interval's width (0.1 wide → 0.01, 0.001 wide → 0.0001), at least 0, at most ``most``."""
    if not width > 0 or not math.isfinite(width):
        return most
    return min(max(1 - math.floor(math.log10(width)), 0), most)


def too_wide_text(iv: Interval) -> str:
    return (f"interval wider than ×/÷{WIDEST_FACTOR:g} (t = {float(t_quantile(1 - iv.confidence, iv.df)):.2g} "
            f"at {iv.df:.2g} df, level {1 - iv.confidence:.2g})")


def level_text(confidence: float) -> str:
    """``95 % interval``; at an early look's tiny level, the level itself (99.9999999989 % reads as 100)."""
    return f"{100 * confidence:.6g} % interval" if confidence <= 0.9999 else f"interval at level {1 - confidence:.2g}"


def ratio_text(iv: Interval) -> str:
    """``0.975 [0.941, 1.010]``, rounded to what the interval supports; an interval too wide to state says so."""
    if iv.low is None or iv.high is None:
        return "no verdict: " + too_wide_text(iv)
    d = decimals(iv.high - iv.low)
    return f"{iv.value:.{d}f} [{iv.low:.{d}f}, {iv.high:.{d}f}]"


def _exp(x: float) -> float:
    return math.exp(min(x, 709.0))  # the point of a ratio: finite for any data a run can give


def _ab_interval(ua: np.ndarray, ub: np.ndarray, level: float, paired: bool, kind: str, margin: float) -> tuple[Interval, int]:
    point, se, df = log_ratio(ua, ub, paired)
    code, low, high = decide(point, se, df, level, margin)
    sd_a, sd_b = (0.0, float(np.std(ub - ua, ddof=1))) if paired else (float(np.std(ua, ddof=1)), float(np.std(ub, ddof=1)))
    stated = int(code) != UNBOUNDED
    iv = Interval(_exp(float(point)), _exp(float(low)) if stated else None, _exp(float(high)) if stated else None,
                  1 - level, float(se), float(df), ua.shape[-1], ub.shape[-1], kind, paired, sd_a, sd_b,
                  _exp(float(ua.mean())), _exp(float(ub.mean())))
    return iv, int(code)


def _reason(ab: Interval, aa: Interval | None, code: int, margin: float) -> str:
    over = f"({level_text(ab.confidence)} over {ab.n_a}+{ab.n_b} launches)"
    if code == UNBOUNDED:
        return f"{too_wide_text(ab)} {over}; more launches narrow it"
    why = {1: "below 1", 2: "above 1", 3: f"within 1 ± {margin:g}", 0: f"crosses 1 and reaches beyond 1 ± {margin:g}"}[code]
    drift = aa is not None and aa.low is not None and not aa.low <= 1 <= aa.high
    note = "; A/A interval excludes 1: the baseline's launches drift" if drift else ""
    return f"ratio {ratio_text(ab)} {over} {why}{note}"


def judge_ab(
    baseline: Sequence[Sequence[Sequence[float]]],
    candidate: Sequence[Sequence[Sequence[float]]],
    *,
    gate_passed: bool | None,
    level: float = DEFAULT_ALPHA,
    margin: float = DEFAULT_MARGIN,
    paired: bool = False,
) -> Verdict:
    """The verdict of every command: ``baseline`` and ``candidate`` are launches → sessions →
    samples. Needs the gate passed and ≥ MIN_LAUNCHES launches per arm; then the launch-level
    interval at the look's nominal two-sided ``level`` (``spending_levels``; α for a single look)
    decides. The A/A diagnostic (baseline's even vs odd launches) needs ≥ 4 baseline launches."""
    xa, xb = pad_launches(baseline), pad_launches(candidate)
    ua, ub = units(xa), units(xb)
    keep_a, keep_b = np.isfinite(ua), np.isfinite(ub)
    if paired:  # a launch that lost either arm's samples leaves the pair whole
        keep_a = keep_b = keep_a & keep_b
    ua, ub = ua[keep_a], ub[keep_b]
    if gate_passed is not True:
        why = "numeric gate failed" if gate_passed is False else "numeric gate not run"
        return Verdict("no verdict", why, None, None, gate_passed)
    short = one_launch_reason(ua.size, ub.size)
    if short:
        within = None
        sa, sb = units(xa, "session"), units(xb, "session")
        sa, sb = sa[np.isfinite(sa)], sb[np.isfinite(sb)]
        if min(sa.size, sb.size) >= 2:
            within = _ab_interval(sa, sb, DEFAULT_ALPHA, False, "session", margin)[0]
        return Verdict("no verdict", short, None, None, gate_passed, within_launch=within, final=False)
    ab, code = _ab_interval(ua, ub, level, paired, "launch", margin)
    aa = None
    if ua.size >= 2 * MIN_LAUNCHES:
        aa = _ab_interval(ua[0::2], ua[1::2], DEFAULT_ALPHA, False, "launch", margin)[0]
    mde = min_detectable(ab.sd_a, ab.sd_b, ab.n_a, ab.n_b, level, paired=paired)
    return Verdict(_NAMES[code], _reason(ab, aa, code, margin), ab, aa, gate_passed, mde, final=code != UNBOUNDED)
