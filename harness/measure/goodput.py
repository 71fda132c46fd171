"""Per-session load records, the SLO, goodput with its interval and LoadGen-style early stopping.

**SLO** (``--slo ttfc=2.0,play=0.95``): a session meets it when it was served to its end, its TTFC
(start sent → first chunk read, the admission queue included) is ≤ ``ttfc`` seconds and its
continuous-play ratio at the stream's fps is ≥ ``play``. A refused, queue-timed-out or failed
session never meets it.

**Goodput** = sessions meeting the SLO per minute of the run's span (first arrival → last session
ended). Its interval: the meeting share k/n of the n arrivals is binomial, so a Clopper–Pearson
interval on k/n times the arrival rate n/span (fixed by the open-loop process, not measured); the
span itself is taken as exact.

**Early stopping** after MLPerf LoadGen's rule: LoadGen passes a percentile bound once, with t of
its h + t queries over the latency target, the chance of ≤ t overlatency queries if the true
overlatency rate were 1 − p is ≤ 1 − c (binomial CDF; c = 0.99). Here the "percentile" is the share
of sessions meeting the SLO (target p, ``--early-stop P``): *met* once P(Binom(n, 1 − p) ≤ t) ≤ 1 − c
for the t sessions that missed it, *missed* once P(Binom(n, 1 − p) ≥ t) ≤ 1 − c (LoadGen checks only
the first side; a load generator that keeps offering sessions a server cannot serve learns nothing
more). Either way the bound is decided and more sessions cannot change it at that confidence.
"""

from __future__ import annotations

from typing import Literal, Sequence

import msgspec
from scipy.stats import beta as _beta
from scipy.stats import binom as _binom

from harness.measure.stats import nearest_rank

Outcome = Literal["served", "refused", "queue_timeout", "failed"]
OUTCOMES: tuple[str, ...] = ("served", "refused", "queue_timeout", "failed")
EARLY_STOP_CONFIDENCE = 0.99  # LoadGen's
GOODPUT_CONFIDENCE = 0.95


class Slo(msgspec.Struct, frozen=True):
    ttfc_s: float
    play: float

    def describe(self) -> str:
        return f"TTFC ≤ {self.ttfc_s:g} s (queue included) and continuous play ≥ {self.play:g}"


def parse_slo(text: str) -> Slo:
    vals: dict[str, float] = {}
    for part in text.split(","):
        k, eq, v = part.partition("=")
        if not eq or k.strip() not in ("ttfc", "play"):
            raise ValueError(f"--slo {text!r}: expected ttfc=SECONDS,play=RATIO")
        try:
            vals[k.strip()] = float(v)
        except ValueError:
            raise ValueError(f"--slo {text!r}: {k.strip()}={v!r} is not a number") from None
    if set(vals) != {"ttfc", "play"}:
        raise ValueError(f"--slo {text!r}: give both ttfc=SECONDS and play=RATIO")
    if not vals["ttfc"] > 0 or not 0 <= vals["play"] <= 1:
        raise ValueError(f"--slo {text!r}: ttfc must be > 0 s and play in [0, 1]")
    return Slo(vals["ttfc"], vals["play"])


class LoadRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One arriving session (a line of ``load.jsonl``); times in ns on this host's monotonic clock."""

    index: int  # arrival order, from 0
    seed: int
    planned_s: float  # the arrival process's offset
    arrived_ns: int  # when it was due to start (run start + planned)
    start_sent_ns: int | None = None  # later than arrived_ns only under --max-concurrency
    started_ns: int | None = None  # the server admitted it (``started`` / ``video.start`` read)
    first_chunk_ns: int | None = None
    end_ns: int = 0
    outcome: str = "failed"  # one of OUTCOMES
    error: str = ""
    session: int | None = None  # the server's session number
    replica: int | None = None  # the engine group that served it, where the server says (``started.replica``)
    chunks: int = 0
    chunks_delivered: int = 0
    frames: int = 0
    client_wait_ms: float | None = None  # arrival → start sent (a --max-concurrency slot)
    queue_wait_ms: float | None = None  # start sent → started
    ttfc_ms: float | None = None  # start sent → first chunk read
    interval_p50_ms: float | None = None  # the session's own delivery intervals, nearest rank
    intervals_ms: list[float] = []
    underruns: int = 0
    stall_ms: float = 0.0
    continuous_ratio: float | None = None
    meets_slo: bool = False


def meets(r: LoadRecord, slo: Slo) -> bool:
    return (r.outcome == "served" and r.ttfc_ms is not None and r.ttfc_ms <= slo.ttfc_s * 1e3
            and r.continuous_ratio is not None and r.continuous_ratio >= slo.play)


def session_interval_p50(intervals_ms: Sequence[float]) -> float | None:
    return nearest_rank(intervals_ms, 50) if len(intervals_ms) else None


class Rate(msgspec.Struct, frozen=True):
    per_min: float | None
    low: float | None
    high: float | None
    confidence: float
    method: str


def clopper_pearson(k: int, n: int, confidence: float = GOODPUT_CONFIDENCE) -> tuple[float, float]:
    a = (1 - confidence) / 2
    low = 0.0 if k == 0 else float(_beta.ppf(a, k, n - k + 1))
    high = 1.0 if k == n else float(_beta.ppf(1 - a, k + 1, n - k))
    return low, high


