"""Derived figures over the event table (DESIGN §4): pure functions, integer nanoseconds in and out.

Selection rules shared by every figure here:

- Sessions are keyed by ``(session, epoch)``. Epochs below ``Window.warmup_epochs`` (at least
  epoch 0) are warm-up and never counted.
- A session is *cancelled* when its ``SessionStart`` or any of its chunks says so. Cancelled
  sessions are counted (``sessions_cancelled``) but contribute no sample: a session cut short has
  a different tail and would bias the steady figures.
- A sample needing a boundary that was not recorded is skipped and counted
  (``skipped_missing``); nothing is interpolated.
- Stage names and the intervals they denote are ``measure.stages``.
- Delivery interval at boundary B for chunk i: B(i) − B(i−1) within a session. The steady window
  (default chunks 5–8) selects intervals by the index of their *later* chunk, so the default gives
  4 intervals per session (5−4 … 8−7), and chunk-level figures (stage durations, GPU time) by the
  chunk's own index.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import msgspec
import numpy as np

from harness.measure.events import BOUNDARIES, ChunkEvent, SessionStart
from harness.measure.stages import HANDOFF, INTERVALS, STAGE_NAMES, STAGES
from harness.measure.stats import nearest_rank_index

SessionKey = tuple[int, int]  # (session, epoch)


class Window(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which chunks are steady and which epochs are measured (chunk indices from 0, inclusive)."""

    first_chunk: int = 5
    last_chunk: int = 8
    warmup_epochs: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.first_chunk <= self.last_chunk:
            # first_chunk ≥ 1: an interval needs a previous chunk.
            raise ValueError(f"steady window needs 1 ≤ first_chunk ≤ last_chunk, got {self.first_chunk}..{self.last_chunk}")
        if self.warmup_epochs < 1:
            raise ValueError("epoch 0 is warm-up and is never counted: warmup_epochs must be ≥ 1")

    @property
    def chunks(self) -> range:
        return range(self.first_chunk, self.last_chunk + 1)

    def measured(self, epoch: int) -> bool:
        return epoch >= self.warmup_epochs

    def describe(self) -> str:
        return (
            f"steady chunks {self.first_chunk}-{self.last_chunk} (interval i = B(i) - B(i-1)) "
            f"of every measured, non-cancelled session; epochs < {self.warmup_epochs} are warm-up"
        )


DEFAULT_WINDOW = Window()


def window_for(chunks_per_session: int, base: Window = DEFAULT_WINDOW) -> Window:
    """``base`` clipped to sessions of ``chunks_per_session`` chunks.

    A short session (e.g. 7 chunks in CI) keeps the tail of the default window that exists
    (chunks 5–6) instead of counting the absent chunks 7–8 as missing samples; a session too short
    to reach the window's start uses its own last intervals. Sessions of one chunk have no interval
    at all, so ``base`` is returned and every slot is reported missing.
    """
    last = chunks_per_session - 1
    if last < 1 or last >= base.last_chunk:
        return base
    return Window(first_chunk=min(base.first_chunk, last), last_chunk=last, warmup_epochs=base.warmup_epochs)


def served_chunks(events, starts, warmup_epochs: int = DEFAULT_WINDOW.warmup_epochs) -> int | None:
    """The fewest chunks any measured (epoch ≥ ``warmup_epochs``), non-cancelled session reached: a
    ``serve --listen`` client chooses its own session length, so the steady window is clipped to
    the sessions actually served, not to the preset's length (None: no such session)."""
    cancelled = {s.key for s in starts if s.cancelled}
    reached: dict[tuple[int, int], int] = {}
    for e in events:
        key = (e.session, e.epoch)
        if e.epoch >= warmup_epochs and key not in cancelled:
            reached[key] = max(reached.get(key, 0), e.chunk + 1)
    return min(reached.values(), default=None)


class Sample(msgspec.Struct, frozen=True):
    session: int
    epoch: int
    chunk: int
    ns: int
    #: Pixel frames the sample delivered (delivery intervals only; 0 elsewhere).
    frames: int = 0

    @property
    def key(self) -> SessionKey:
        return (self.session, self.epoch)


