import msgspec
import numpy as np
import pytest

from harness.measure import metrics as M
from harness.measure import stats as S
from harness.measure.events import BOUNDARIES, SessionStart
from harness.measure.stages import STAGE_NAMES, STAGES
from harness.measure.summary import BootstrapDef, boundary_summary

from helpers.events import MS


def test_steady_intervals_and_fps(tables):
    events, starts = tables.run(4)  # session 0 = warm-up
    # The warm-up session runs slower: including it would change every figure below.
    warm, _ = tables.session(0, 0, period=500 * MS)
    events = warm + [e for e in events if e.epoch > 0]
    for b in BOUNDARIES:
        sel = M.steady_intervals(events, b, sessions=starts)
        assert sel.n == 12 and sel.expected == 12 and sel.skipped_missing == 0
        assert set(sel.ns().tolist()) == {100 * MS}
        assert [s.chunk for s in sel.samples[:4]] == [5, 6, 7, 8]
        assert M.steady_fps(sel.samples) == pytest.approx(120.0)  # 12 frames / 0.1 s
        assert np.allclose(M.fps_values(sel.samples), 120.0)
        assert sel.per_session() == [[100 * MS] * 4] * 3


def test_window_selects_by_later_chunk(tables):
    periods = [0] + [(i + 1) * 10 * MS for i in range(1, 10)]
    events, start = tables.session(1, 1, periods=periods)
    sel = M.steady_intervals(events, "cpu_ready", sessions=[start])
    assert sel.ns().tolist() == [60 * MS, 70 * MS, 80 * MS, 90 * MS]
    w = M.Window(first_chunk=1, last_chunk=2)
    assert M.steady_intervals(events, "cpu_ready", w).ns().tolist() == [20 * MS, 30 * MS]
    # Chunk-level figures use the chunk's own index.
    chunks, expected, _ = M.steady_chunks(events, [start], w)
    assert [e.chunk for e in chunks] == [1, 2] and expected == 2


def test_window_rules():
    with pytest.raises(ValueError, match="warm-up"):
        M.Window(warmup_epochs=0)
    with pytest.raises(ValueError):
        M.Window(first_chunk=0)
    with pytest.raises(ValueError):
        M.Window(first_chunk=6, last_chunk=5)
    w = M.Window(warmup_epochs=2)
    assert not w.measured(1) and w.measured(2)


def test_missing_boundary_is_skipped_and_counted(tables):
    events, start = tables.session(1, 1, drop={6: ("delivered",)})
    sel = M.steady_intervals(events, "delivered", sessions=[start])
    # Chunk 6's delivered feeds intervals 6 and 7.
    assert [s.chunk for s in sel.samples] == [5, 8]
    assert sel.skipped_missing == 2 and sel.expected == 4
    assert M.steady_intervals(events, "encoded").n == 4  # other boundaries untouched
    stages = M.steady_stages(events, sessions=[start])
    assert stages["sink"].n == 3 and stages["sink"].skipped_missing == 1
    assert stages["encode"].n == 4


def test_missing_chunk_is_skipped_and_counted(tables):
    events, start = tables.session(1, 1, skip_chunks=(7,))
    sel = M.steady_intervals(events, "cpu_ready", sessions=[start])
    assert [s.chunk for s in sel.samples] == [5, 6] and sel.skipped_missing == 2


def test_boundary_absent_everywhere(tables):
    events, start = tables.session(1, 1, drop={i: ("gpu_ready",) for i in range(10)})
    assert "gpu_ready" not in M.boundaries_seen(events)
    sel = M.steady_intervals(events, "gpu_ready", sessions=[start])
    assert sel.n == 0 and sel.skipped_missing == 4
    stages = M.steady_stages(events)
    assert stages["convert"].n == 0 and stages["d2h"].n == 0 and stages["dit"].n == 4


def test_cancelled_sessions_excluded_but_counted(tables):
    a, sa = tables.session(1, 1)
    b, sb = tables.session(2, 2, cancelled_chunks=(7,))  # flagged on a chunk
    c, sc = tables.session(3, 3, n_chunks=3)
    sc = msgspec.structs.replace(sc, cancelled=True)  # flagged on the session start
    d, sd = [], SessionStart(session=4, epoch=4, start_ns=0, cancelled=True)  # cancelled before any chunk
    events, starts = a + b + c + d, [sa, sb, sc, sd]
    assert M.cancelled_keys(events, starts) == {(2, 2), (3, 3), (4, 4)}
    sel = M.steady_intervals(events, "cpu_ready", sessions=starts)
    assert sel.n == 4 and sel.expected == 4 and sel.sessions_cancelled == 3
    assert {s.session for s in sel.samples} == {1}
    assert M.ttfc(events, starts, "cpu_ready").sessions_cancelled == 3
    # Blocked time counts cancelled sessions' chunks by default (the blocking happened).
    assert len(M.measured_chunks(events, starts)) == 10 + 10 + 3
    assert len(M.measured_chunks(events, starts, include_cancelled=False)) == 10


