import json

import msgspec
import pytest

from harness.measure import figures as F
from harness.measure import summary as SM
from harness.drivers.rundir import write_json
from harness.measure.events import BOUNDARIES, read_run, write_events, write_sessions
from harness.measure.metrics import Window
from harness.measure.run_report import load_view

from helpers.events import MS


def test_known_figures(tables):
    events, starts = tables.run(6, first=300 * MS, step=2 * MS, gpu={"dit": 50.0}, blocked={"encode": MS})
    s = SM.build_summary(events, starts, n_boot=200)
    assert s.valid and s.schema == SM.SCHEMA
    assert s.flags == [SM.FLAG_TOO_FEW]  # 5 sessions x 4 = 20 < 100 intervals
    assert s.counts == SM.Counts(
        events=60, sessions_total=6, sessions_warmup=1, sessions_measured=5, sessions_cancelled=0,
        sessions_steady=5, steady_intervals=20,
    )
    ref = s.boundaries["cpu_ready"]
    assert ref.intervals.n == 20 and ref.n_sessions == 5
    assert ref.intervals.p50_ms == 100.0 and ref.intervals.p99_ms == 100.0 and ref.intervals.p99_is_max
    assert ref.p50_ci_ms == (100.0, 100.0)
    assert ref.fps_mean == pytest.approx(120.0) and ref.fps_median == pytest.approx(120.0)
    assert s.headline.fps_mean == pytest.approx(120.0) and s.headline.boundary == "cpu_ready"
    k = BOUNDARIES.index("cpu_ready")
    assert s.ttfc["cpu_ready"].p50_ms == pytest.approx(300 + 2 * k)
    assert s.headline.ttfc_p50_ms == pytest.approx(300 + 2 * k)
    assert s.handoff.p50_ms == pytest.approx(100 - 14)
    assert s.rollout.frames_per_session == 117
    assert s.rollout.time.p50_ms == pytest.approx(300 + 900 + 2 * k)  # at the reference boundary
    assert s.stages["dit"].durations.p50_ms == 2.0
    assert s.stages["dit"].share == pytest.approx(1 / 11)
    assert s.stages["dit"].share_of_interval == pytest.approx(0.02)
    assert (s.stages["d2h"].start, s.stages["d2h"].end) == ("gpu_ready", "cpu_ready")
    assert s.gpu_ms["dit"] == SM.GpuSummary(20, 50.0, 50.0, 50.0)
    assert s.blocked["encode"].total_ms == pytest.approx(50.0)  # 5 measured sessions x 10 chunks
    assert s.absent_boundaries == [] and s.order_violations == 0


def test_p99_resolved_with_100_samples(tables):
    periods = [0] + [100 * MS] * 9
    events, starts = tables.run(26, periods=periods)  # 25 measured x 4 = 100 intervals
    s = SM.build_summary(events, starts, n_boot=100)
    assert s.counts.steady_intervals == 100
    assert SM.FLAG_TOO_FEW not in s.flags
    assert not s.boundaries["submit"].intervals.p99_is_max


def test_flags(tables):
    a, sa = tables.session(0, 0)
    b, sb = tables.session(1, 1, drop={6: ("delivered",)})
    c, sc = tables.session(2, 2, cancelled_chunks=(3,))
    s = SM.build_summary(a + b + c, [sa, sb, sc], n_boot=50)
    assert {SM.FLAG_MISSING, SM.FLAG_CANCELLED, SM.FLAG_ONE_SESSION, SM.FLAG_TOO_FEW} <= set(s.flags)
    assert s.valid  # reported, not disqualifying
    assert s.counts.sessions_cancelled == 1 and s.counts.sessions_steady == 1
    assert s.boundaries["delivered"].skipped_missing == 2 and s.boundaries["delivered"].intervals.n == 2

    bad = list(b)
    bad[2] = msgspec.structs.replace(bad[2], dit_end=bad[2].dit_start - 1)
    s = SM.build_summary(bad, [sb], n_boot=50)
    assert SM.FLAG_ORDER in s.flags and not s.valid and s.order_violations == 1
    assert "dit_end" in s.violations[0]

    s = SM.build_summary(b, [], n_boot=50)
    assert SM.FLAG_NO_STARTS in s.flags and s.ttfc == {} and s.rollout.time.n == 0
    assert s.valid

    nogpu = [msgspec.structs.replace(e, cpu_ready=None, received=None) for e in b]
    s = SM.build_summary(nogpu, [sb], n_boot=50)
    assert SM.FLAG_REFERENCE_ABSENT in s.flags and not s.valid
    assert s.absent_boundaries == ["cpu_ready", "received"]
    assert s.headline.fps_mean is None
    assert SM.build_summary(nogpu, [sb], reference="delivered", n_boot=50).valid