class Selection(msgspec.Struct, frozen=True):
    """The samples of one figure, with an account of every slot that gave none."""

    name: str
    samples: tuple[Sample, ...]
    #: Slots the rule asked for (e.g. measured non-cancelled sessions × window chunks).
    expected: int
    skipped_missing: int = 0
    #: Durations that came out ≤ 0 (< 0 for stage durations): an ordering fault, not a sample.
    skipped_nonpositive: int = 0
    sessions_cancelled: int = 0

    @property
    def n(self) -> int:
        return len(self.samples)

    def ns(self) -> np.ndarray:
        return np.array([s.ns for s in self.samples], dtype=np.int64)

    def per_session(self) -> list[list[int]]:
        """Sample values grouped by session, sessions in (epoch, session) order: bootstrap input."""
        groups: dict[SessionKey, list[int]] = {}
        for s in self.samples:
            groups.setdefault(s.key, []).append(s.ns)
        return [groups[k] for k in sorted(groups, key=lambda k: (k[1], k[0]))]


# ---- grouping ------------------------------------------------------------------------------


def session_table(events: Iterable[ChunkEvent]) -> dict[SessionKey, dict[int, ChunkEvent]]:
    """chunk index → event, per session. A chunk recorded twice is ambiguous and raises."""
    table: dict[SessionKey, dict[int, ChunkEvent]] = {}
    for e in events:
        chunks = table.setdefault((e.session, e.epoch), {})
        if e.chunk in chunks:
            raise ValueError(f"session {e.session} epoch {e.epoch} chunk {e.chunk} recorded more than once")
        chunks[e.chunk] = e
    return table


def session_starts(sessions: Iterable[SessionStart]) -> dict[SessionKey, SessionStart]:
    return {s.key: s for s in sessions}


def cancelled_keys(events: Iterable[ChunkEvent], sessions: Iterable[SessionStart] = ()) -> set[SessionKey]:
    keys = {s.key for s in sessions if s.cancelled}
    keys.update((e.session, e.epoch) for e in events if e.cancelled)
    return keys


def _measured(
    table: dict[SessionKey, dict[int, ChunkEvent]],
    sessions: Sequence[SessionStart],
    window: Window,
) -> tuple[list[SessionKey], int]:
    """Measured sessions that count, in run order, and how many cancelled ones were left out."""
    events = [e for chunks in table.values() for e in chunks.values()]
    cancelled = cancelled_keys(events, sessions)
    keys = set(table) | {s.key for s in sessions}
    measured = [k for k in keys if window.measured(k[1])]
    kept = sorted((k for k in measured if k not in cancelled), key=lambda k: (k[1], k[0]))
    return kept, len(measured) - len(kept)


def steady_chunks(
    events: Sequence[ChunkEvent], sessions: Sequence[SessionStart] = (), window: Window = DEFAULT_WINDOW
) -> tuple[list[ChunkEvent], int, int]:
    """Chunk events in the window of measured, non-cancelled sessions.

    Returns (events, expected slots, sessions left out as cancelled).
    """
    table = session_table(events)
    keys, n_cancelled = _measured(table, sessions, window)
    out = [table[k][c] for k in keys for c in window.chunks if c in table.get(k, {})]
    return out, len(keys) * len(window.chunks), n_cancelled


def measured_chunks(
    events: Sequence[ChunkEvent],
    sessions: Sequence[SessionStart] = (),
    window: Window = DEFAULT_WINDOW,
    *,
    include_cancelled: bool = True,
) -> list[ChunkEvent]:
    """Every chunk of every measured session (cancelled ones too by default: their blocking was real)."""
    cancelled = set() if include_cancelled else cancelled_keys(events, sessions)
    return [e for e in events if window.measured(e.epoch) and (e.session, e.epoch) not in cancelled]


# ---- delivery intervals, FPS ---------------------------------------------------------------


def interval_fps(frames: int, ns: int) -> float:
    """Frames of a chunk over the interval that delivered them, in frames per second."""
    if ns <= 0:
        raise ValueError(f"interval must be positive, got {ns} ns")
    return frames * 1e9 / ns


def session_intervals(chunks: dict[int, ChunkEvent], boundary: str, chunk_ids: Iterable[int]) -> tuple[list[Sample], int, int]:
    """Intervals B(i) − B(i−1) of one session for the given i: (samples, missing, non-positive)."""
    out, missing, nonpos = [], 0, 0
    for i in chunk_ids:
        cur, prev = chunks.get(i), chunks.get(i - 1)
        t1 = cur.at(boundary) if cur is not None else None
        t0 = prev.at(boundary) if prev is not None else None
        if t1 is None or t0 is None:
            missing += 1
        elif t1 - t0 <= 0:
            nonpos += 1
        else:
            out.append(Sample(cur.session, cur.epoch, i, int(t1 - t0), cur.frames))
    return out, missing, nonpos