def test_one_session_and_empty_input(tables):
    events, start = tables.session(1, 1)
    assert M.steady_intervals(events, "submit", sessions=[start]).n == 4
    empty = M.steady_intervals([], "submit")
    assert (empty.n, empty.expected, empty.skipped_missing) == (0, 0, 0)
    assert M.steady_fps(empty.samples) is None
    assert M.ttfc([], [], "submit").values == {}
    assert M.handoffs([]).n == 0
    assert all(s.n == 0 for s in M.steady_stages([]).values())
    assert M.blocked_time([]) == {} and M.gpu_times([]) == {}


def test_warmup_only(tables):
    events, start = tables.session(0, 0)
    sel = M.steady_intervals(events, "cpu_ready", sessions=[start])
    assert sel.n == 0 and sel.expected == 0
    # The unfiltered view still has them.
    assert len(M.delivery_intervals(events, "cpu_ready")) == 9


def test_session_start_without_chunks_counts_as_missing(tables):
    events, start = tables.session(1, 1)
    lost = SessionStart(session=2, epoch=2, start_ns=0)
    sel = M.steady_intervals(events, "cpu_ready", sessions=[start, lost])
    assert sel.n == 4 and sel.expected == 8 and sel.skipped_missing == 4


def test_nonpositive_interval_is_not_a_sample(tables):
    events, _ = tables.session(1, 1)
    events[6] = msgspec.structs.replace(events[6], delivered=events[5].delivered)
    sel = M.steady_intervals(events, "delivered")
    assert sel.skipped_nonpositive == 1 and sel.n == 3
    with pytest.raises(ValueError):
        M.interval_fps(12, 0)


def test_ttfc_and_rollout(tables):
    events, starts = tables.run(3, first=200 * MS, step=2 * MS)
    t = M.ttfc(events, starts, "cpu_ready")
    k = BOUNDARIES.index("cpu_ready")
    assert t.values == {(1, 1): 200 * MS + k * 2 * MS, (2, 2): 200 * MS + k * 2 * MS}
    r = M.rollouts(events, starts, "delivered")
    roll = r.values[(1, 1)]
    assert roll.ns == 200 * MS + 9 * 100 * MS + 11 * 2 * MS
    assert roll.frames == 117 and roll.chunks == 10
    assert roll.fps == pytest.approx(117 / roll.ns * 1e9)
    # No session start: TTFC and rollout are skipped, not guessed.
    t2 = M.ttfc(events, starts[:2], "cpu_ready")
    assert list(t2.values) == [(1, 1)] and t2.skipped_missing == 1
    # A hole in the session: no rollout.
    holed = [e for e in events if not (e.session == 1 and e.chunk == 4)]
    assert (1, 1) not in M.rollouts(holed, starts, "delivered").values


def test_ttfc_parts_tile_the_first_chunks_way(tables):
    """Chunk 0's setup (session start → submit) and every stage: they add up, session by session,
    to TTFC at delivered; a boundary left out drops only the parts it ends or opens."""
    events, starts = tables.run(3, first=200 * MS, step=2 * MS)
    parts = M.ttfc_parts(events, starts)
    assert list(parts) == [M.SETUP, *STAGE_NAMES]
    assert parts[M.SETUP].values == {(1, 1): 200 * MS, (2, 2): 200 * MS}
    assert all(set(p.values.values()) == {2 * MS} for name, p in parts.items() if name != M.SETUP)
    ttfc = M.ttfc(events, starts, "delivered").values
    for key, total in ttfc.items():
        assert sum(p.values[key] for p in parts.values()) == total
    holed, starts = tables.run(3, first=200 * MS, step=2 * MS, drop={0: ("decode_end",)})
    parts = M.ttfc_parts(holed, starts)
    assert parts["decode"].skipped_missing == parts["convert"].skipped_missing == 2
    assert parts["dit"].skipped_missing == 0 and len(parts["dit"].values) == 2


def test_handoff(tables):
    events, starts = tables.run(2, step=1 * MS)
    h = M.handoffs(events, sessions=starts)
    assert h.n == 4 and set(h.ns().tolist()) == {100 * MS - 7 * MS}
    # Case E: DiT(i) starts before chunk i-1's frames are on the host -> a negative handoff, kept.
    events, starts = tables.run(2, period=5 * MS, step=1 * MS)
    assert set(M.handoffs(events, sessions=starts).ns().tolist()) == {-2 * MS}