def test_empty_and_warmup_only(tables):
    s = SM.build_summary([], [])
    assert not s.valid and SM.FLAG_EMPTY in s.flags and SM.FLAG_NO_MEASURED in s.flags
    assert s.boundaries == {} and s.handoff.n == 0 and s.headline.p50_ms is None
    w, ws = tables.session(0, 0)
    s = SM.build_summary(w, [ws])
    assert not s.valid and SM.FLAG_NO_MEASURED in s.flags and s.counts.sessions_warmup == 1


def test_duplicate_chunk_is_flagged_not_fatal(tables):
    b, sb = tables.session(1, 1)
    s = SM.build_summary(b + [b[3]], [sb], n_boot=50)
    assert SM.FLAG_ORDER in s.flags and s.boundaries["submit"].intervals.n == 4


def test_shape_is_stable_and_json_round_trips(tmp_path, tables):
    events, starts = tables.run(3)
    full = SM.summary_to_dict(SM.build_summary(events, starts, n_boot=50, window=Window(first_chunk=2, last_chunk=9)))
    empty = SM.summary_to_dict(SM.build_summary([], []))
    assert full.keys() == empty.keys()
    assert full["window"]["first_chunk"] == 2 and full["window"]["bootstrap"]["n_boot"] == 50
    assert full["stages"].keys() == empty["stages"].keys()

    # summary.json as the driver writes it: the figures and how the run went, one typed record
    write_events(tmp_path / "events.jsonl", events)
    write_sessions(tmp_path / "sessions.jsonl", starts)
    s = SM.build_summary(*read_run(tmp_path), n_boot=50)
    run = SM.run_summary(s, status="complete", hooks=[], candidates=["H1a"], probes={}, sessions_completed=3,
                         stalls=[{"stage": "vae"}], stall_report_s=5.0, protocol="timing")
    write_json(tmp_path / SM.SUMMARY_FILE, run)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["headline"]["fps_mean"] == pytest.approx(120.0)
    assert on_disk["flags"] == [*s.flags, SM.FLAG_STALLED] and "error" not in on_disk and "long_tail" not in on_disk
    assert SM.read_summary(tmp_path / "summary.json") == run


def test_one_name_per_figure_and_an_old_summary_reads_under_it(tmp_path, tables):
    """``fps_mean`` is the figure's name, its summary key and (spelled out) its label; a schema-3
    summary.json that wrote it as ``fps_steady`` reads under the new key."""
    assert F.define("fps_mean").keys == ("fps_mean",) and F.label("fps_mean") == "FPS mean"
    events, starts = tables.run(3)
    s = SM.run_summary(SM.build_summary(events, starts, n_boot=50), status="complete", hooks=[], candidates=[], probes={},
                       sessions_completed=3, stalls=[], stall_report_s=5.0, protocol="timing")
    old = msgspec.to_builtins(s)
    old["schema"] = 3
    old["headline"]["fps_steady"] = old["headline"].pop("fps_mean")
    for b in old["boundaries"].values():
        b["fps_steady"] = b.pop("fps_mean")
    write_events(tmp_path / "events.jsonl", events)
    write_sessions(tmp_path / "sessions.jsonl", starts)
    (tmp_path / "summary.json").write_text(json.dumps(old))
    back = SM.read_summary(tmp_path / "summary.json")
    assert back.headline.fps_mean == pytest.approx(120.0) and back.boundaries["cpu_ready"].fps_mean == pytest.approx(120.0)
    view = load_view(tmp_path)
    assert view.summary["headline"]["fps_mean"] == pytest.approx(120.0) and "fps_steady" not in view.summary["headline"]


def test_bootstrap_interval_reflects_session_spread(tables):
    events, starts = [], []
    for s in range(11):
        e, st = tables.session(s, s, start=s * 10_000 * MS, period=(90 + 2 * s) * MS)
        events += e
        starts.append(st)
    out = SM.build_summary(events, starts, n_boot=300, seed=3)
    b = out.boundaries["delivered"]
    lo, hi = b.p50_ci_ms
    assert lo < b.intervals.p50_ms < hi
    assert out == SM.build_summary(events, starts, n_boot=300, seed=3)
    circ = SM.build_summary(events, starts, n_boot=300, seed=3, block_length=3)
    assert circ.window.bootstrap.method == "circular-block:3"
