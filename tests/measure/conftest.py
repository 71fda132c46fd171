"""Hand-built event tables with known answers.

Chunk i's k-th boundary (k = index in BOUNDARIES) is recorded at
``start + first + sum(periods[1..i]) + k * step``, so at every boundary the interval of chunk i is
``periods[i]``, every segment lasts ``step``, TTFC at boundary k is ``first + k * step``, and the
handoff cpu_ready(i-1) -> dit_start(i) is ``periods[i] - 7 * step``.
"""

from __future__ import annotations

import pytest

from harness.measure.events import BOUNDARIES, ChunkEvent, SessionStart

MS = 1_000_000


def frames_of(chunk: int) -> int:
    return 9 if chunk == 0 else 12


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
    periods = list(periods) if periods is not None else [0] + [period] * (n_chunks - 1)
    drop = drop or {}
    events, t = [], start + first
    for i in range(n_chunks):
        if i:
            t += periods[i]
        stamps = {b: t + k * step for k, b in enumerate(BOUNDARIES) if b not in drop.get(i, ())}
        if i in skip_chunks:
            continue
        events.append(
            ChunkEvent(
                session=session, epoch=epoch, chunk=i, frames=frames_of(i), **stamps,
                blocked_ns=dict(blocked or {}), gpu_ms=dict(gpu or {}), cancelled=i in cancelled_chunks,
            )
        )
    return events, SessionStart(session=session, epoch=epoch, start_ns=start)


def make_run(n_sessions: int, **kw) -> tuple[list[ChunkEvent], list[SessionStart]]:
    """Session s is epoch s (session 0 = warm-up), each starting 10 s after the previous."""
    events, starts = [], []
    for s in range(n_sessions):
        e, st = make_session(s, s, start=s * 10_000 * MS, **kw)
        events += e
        starts.append(st)
    return events, starts


@pytest.fixture
def tables():
    class T:
        MS = MS
        session = staticmethod(make_session)
        run = staticmethod(make_run)
        frames = staticmethod(frames_of)

    return T
