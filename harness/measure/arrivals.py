"""Open-loop arrival processes for ``load``: when each session starts, as offsets from the run's start.

Open loop means the offsets are fixed before the run by the process and its seed alone: a session
that arrives does not wait for earlier ones (what the server does with it — serve, queue, refuse —
is the measurement). Three processes, as ``--arrivals`` spells them:

- ``poisson:RATE``: exponential gaps of mean 60 / RATE s — RATE is **sessions per minute** (a
  world-model session lasts seconds to minutes, so per-second rates would read as small fractions);
- ``burst:N@PERIOD``: N sessions at once at t = 0, PERIOD, 2·PERIOD, … (PERIOD in seconds);
- ``trace:FILE``: the start offsets (seconds) a file lists, JSON lines (a number or an object with
  ``t``) or CSV (first column, an optional header), sorted.

Bounded by a duration (no arrival at or after it) and/or a session count; a trace is bounded by itself.
"""

from __future__ import annotations

import json
import math
from typing import Literal

import msgspec
import numpy as np

MAX_ARRIVALS = 100_000


class ArrivalSpec(msgspec.Struct, frozen=True, kw_only=True):
    kind: Literal["poisson", "burst", "trace"]
    text: str  # as given on the command line
    rate_per_min: float | None = None
    burst: int | None = None
    period_s: float | None = None
    trace: tuple[float, ...] = ()


def _positive(text: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{what} must be a number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{what} must be positive and finite, got {text!r}")
    return v


def parse_arrivals(text: str, trace_text: str | None = None, trace_suffix: str = "") -> ArrivalSpec:
    """``poisson:RATE`` | ``burst:N@PERIOD`` | ``trace:FILE`` (its contents in ``trace_text``)."""
    kind, sep, arg = text.partition(":")
    if not sep or not arg:
        raise ValueError(f"--arrivals {text!r}: expected poisson:RATE, burst:N@PERIOD or trace:FILE")
    if kind == "poisson":
        return ArrivalSpec(kind="poisson", text=text, rate_per_min=_positive(arg, "poisson RATE (sessions per minute)"))
    if kind == "burst":
        n, at, period = arg.partition("@")
        if not at or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--arrivals {text!r}: expected burst:N@PERIOD with N ≥ 1 sessions every PERIOD seconds")
        return ArrivalSpec(kind="burst", text=text, burst=int(n), period_s=_positive(period, "burst PERIOD (seconds)"))
    if kind == "trace":
        if trace_text is None:
            raise ValueError(f"--arrivals {text!r}: the trace file was not read")
        return ArrivalSpec(kind="trace", text=text, trace=parse_trace_offsets(trace_text, trace_suffix))
    raise ValueError(f"--arrivals {text!r}: unknown process {kind!r} (poisson, burst, trace)")


def parse_trace_offsets(text: str, suffix: str) -> tuple[float, ...]:
    """Start offsets in seconds, sorted; CSV by the first column (a header line is skipped)."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if suffix == ".csv":
            cell = line.split(",")[0].strip()
            try:
                v = float(cell)
            except ValueError:
                if out or i > 1:
                    raise ValueError(f"trace line {i}: {cell!r} is not a start offset in seconds") from None
                continue  # the header
        else:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"trace line {i}: not JSON ({e.msg})") from None
            v = obj.get("t") if isinstance(obj, dict) else obj
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"trace line {i}: expected a number or an object with a numeric 't'")
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"trace line {i}: a start offset must be ≥ 0 and finite, got {v}")
        out.append(float(v))
    if not out:
        raise ValueError("the trace lists no start offset")
    if len(out) > MAX_ARRIVALS:
        raise ValueError(f"the trace lists {len(out)} starts, more than {MAX_ARRIVALS}")
    return tuple(sorted(out))


def offsets(spec: ArrivalSpec, seed: int, duration_s: float | None, sessions: int | None) -> list[float]:
    """Every arrival's offset (s) from the run's start, in order: fixed by (spec, seed) alone."""
    if spec.kind != "trace" and duration_s is None and sessions is None:
        raise ValueError(f"--arrivals {spec.text}: bound it with --duration and/or --sessions")
    cap = min(sessions or MAX_ARRIVALS, MAX_ARRIVALS)
    horizon = math.inf if duration_s is None else duration_s
    if spec.kind == "trace":
        times = [t for t in spec.trace if t < horizon]
    elif spec.kind == "burst":
        n_periods = cap if duration_s is None else math.ceil(duration_s / spec.period_s)
        times = [k * spec.period_s for k in range(n_periods) for _ in range(spec.burst) if k * spec.period_s < horizon]
    else:
        rng = np.random.default_rng(seed)
        times, t = [], 0.0
        while len(times) < cap:
            t += float(rng.exponential(60.0 / spec.rate_per_min))
            if t >= horizon:
                break
            times.append(t)
    return times[:cap]


def offered_per_min(spec: ArrivalSpec) -> float | None:
    """The process's nominal rate (sessions per minute); a trace has none of its own."""
    if spec.kind == "poisson":
        return spec.rate_per_min
    if spec.kind == "burst":
        return spec.burst * 60.0 / spec.period_s
    return None