def test_stage_durations_and_shares(tables):
    events, starts = tables.run(2, step=3 * MS)
    d = M.stage_durations(events[0])
    assert list(d) == list(STAGE_NAMES) and set(d.values()) == {3 * MS}
    stages = M.steady_stages(events, sessions=starts)
    assert all(s.n == 4 for s in stages.values())
    shares = M.stage_shares({k: float(s.ns().mean()) for k, s in stages.items()})
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["dit"] == pytest.approx(1 / 11)
    assert M.stage_shares({"a": 1.0, "b": 3.0}) == {"a": 0.25, "b": 0.75}
    assert M.stage_shares({}) == {}
    assert [s[1:] for s in STAGES] == list(zip(BOUNDARIES, BOUNDARIES[1:]))


def test_gpu_and_blocked(tables):
    events, starts = tables.run(2, gpu={"dit": 10.0, "decode": 4.0}, blocked={"encode": 2 * MS, "dit": 0})
    steady, _, _ = M.steady_chunks(events, starts)
    g = M.gpu_times(steady)
    assert list(g) == ["decode", "dit"] and g["dit"] == [10.0] * 4
    b = M.blocked_time(M.measured_chunks(events, starts))
    assert b["encode"] == M.Blocked(total_ns=20 * MS, max_ns=2 * MS, chunks=10, chunks_blocked=10)
    assert b["dit"].chunks_blocked == 0


def test_duplicate_chunk_is_an_error(tables):
    events, _ = tables.session(1, 1)
    with pytest.raises(ValueError, match="more than once"):
        M.steady_intervals(events + [events[3]], "submit")


def test_unknown_boundary(tables):
    with pytest.raises(KeyError):
        M.steady_intervals([], "delivery")


def test_interval_fps_uses_the_delivered_chunks_own_frames(tables):
    # Chunks of different frame counts: interval i delivered chunk i's frames, not chunk i−1's.
    events, start = tables.session(1, 1)
    events = [msgspec.structs.replace(e, frames=8 + e.chunk) for e in events]
    sel = M.steady_intervals(events, "delivered", sessions=[start])
    assert [s.frames for s in sel.samples] == [13, 14, 15, 16]
    assert M.fps_values(sel.samples).tolist() == pytest.approx([130.0, 140.0, 150.0, 160.0])
    assert M.steady_fps(sel.samples) == pytest.approx(58 / 0.4)


@pytest.mark.parametrize("interval_ms", [
    [900.0, 948.8, 1000.0, 1100.0],  # even n: the default window always gives 4 per session
    [800.0, 900.0, 948.8, 1000.0, 1100.0],  # odd n
])
def test_interval_p50_and_fps_p50_are_one_sample(interval_ms):
    """FPS P50 is frames ÷ the interval P50's own interval: with 12 frames and interval P50 948.8 ms
    it is 12.65, where ranking per-interval FPS (the old rule) gave 12 / 1.0 s at even n."""
    samples = [M.Sample(1, 1, 5 + i, int(ms * 1e6), 12) for i, ms in enumerate(interval_ms)]
    p50 = S.nearest_rank([s.ns for s in samples], 50)
    assert M.median_interval(samples).ns == p50
    fps = M.median_interval_fps(samples)
    assert fps == pytest.approx(12 / (p50 / 1e9)) and fps == pytest.approx(12 / 0.9488)
    sel = M.Selection("cpu_ready", tuple(samples), len(samples))
    b = boundary_summary(sel, BootstrapDef(0, 0, 0.95, "sessions"), None)
    assert b.intervals.p50_ms == pytest.approx(948.8)
    assert b.fps_median == pytest.approx(12 / 0.9488)  # 12.65, not 12.00


def test_served_chunks_clips_the_window_to_the_sessions_a_listen_server_served():
    """A --listen client picks its session length: a server whose clients asked for 5 chunks must
    measure chunks 4 of those sessions, not report "no steady samples" for a 10-chunk window."""
    from helpers.events import make_session

    warm, w0 = make_session(0, 0, n_chunks=10)  # the warm-up is never measured: its length does not count
    five, s1 = make_session(1, 1, start=10_000 * MS, n_chunks=5)
    seven, s2 = make_session(2, 2, start=20_000 * MS, n_chunks=7)
    short, s3 = make_session(3, 3, start=30_000 * MS, n_chunks=2)
    s3 = msgspec.structs.replace(s3, cancelled=True)  # a cancelled session's length does not count either
    events, starts = warm + five + seven + short, [w0, s1, s2, s3]
    assert M.served_chunks(events, starts) == 5
    assert M.served_chunks(warm, [w0]) is None
    window = M.window_for(min(10, M.served_chunks(events, starts)))
    sel = M.steady_intervals(events, "cpu_ready", sessions=starts, window=window)
    assert (window.first_chunk, window.last_chunk) == (4, 4)
    assert sel.n == 2 and sorted({s.session for s in sel.samples}) == [1, 2]