def goodput(k: int, n: int, span_s: float, confidence: float = GOODPUT_CONFIDENCE) -> Rate:
    """k sessions meeting the SLO of n arrivals over span_s seconds, per minute, with its interval."""
    method = "Clopper-Pearson on the meeting share x arrivals per minute (span taken as exact)"
    if n == 0 or not span_s > 0:
        return Rate(None, None, None, confidence, method)
    rate = n * 60.0 / span_s
    low, high = clopper_pearson(k, n, confidence)
    return Rate(k / n * rate, low * rate, high * rate, confidence, method)


def per_replica(per_min: float | None, replicas: int) -> float | None:
    """A goodput (sessions/min) shared out over the replicas that served it."""
    return None if per_min is None else per_min / replicas


def per_gpu(per_min: float | None, replicas: int, gpus_per_replica: int, device: str | None) -> float | None:
    """Per GPU, only where the replicas held GPUs (``device`` "cuda"): a CPU replica holds none,
    and a server reached with --connect (device unknown) may hold any number."""
    return None if per_min is None or device != "cuda" else per_min / (replicas * gpus_per_replica)


class EarlyStop(msgspec.Struct, frozen=True):
    decided: Literal["met", "missed"] | None
    target: float  # the share of sessions that must meet the SLO
    confidence: float
    n: int
    missed: int  # sessions that did not meet the SLO
    why: str


def early_stop(n: int, missed: int, target: float, confidence: float = EARLY_STOP_CONFIDENCE) -> EarlyStop:
    """Is "at least ``target`` of sessions meet the SLO" decided after ``n`` sessions, ``missed`` of
    them not meeting it? (module docstring: LoadGen's binomial bound, both sides)"""
    if not 0 < target < 1:
        raise ValueError(f"early-stop target must be in (0, 1), got {target}")
    q, alpha = 1 - target, 1 - confidence
    if n == 0:
        return EarlyStop(None, target, confidence, 0, 0, "no session decided yet")
    p_le = float(_binom.cdf(missed, n, q))  # as few misses as this if the true miss rate were 1 − target
    p_ge = float(_binom.sf(missed - 1, n, q))  # as many misses as this
    if p_le <= alpha:
        return EarlyStop("met", target, confidence, n, missed,
                         f"{missed} of {n} sessions missed the SLO: P(≤ {missed} misses | miss rate {q:g}) = {p_le:.3g} ≤ {alpha:g}")
    if p_ge <= alpha:
        return EarlyStop("missed", target, confidence, n, missed,
                         f"{missed} of {n} sessions missed the SLO: P(≥ {missed} misses | miss rate {q:g}) = {p_ge:.3g} ≤ {alpha:g}")
    return EarlyStop(None, target, confidence, n, missed, f"{missed} of {n} missed: not decided at {confidence:g}")


class LoadSummary(msgspec.Struct, kw_only=True):
    """``summary.json``'s ``load``: the run's offered and served load, refusals, goodput."""

    arrivals: str
    slo: Slo
    slo_text: str
    sessions: int  # arrivals that started (every one ends with an outcome)
    outcomes: dict[str, int]
    span_s: float
    offered_per_min: float | None  # arrivals ÷ span
    nominal_per_min: float | None  # the process's own rate (poisson, burst)
    served_per_min: float | None
    refused_share: float | None
    meeting_slo: int
    goodput: Rate
    queue_wait_p50_ms: float | None
    queue_wait_max_ms: float | None
    ttfc_p50_ms: float | None
    ttfc_p99_ms: float | None
    continuous_p50: float | None
    underruns: int
    early_stop: EarlyStop | None = None
    stopped_early: bool = False
    stop_reason: str = ""


def _p(values: list[float], p: float) -> float | None:
    return nearest_rank(values, p) if values else None


def load_summary(records: Sequence[LoadRecord], slo: Slo, slo_text: str, arrivals: str, nominal_per_min: float | None,
                 stop: EarlyStop | None = None, stop_reason: str = "") -> LoadSummary:
    n = len(records)
    span = ((max(r.end_ns for r in records) - min(r.arrived_ns for r in records)) / 1e9) if records else 0.0
    served = [r for r in records if r.outcome == "served"]
    k = sum(r.meets_slo for r in records)
    per_min = (lambda c: c * 60.0 / span if span > 0 else None)
    queue = [r.queue_wait_ms for r in records if r.queue_wait_ms is not None]
    ttfc = [r.ttfc_ms for r in served if r.ttfc_ms is not None]
    cont = [r.continuous_ratio for r in served if r.continuous_ratio is not None]
    return LoadSummary(
        arrivals=arrivals, slo=slo, slo_text=slo_text, sessions=n,
        outcomes={o: sum(r.outcome == o for r in records) for o in OUTCOMES}, span_s=span,
        offered_per_min=per_min(n), nominal_per_min=nominal_per_min, served_per_min=per_min(len(served)),
        refused_share=sum(r.outcome == "refused" for r in records) / n if n else None, meeting_slo=k,
        goodput=goodput(k, n, span), queue_wait_p50_ms=_p(queue, 50), queue_wait_max_ms=max(queue) if queue else None,
        ttfc_p50_ms=_p(ttfc, 50), ttfc_p99_ms=_p(ttfc, 99), continuous_p50=_p(cont, 50),
        underruns=sum(r.underruns for r in served), early_stop=stop, stopped_early=bool(stop_reason), stop_reason=stop_reason)
