"""The viewer's playout model and the per-session figures of its table (``client``'s session rows;
``measure.figures``: client_*): pure functions of the client's own receipts, on the client's clock.

The player starts once its prebuffer has arrived and then plays one frame per 1/fps; a frame not
yet arrived stalls it (every later frame shifts by the stall), so underruns, stall time and the
continuous-play ratio are what a viewer of that rate would have seen.
"""

from __future__ import annotations

from typing import Sequence

import msgspec

#: the viewer's session table, by figure (``measure.figures`` defines and labels each): seed,
#: outcome and chunks are read off the session's report, the rest computed here
SESSION_COLUMNS = ("session", "epoch", "client_seed", "client_outcome", "client_chunks", "client_frames", "client_ttfc",
                   "client_underruns", "client_stall", "client_continuous", "client_read_fps")


class PlayStats(msgspec.Struct, frozen=True):
    frames: int
    prebuffer_frames: int
    startup_ms: float | None  # session start → playback start (None: never started)
    underruns: int
    stall_ms: float
    play_ms: float
    continuous_ratio: float | None


def _play(times: list[int], period: float, pre: int) -> tuple[list[float], float, int]:
    """Each frame's play time (it plays when due, or on arrival after a stall), the stall time and
    the underruns of a player that starts once ``pre`` frames have arrived."""
    start = times[pre - 1]
    stall, underruns, stalled_prev, plays = 0.0, 0, False, []
    for k, t in enumerate(times):
        due = start + k * period + stall
        if t > due:
            stall += t - due
            underruns += 0 if stalled_prev else 1
            stalled_prev = True
        else:
            stalled_prev = False
        plays.append(start + k * period + stall)
    return plays, stall, underruns


def _prebuffer(times: list[int], prebuffer_frames: int) -> int:
    return min(max(1, prebuffer_frames), len(times))


def playout(arrivals: list[tuple[int, int]], fps: int, prebuffer_frames: int, t0_ns: int) -> PlayStats:
    """``arrivals``: (frames, arrival ns) per chunk in order. Frames of a chunk arrive together."""
    times = [t for n, t in arrivals for _ in range(n)]
    if not times:
        return PlayStats(0, prebuffer_frames, None, 0, 0.0, 0.0, None)
    pre = _prebuffer(times, prebuffer_frames)
    period = 1e9 / fps
    _, stall, underruns = _play(times, period, pre)
    play = len(times) * period
    return PlayStats(len(times), pre, (times[pre - 1] - t0_ns) / 1e6, underruns, stall / 1e6, play / 1e6,
                     play / (play + stall))


def first_frame_playout(arrivals: list[tuple[int, int]], fps: int, prebuffer_frames: int) -> list[int]:
    """When each chunk's first frame plays in the same playout model (ns, the arrivals' clock)."""
    times = [t for n, t in arrivals for _ in range(n)]
    if not times:
        return []
    plays, _, _ = _play(times, 1e9 / fps, _prebuffer(times, prebuffer_frames))
    firsts, k = [], 0
    for n, _ in arrivals:
        firsts.append(round(plays[k]))
        k += n
    return firsts


def session_ttfc_ms(start_ns: int, first_media_ns: int | None) -> float | None:
    """The first chunk's media read − the start sent, client clock (None: no media came)."""
    return (first_media_ns - start_ns) / 1e6 if first_media_ns else None


def read_fps(frames: Sequence[int], receipts_ns: Sequence[int]) -> float | None:
    """Frames of chunks 1… ÷ (last receipt − first receipt): the rate the media arrived at (chunk 0
    opens the span, so its frames are not counted); None with fewer than two chunks."""
    if len(receipts_ns) < 2 or len(frames) < 2:
        return None
    span = (receipts_ns[-1] - receipts_ns[0]) / 1e9
    return sum(frames[1:]) / span if span > 0 else None