def delivery_intervals(events: Sequence[ChunkEvent], boundary: str) -> list[Sample]:
    """Every interval at ``boundary`` of every session (warm-up and cancelled included), unfiltered."""
    _check_boundary(boundary)
    out: list[Sample] = []
    for key in sorted(table := session_table(events), key=lambda k: (k[1], k[0])):
        chunks = table[key]
        out.extend(session_intervals(chunks, boundary, sorted(c for c in chunks if c >= 1))[0])
    return out


def steady_intervals(
    events: Sequence[ChunkEvent],
    boundary: str,
    window: Window = DEFAULT_WINDOW,
    sessions: Sequence[SessionStart] = (),
) -> Selection:
    _check_boundary(boundary)
    table = session_table(events)
    keys, n_cancelled = _measured(table, sessions, window)
    samples: list[Sample] = []
    missing = nonpos = 0
    for k in keys:
        s, m, z = session_intervals(table.get(k, {}), boundary, window.chunks)
        samples.extend(s)
        missing += m
        nonpos += z
    return Selection(boundary, tuple(samples), len(keys) * len(window.chunks), missing, nonpos, n_cancelled)


def steady_fps(samples: Sequence[Sample]) -> float | None:
    """Total frames over total interval time: the rate a viewer actually sees across the window."""
    total_ns = sum(s.ns for s in samples)
    return float(sum(s.frames for s in samples) * 1e9 / total_ns) if total_ns > 0 else None


def fps_values(samples: Sequence[Sample]) -> np.ndarray:
    return np.array([interval_fps(s.frames, s.ns) for s in samples], dtype=np.float64)


def median_interval(samples: Sequence[Sample]) -> Sample | None:
    """The sample that is the nearest-rank median interval (ties: the earliest in run order).

    The headline's interval P50 and FPS P50 are both read off this one sample: ranking the
    per-interval FPS instead picks the other middle sample whenever n is even (the rank from the
    top is not the rank from the bottom), so the pair would not agree.
    """
    if not samples:
        return None
    ranked = sorted(samples, key=lambda s: s.ns)  # stable: equal intervals keep run order
    return ranked[nearest_rank_index(len(ranked), 50)]


def median_interval_fps(samples: Sequence[Sample]) -> float | None:
    """Frames ÷ interval of the median interval's sample (``median_interval``)."""
    s = median_interval(samples)
    return None if s is None else interval_fps(s.frames, s.ns)


# ---- per-session figures -------------------------------------------------------------------


class Rollout(msgspec.Struct, frozen=True):
    """A whole session: session start → boundary of its last chunk."""

    ns: int
    frames: int
    chunks: int

    @property
    def fps(self) -> float:
        return interval_fps(self.frames, self.ns)


class PerSession(msgspec.Struct, frozen=True):
    name: str
    values: dict[SessionKey, object]
    expected: int
    skipped_missing: int = 0
    sessions_cancelled: int = 0

    def ns(self) -> np.ndarray:
        return np.array([v if isinstance(v, int) else v.ns for v in self.values.values()], dtype=np.int64)


def _per_session(
    name: str,
    events: Sequence[ChunkEvent],
    sessions: Sequence[SessionStart],
    boundary: str,
    window: Window,
    value: Callable[[dict[int, ChunkEvent], int], object | None],
) -> PerSession:
    """``value(chunks, start_ns)`` of every measured non-cancelled session that has a start (None:
    the session gives no value, and is counted as missing)."""
    _check_boundary(boundary)
    table = session_table(events)
    starts = session_starts(sessions)
    keys, n_cancelled = _measured(table, sessions, window)
    values: dict[SessionKey, object] = {}
    for k in keys:
        if k in starts and (v := value(table.get(k, {}), starts[k].start_ns)) is not None:
            values[k] = v
    return PerSession(f"{name}:{boundary}", values, len(keys), len(keys) - len(values), n_cancelled)


def ttfc(
    events: Sequence[ChunkEvent],
    sessions: Sequence[SessionStart],
    boundary: str,
    window: Window = DEFAULT_WINDOW,
) -> PerSession:
    """B(chunk 0) − session start, per measured non-cancelled session."""

    def first_chunk(chunks: dict[int, ChunkEvent], start: int) -> int | None:
        t = chunks[0].at(boundary) if 0 in chunks else None
        return None if t is None else int(t - start)

    return _per_session("ttfc", events, sessions, boundary, window, first_chunk)


#: what a first chunk waits for before its request reaches the DiT: session start → submit
SETUP = "setup"


