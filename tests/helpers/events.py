"""Hand-built event tables with known answers: every chunk's boundaries laid one after another by
``chunk_stamps``, on two schedules.

* The grid (``make_session``, ``make_run``): chunk i's k-th boundary (k = index in BOUNDARIES) is
  recorded at ``start + first + sum(periods[1..i]) + k * step``, so at every boundary the interval of
  chunk i is ``periods[i]``, every segment lasts ``step``, TTFC at boundary k is ``first + k * step``,
  and the handoff cpu_ready(i-1) -> dit_start(i) is ``periods[i] - 7 * step``.
* Case D (``case_d_session``, ``case_d_table``): every segment lasts its ``NOMINAL`` duration and a
  chunk is submitted ``GAP`` ms after the previous chunk's cpu_ready; ``slow`` adds to either.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.measure.events import BOUNDARIES, ChunkEvent, SessionStart

MS = 1_000_000

#: Case D: every segment's nominal duration (ms), in the order of the boundaries that end them
#: (dit_queue ends at dit_start, …, sink at delivered).
NOMINAL = {"dit_queue": 1, "dit": 40, "latent_ipc": 1, "decode_wait": 1, "decode_queue": 1, "decode": 30,
           "convert": 2, "d2h": 2, "ipc": 1, "encode": 5, "sink": 1}
GAP = 1


def frames_of(chunk: int) -> int:
    return 9 if chunk == 0 else 12


def chunk_stamps(submit: int, gaps: Sequence[int]) -> dict[str, int]:
    """One chunk's boundary times: ``submit``, then each later boundary ``gaps[k]`` ns after the one before."""
    stamps, t = {BOUNDARIES[0]: submit}, submit
    for boundary, gap in zip(BOUNDARIES[1:], gaps, strict=True):
        t += gap
        stamps[boundary] = t
    return stamps


def make_session(
    session: int,
    epoch: int,
    *,
    start: int = 0,
    periods=None,
    period: int = 100 * MS,
    n_chunks: int = 10,
    first: int = 50 * MS,
    step: int = 1 * MS,
    drop: dict[int, tuple[str, ...]] | None = None,
    skip_chunks: tuple[int, ...] = (),
    cancelled_chunks: tuple[int, ...] = (),
    blocked: dict[str, int] | None = None,
    gpu: dict[str, float] | None = None,
) -> tuple[list[ChunkEvent], SessionStart]:
    """One session on the grid; ``drop[chunk]`` names boundaries left out, ``skip_chunks`` whole chunks."""
    periods = list(periods) if periods is not None else [0] + [period] * (n_chunks - 1)
    drop = drop or {}
    events, t = [], start + first
    for i in range(n_chunks):
        if i:
            t += periods[i]
        if i in skip_chunks:
            continue
        stamps = chunk_stamps(t, [step] * (len(BOUNDARIES) - 1))
        for b in drop.get(i, ()):
            del stamps[b]
        events.append(
            ChunkEvent(
                session=session, epoch=epoch, chunk=i, frames=frames_of(i), **stamps,
                blocked_ns=dict(blocked or {}), gpu_ms=dict(gpu or {}), cancelled=i in cancelled_chunks,
            )
        )
    return events, SessionStart(session=session, epoch=epoch, start_ns=start)


def make_run(n_sessions: int, **kw) -> tuple[list[ChunkEvent], list[SessionStart]]:
    """Session s is epoch s (session 0 = warm-up), each starting 10 s after the previous."""
    return _sessions(n_sessions, lambda s, start: make_session(s, s, start=start, **kw))


def case_d_session(session: int, *, start: int, n_chunks: int = 10, slow: dict[int, dict[str, int]] | None = None):
    """One Case D session (epoch = session); ``slow[chunk][segment]`` adds ms to that chunk's segment
    (``gap`` included)."""
    slow = slow or {}
    events, t, cpu_ready = [], start + 10 * MS, 0
    for c in range(n_chunks):
        extra = slow.get(c, {})
        if c:
            t = cpu_ready + (GAP + extra.get("gap", 0)) * MS
        stamps = chunk_stamps(t, [(ms + extra.get(name, 0)) * MS for name, ms in NOMINAL.items()])
        cpu_ready = stamps["cpu_ready"]
        events.append(ChunkEvent(session=session, epoch=session, chunk=c, frames=frames_of(c), **stamps))
    return events, SessionStart(session=session, epoch=session, start_ns=start)


def case_d_table(slow_by_session: dict[int, dict[int, dict[str, int]]], n_sessions: int = 4, n_chunks: int = 10):
    """``n_sessions`` Case D sessions, 10 s apart; ``slow_by_session[session]`` is that session's ``slow``."""
    return _sessions(n_sessions, lambda s, start: case_d_session(s, start=start, n_chunks=n_chunks,
                                                                 slow=slow_by_session.get(s)))


def _sessions(n: int, one) -> tuple[list[ChunkEvent], list[SessionStart]]:
    events, starts = [], []
    for s in range(n):
        e, st = one(s, s * 10_000 * MS)
        events += e
        starts.append(st)
    return events, starts
