"""Acceptance of the serving pipeline on the tiny CPU preset (SP 2, VAE ranks 2).

Two real serves (Case D and Case E, 3 sessions each) are shared by the tests of this module;
every assertion reads their run directories, media files and the processes they left (none).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO
from helpers.presets import tiny
from helpers.procs import run_segments, sigint_ignored

from harness.config import load_preset
from harness.drivers.launcher import RankFailed
from harness.drivers.procwatch import children, wait_gone, workers_of
from harness.drivers.serve_run import ServeOptions, serve
from harness.hooks import parse_hooks
from harness.measure.events import BOUNDARIES, read_events, validate_events
from harness.measure.gates import gate
from harness.pipeline.decode import decode_ffmpeg, decode_pyav
from harness.pipeline.ring import leftover_segments


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for sched in ("case-d", "case-e"):
        d = tmp_path_factory.mktemp(sched)
        out[sched] = serve(tiny(scheduler=sched, sessions=3), ServeOptions(out=str(d), progress=False))
    d = tmp_path_factory.mktemp("hooks")
    out["hooks"] = serve(tiny(sessions=3), ServeOptions(out=str(d), progress=False, hooks=parse_hooks(HOOKS)))
    return out


HOOKS = ("nvtx", "dispatch=summary", "trace", "profile=5")  # canonical spellings


def _session_pixels(run_dir: Path, epoch: int, chunks: int) -> np.ndarray:
    return np.concatenate([np.load(run_dir / "outputs" / f"epoch{epoch}" / f"chunk{c:02d}.pixels.npy") for c in range(chunks)])


@pytest.mark.parametrize("sched", ["case-d", "case-e"])
def test_sessions_have_117_frames_and_media_decode_exactly(runs, sched):
    res = runs[sched]
    cfg = load_preset("tiny")
    n = cfg.video.chunks_per_session
    assert len(res.sessions) == 3
    hashes = [json.loads(l) for l in (res.run_dir / "outputs" / "hashes.jsonl").read_text().splitlines()]
    for s in res.sessions:
        assert sum(e.frames for e in s.events) == 117
        assert [e.frames for e in s.events] == [9] + [12] * (n - 1)
        media = res.run_dir / "media" / f"session{s.start.session}.mkv"
        for dec in (decode_pyav(media), decode_ffmpeg(media)):
            decoded = dec.frames
            assert decoded.shape == (117, cfg.video.height, cfg.video.width, 3)
            if s.start.epoch in cfg.runtime.save_epochs:
                np.testing.assert_array_equal(decoded, _session_pixels(res.run_dir, s.start.epoch, n))
            # every epoch (saved or not) is checked against the per-chunk SHA-256 of the pixels
            mine = [h for h in hashes if h["epoch"] == s.start.epoch]
            start = 0
            for c, e in enumerate(s.events):
                digest = hashlib.sha256(decoded[start:start + e.frames].tobytes()).hexdigest()
                assert digest == next(h["pixels_sha256"] for h in mine if h["chunk"] == c)
                start += e.frames


def test_saved_outputs_layout(runs):
    d = runs["case-d"].run_dir
    files = sorted(p.relative_to(d).as_posix() for p in (d / "outputs").rglob("*.npy"))
    assert len(files) == 40
    lat = np.load(d / "outputs" / "epoch1" / "chunk03.latent.npy")
    pix = np.load(d / "outputs" / "epoch1" / "chunk03.pixels.npy")
    assert lat.dtype == np.float32 and lat.shape == (16, 3, 8, 16)
    assert pix.dtype == np.uint8 and pix.shape == (12, 64, 128, 3)
    man = json.loads((d / "manifest.json").read_text())
    assert man["status"] == "complete" and man["scheduler"] == "case-d"
    assert man["seeds"]["noise"] == man["config"]["schedule"]["noise"] == "session-stream"  # what a seed meant
    assert {"python", "torch", "harness_git"} <= set(man["versions"])
    summary = json.loads((d / "summary.json").read_text())
    assert summary["status"] == "complete"


def test_summary_json_is_one_typed_record(runs):
    """What the driver writes to summary.json decodes as ``measure.summary.RunSummary`` and back to
    the same JSON: no key the record does not know, none it leaves out."""
    import msgspec

    from harness.measure.summary import RunSummary, read_summary

    for name in ("case-d", "hooks"):
        path = runs[name].run_dir / "summary.json"
        record = read_summary(path)
        assert isinstance(record, RunSummary) and record.status == "complete"
        assert json.loads(msgspec.json.encode(record)) == json.loads(path.read_text())


def test_case_d_and_case_e_outputs_are_byte_identical(runs):
    a, b = runs["case-d"].run_dir, runs["case-e"].run_dir
    assert gate(a, b, "exact").passed
    ha = (a / "outputs" / "hashes.jsonl").read_text()
    hb = (b / "outputs" / "hashes.jsonl").read_text()
    assert ha == hb


@pytest.mark.parametrize("sched", ["case-d", "case-e"])
def test_every_boundary_present_and_ordered(runs, sched):
    events = read_events(runs[sched].run_dir / "events.jsonl")
    assert len(events) == 30
    assert validate_events(events) == []
    for e in events:
        assert list(e.present()) == list(BOUNDARIES), (e.session, e.chunk)


def test_case_d_is_sequential_and_case_e_overlaps(runs):
    def by_session(sched):
        ev = read_events(runs[sched].run_dir / "events.jsonl")
        return {(e.session, e.chunk): e for e in ev}

    d, e = by_session("case-d"), by_session("case-e")
    for (s, c), ev in d.items():
        if c > 0:
            assert ev.dit_start >= d[(s, c - 1)].cpu_ready  # DiT(i+1) waits for frames(i)
    overlapped = [(s, c) for (s, c), ev in e.items() if c > 0 and ev.dit_start < e[(s, c - 1)].cpu_ready]
    assert len(overlapped) >= 5  # Case E: DiT(i+1) started before cpu_ready(i)


@pytest.mark.parametrize("sched", ["case-d", "case-e"])
def test_nothing_left_behind(runs, sched):
    res = runs[sched]
    assert wait_gone(res.pids) == []
    assert leftover_segments(res.ring_prefix) == []


def test_worker_error_reaps_everything_and_keeps_the_run_directory(tmp_path):
    cfg = tiny(sessions=2)
    with pytest.raises(RankFailed, match="vae rank 1"):
        serve(cfg, ServeOptions(out=str(tmp_path), progress=False, faults={"vae:1": "die-at-chunk:3"}))
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["status"] == "failed" and "vae rank 1" in man["error"]
    events = read_events(tmp_path / "events.jsonl")
    assert len(events) >= 1 and validate_events(events) == []
    pids = workers_of(os.getpid())
    assert wait_gone(pids) == []
    assert not run_segments(os.getpid())


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_stop_signal_reaps_every_process_and_segment_even_with_sigint_ignored_by_the_parent(tmp_path, sig):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        sigint_ignored([sys.executable, "-m", "harness", "serve", "--sessions", "20", "--out", str(tmp_path),
                        "--no-progress"]),
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until chunks are flowing
            p = tmp_path / "events.jsonl"
            if p.exists() and p.read_text().count("\n") >= 3:
                break
            time.sleep(0.2)
        else:
            pytest.fail("serve produced no events in time")
        workers = children(proc.pid)
        assert len(workers) >= 5  # 2 DiT + 2 VAE + encoder
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # what a terminal's Ctrl-C does
        else:
            proc.send_signal(sig)  # what a service manager does: the top process only
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig], err[-2000:]
    assert err.decode().strip().splitlines()[-1] == f"interrupted (stopped by {signal.Signals(sig).name})"
    assert wait_gone(workers) == []
    assert not run_segments(proc.pid)
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["status"] == "interrupted"


def test_ring_and_queue_bounds_hold_under_a_throttled_sink(tmp_path):
    cfg = tiny(sessions=1, ring_slots=2, sink="throttled:8")  # 8 frames/s: half the nominal rate, slower than generation
    res = serve(cfg, ServeOptions(out=str(tmp_path), progress=False, probes=False))
    events = read_events(tmp_path / "events.jsonl")
    # A slot is held from before cpu_ready until the encoder released it (before encoded).
    spans = [(e.cpu_ready, e.encoded) for e in events]
    peak = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert peak <= cfg.runtime.ring_slots
    assert sum(e.blocked_ns.get("ring", 0) for e in events) > 0  # the producer really was held back
    assert sum(e.frames for e in events) == 117
    assert leftover_segments(res.ring_prefix) == []


def test_outputs_with_every_hook_on_are_byte_identical(runs):
    assert gate(runs["case-d"].run_dir, runs["hooks"].run_dir, "exact").passed
    summary = json.loads((runs["hooks"].run_dir / "summary.json").read_text())
    assert summary["hooks"] == list(HOOKS)  # an instrumented run says so
    assert json.loads((runs["case-d"].run_dir / "summary.json").read_text())["hooks"] == []
    reports = {p.name: json.loads(p.read_text()) for p in runs["hooks"].run_dir.glob("hooks.*.json")}
    assert {"hooks.dit0.json", "hooks.dit1.json", "hooks.vae0.json", "hooks.vae1.json", "hooks.encoder0.json"} <= set(reports)
    assert reports["hooks.dit0.json"]["dispatch"]["total_flops"] > 0
    trace = reports["hooks.driver.json"]  # the trace is the driver's: its report says what it wrote
    assert trace["files"]["trace.json"] == (runs["hooks"].run_dir / "trace.json").stat().st_size > 0
    assert trace["trace"]["chunks"] == len(read_events(runs["hooks"].run_dir / "events.jsonl"))
    for name, rep in reports.items():  # every file a hook claims to have written is there, at that size
        for f, size in rep.get("files", {}).items():
            p = runs["hooks"].run_dir / f
            assert p.exists() and (p.is_dir() or p.stat().st_size == size), (name, f)


def test_trace_has_a_track_per_process_and_agrees_with_events(runs):
    from harness.hooks.trace import slices, validate_trace
    from harness.measure.stages import INTERVALS

    d = runs["hooks"].run_dir
    trace = json.loads((d / "trace.json").read_text())
    assert validate_trace(trace) == []
    sl = slices(trace)
    assert {"driver", "dit rank 0", "vae rank 0", "encoder"} <= {s["process"] for s in sl}
    index = {(s["name"], s["args"]["session"], s["args"]["chunk"]): s for s in sl}
    for e in read_events(d / "events.jsonl"):
        for stage, (a, b) in INTERVALS.items():
            ta, tb = getattr(e, a), getattr(e, b)
            if ta is None or tb is None:
                continue
            s = index[(stage, e.session, e.chunk)]
            assert (s["args"]["start_ns"], s["args"]["end_ns"]) == (ta, tb)
            assert abs(s["dur"] - (tb - ta) / 1e3) < 1e-3


def test_gate_command_exit_status_follows_the_verdict(runs, tmp_path):
    import shutil

    a = runs["case-d"].run_dir
    b = tmp_path / "perturbed"
    shutil.copytree(a, b, ignore=shutil.ignore_patterns("media"))
    f = b / "outputs" / "epoch1" / "chunk04.latent.npy"
    lat = np.load(f)
    lat.flat[0] += 1e-4  # far inside the threshold, not byte-identical
    np.save(f, lat)
    hashes = [json.loads(l) for l in (b / "outputs" / "hashes.jsonl").read_text().splitlines()]
    for h in hashes:
        if (h["epoch"], h["chunk"]) == (1, 4):
            h["latent_sha256"] = hashlib.sha256(lat.tobytes()).hexdigest()
    (b / "outputs" / "hashes.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hashes))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "harness", "gate", *args], cwd=REPO, capture_output=True, text=True)

    same = run(str(a), str(runs["case-e"].run_dir), "--exact")
    assert same.returncode == 0 and "exact gate: pass" in same.stdout
    assert run(str(a), str(b)).returncode == 0
    exact = run(str(a), str(b), "--exact")
    assert exact.returncode == 1 and "chunk04.latent.npy" in exact.stdout and "exact gate: fail" in exact.stdout
    missing = run(str(a), str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: ") and len(missing.stderr.splitlines()) == 1