def ttfc_parts(
    events: Sequence[ChunkEvent],
    sessions: Sequence[SessionStart],
    window: Window = DEFAULT_WINDOW,
) -> dict[str, PerSession]:
    """The way of chunk 0 from its session's start, per measured non-cancelled session: ``setup``
    (session start → submit), then every stage of ``stages.STAGES`` chunk 0 recorded. Where every
    boundary was recorded they tile TTFC at ``delivered``: what bounds a first chunk, measured."""

    def setup(chunks: dict[int, ChunkEvent], start: int) -> int | None:
        t = chunks[0].at("submit") if 0 in chunks else None
        return None if t is None else int(t - start)

    def stage(name: str) -> Callable[[dict[int, ChunkEvent], int], int | None]:
        return lambda chunks, start: stage_durations(chunks[0]).get(name) if 0 in chunks else None

    parts = {SETUP: _per_session(SETUP, events, sessions, "submit", window, setup)}
    for name, _, end in STAGES:
        parts[name] = _per_session(name, events, sessions, end, window, stage(name))
    return parts


def rollouts(
    events: Sequence[ChunkEvent],
    sessions: Sequence[SessionStart],
    boundary: str,
    window: Window = DEFAULT_WINDOW,
) -> PerSession:
    """Session start → B(last recorded chunk), with the frames of all chunks; a session with a
    hole (a chunk index or its boundary absent) has no rollout."""

    def whole_session(chunks: dict[int, ChunkEvent], start: int) -> Rollout | None:
        if not chunks:
            return None
        last = max(chunks)
        if any(c not in chunks or chunks[c].at(boundary) is None for c in range(last + 1)):
            return None
        ns = chunks[last].at(boundary) - start
        return Rollout(int(ns), sum(e.frames for e in chunks.values()), last + 1) if ns > 0 else None

    return _per_session("rollout", events, sessions, boundary, window, whole_session)


# ---- handoff, stages, GPU time, blocking ---------------------------------------------------


def handoffs(
    events: Sequence[ChunkEvent],
    window: Window = DEFAULT_WINDOW,
    sessions: Sequence[SessionStart] = (),
) -> Selection:
    """``stages.HANDOFF``, cpu_ready(i−1) → dit_start(i), for steady i. Negative under Case E (DiT i started before
    frames of i−1 were ready) — kept, because that overlap is the point of Case E."""
    table = session_table(events)
    keys, n_cancelled = _measured(table, sessions, window)
    samples, missing = [], 0
    for k in keys:
        chunks = table.get(k, {})
        for i in window.chunks:
            cur, prev = chunks.get(i), chunks.get(i - 1)
            t1 = cur.at(HANDOFF.end) if cur is not None else None
            t0 = prev.at(HANDOFF.start) if prev is not None else None
            if t1 is None or t0 is None:
                missing += 1
            else:
                samples.append(Sample(k[0], k[1], i, int(t1 - t0)))
    return Selection(HANDOFF.name, tuple(samples), len(keys) * len(window.chunks), missing, 0, n_cancelled)


#: Spans of a chunk during which some GPU works for it: the DiT, and decode → uint8 → D2H.
BUSY_SPANS: tuple[tuple[str, str], ...] = (("dit_start", "dit_end"), ("decode_start", "cpu_ready"))


def uncovered_ns(lo: int, hi: int, spans: Iterable[tuple[int, int]]) -> int:
    """Length of (lo, hi] not covered by any of ``spans`` (overlapping spans count once)."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi)
    covered, end = 0, lo
    for a, b in clipped:
        if b > end:
            covered += b - max(a, end)
            end = b
    return (hi - lo) - covered


def all_gpu_idle(
    events: Sequence[ChunkEvent],
    window: Window = DEFAULT_WINDOW,
    sessions: Sequence[SessionStart] = (),
) -> Selection:
    """Per steady interval (cpu_ready(i−1), cpu_ready(i)], the time in which no chunk of the
    session had GPU work in flight (``BUSY_SPANS``, host-observed boundaries: a span opens when
    the host starts the work and closes after it synchronised). With SP and VAE ranks sharing the
    GPUs (DESIGN §12's "all 4 GPUs idle at once") this is when every GPU waits on the host."""
    table = session_table(events)
    keys, n_cancelled = _measured(table, sessions, window)
    samples, missing = [], 0
    for k in keys:
        chunks = table.get(k, {})
        spans = [(getattr(e, a), getattr(e, b)) for e in chunks.values() for a, b in BUSY_SPANS
                 if getattr(e, a) is not None and getattr(e, b) is not None]
        for i in window.chunks:
            cur, prev = chunks.get(i), chunks.get(i - 1)
            if cur is None or prev is None or cur.cpu_ready is None or prev.cpu_ready is None:
                missing += 1
                continue
            samples.append(Sample(k[0], k[1], i, uncovered_ns(prev.cpu_ready, cur.cpu_ready, spans)))
    return Selection("all_gpu_idle", tuple(samples), len(keys) * len(window.chunks), missing, 0, n_cancelled)


def stage_durations(event: ChunkEvent) -> dict[str, int]:
    """Duration of every segment whose two boundaries this chunk recorded."""
    out = {}
    for name, a, b in STAGES:
        ta, tb = event.at(a), event.at(b)
        if ta is not None and tb is not None:
            out[name] = tb - ta
    return out


def steady_stages(
    events: Sequence[ChunkEvent],
    window: Window = DEFAULT_WINDOW,
    sessions: Sequence[SessionStart] = (),
) -> dict[str, Selection]:
    """Per segment, its duration on every steady chunk that recorded both ends."""
    chunks, expected, n_cancelled = steady_chunks(events, sessions, window)
    samples: dict[str, list[Sample]] = {name: [] for name in STAGE_NAMES}
    negative = dict.fromkeys(STAGE_NAMES, 0)
    for e in chunks:
        for name, d in stage_durations(e).items():
            if d < 0:
                negative[name] += 1
            else:
                samples[name].append(Sample(e.session, e.epoch, e.chunk, int(d)))
    return {
        name: Selection(name, tuple(s), expected, expected - len(s) - negative[name], negative[name], n_cancelled)
        for name, s in samples.items()
    }


#: Stages whose first runs compile (torch.compile, autotuning) in a compiled mode: the warm-up figure's stages.
COMPILED_STAGES: tuple[str, ...] = ("dit", "decode")


def warmup_session(events: Sequence[ChunkEvent], window: Window = DEFAULT_WINDOW) -> dict[int, ChunkEvent]:
    """chunk → event of the run's first warm-up session (the lowest epoch below the window's
    measured epochs, its lowest session): where a compiled mode compiles."""
    table = session_table(events)
    warm = sorted((k for k in table if not window.measured(k[1])), key=lambda k: (k[1], k[0]))
    return table[warm[0]] if warm else {}


def warmup_durations(events: Sequence[ChunkEvent], stage: str, window: Window = DEFAULT_WINDOW) -> dict[int, int]:
    """chunk → the stage's duration on it, over the first warm-up session, in chunk order (a chunk
    that did not record both ends is left out)."""
    a, b = INTERVALS[stage]
    chunks = warmup_session(events, window)
    return {c: chunks[c].at(b) - chunks[c].at(a) for c in sorted(chunks)
            if chunks[c].at(a) is not None and chunks[c].at(b) is not None}


def excess_over(durations: Sequence[int], typical: float) -> int:
    """Σ of what each duration spent above ``typical`` (the steady median): the warm-up's extra time."""
    return int(sum(max(0.0, d - typical) for d in durations))


def stage_shares(mean_ns: dict[str, float]) -> dict[str, float]:
    """Each stage's mean over the sum of the stages' means (stages with no sample left out)."""
    total = sum(v for v in mean_ns.values() if v is not None)
    return {k: v / total for k, v in mean_ns.items() if v is not None} if total > 0 else {}


def gpu_times(chunks: Iterable[ChunkEvent]) -> dict[str, list[float]]:
    """GPU milliseconds per key (CUDA-event durations) over the given chunks, where recorded."""
    out: dict[str, list[float]] = {}
    for e in chunks:
        for k, v in e.gpu_ms.items():
            out.setdefault(k, []).append(float(v))
    return dict(sorted(out.items()))


class Blocked(msgspec.Struct, frozen=True):
    total_ns: int
    max_ns: int
    #: Chunks that recorded this stage at all (0 ns included) / chunks where it was > 0.
    chunks: int
    chunks_blocked: int


def blocked_time(chunks: Iterable[ChunkEvent]) -> dict[str, Blocked]:
    """Producer time blocked on a full queue/ring, per stage (the backpressure signal)."""
    acc: dict[str, list[int]] = {}
    for e in chunks:
        for k, v in e.blocked_ns.items():
            acc.setdefault(k, []).append(int(v))
    return {
        k: Blocked(sum(v), max(v), len(v), sum(1 for x in v if x > 0)) for k, v in sorted(acc.items())
    }


def boundaries_seen(events: Iterable[ChunkEvent]) -> list[str]:
    """Boundaries recorded by at least one chunk, in data-flow order."""
    seen = set()
    for e in events:
        seen.update(e.present())
    return [b for b in BOUNDARIES if b in seen]


def _check_boundary(boundary: str) -> None:
    if boundary not in BOUNDARIES:
        raise KeyError(f"unknown boundary {boundary!r} (known: {', '.join(BOUNDARIES)})")
