"""Every exit path leaves a run directory that says how the run ended, and nothing behind:
SIGINT/SIGTERM (even when the parent left SIGINT ignored, during start-up or mid-run, for
``serve`` and ``serve --listen``), SIGKILL of the whole process group (the manifest then reads as
abandoned and the next start reaps the ring), a full disk, and a reused ``--out``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.config import load_preset, override
from harness.drivers.procwatch import SHM, alive, descendants, wait_gone
from harness.drivers.runstate import claim_out, reap_dead_rings, ring_owner, run_status
from harness.drivers.serve_run import ServeOptions, serve
from harness.errors import HarnessError, RunFailed

from helpers import REPO
from helpers.procs import sigint_ignored, wait_for


def _rings_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if ring_owner(n) == pid]


def _start(out: Path, *extra: str, new_group: bool = False) -> subprocess.Popen:
    argv = [sys.executable, "-m", "harness", "serve", "--preset", "tiny", "--no-progress", "--out", str(out), *extra]
    return subprocess.Popen(sigint_ignored(argv), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=new_group, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _events(out: Path) -> int:
    try:
        return len((out / "events.jsonl").read_bytes().splitlines())
    except OSError:
        return 0


# case id → (signal, extra serve args, when to send it); SIGKILL goes to the whole process group
CASES = {
    "SIGINT-mid-run-serve": (signal.SIGINT, ["--sessions", "50"], "mid-run"),
    "SIGTERM-mid-run-serve": (signal.SIGTERM, ["--sessions", "50"], "mid-run"),
    "SIGTERM-start-up-serve": (signal.SIGTERM, ["--sessions", "50"], "start-up"),
    "SIGINT-listening-listen": (signal.SIGINT, ["--listen", "127.0.0.1:0"], "listening"),
    "SIGTERM-listening-listen": (signal.SIGTERM, ["--listen", "127.0.0.1:0"], "listening"),
    "SIGKILL-group-mid-run-serve": (signal.SIGKILL, ["--sessions", "50"], "mid-run"),
}
STOPS = [c for c in CASES if not c.startswith("SIGKILL")]


class Stopped:
    """What one signalled ``serve`` left: its pid, the processes it had when signalled, its exit."""

    def __init__(self, out: Path, proc: subprocess.Popen, workers: list[int], rc: int, err: str, rings: list[str]):
        self.out, self.pid, self.workers, self.rc, self.err, self.rings = out, proc.pid, workers, rc, err, rings


def _stop_one(out: Path, sig: signal.Signals, extra: list[str], when: str) -> Stopped:
    proc = _start(out, *extra, new_group=sig == signal.SIGKILL)
    try:
        if when == "mid-run":
            wait_for(lambda: _events(out) >= 1, 240, "the first chunk")
        elif when == "start-up":
            wait_for(lambda: (out / "manifest.json").exists(), 120, "the manifest")
        elif when == "launching":
            wait_for(lambda: (out / "events.jsonl").exists(), 120, "the launch")
        else:
            assert proc.stdout.readline().decode().startswith("listening on ws://127.0.0.1:")
        workers = descendants(proc.pid)
        if sig == signal.SIGKILL:
            workers.append(proc.pid)
            os.killpg(proc.pid, sig)  # the resource tracker dies too: nothing unlinks the ring
        else:
            proc.send_signal(sig)
        rc = proc.wait(120)
        rings = _rings_of(proc.pid)  # at once: any start on this machine may reap a dead owner's ring
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return Stopped(out, proc, workers, rc, proc.stderr.read().decode(), rings)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> dict[str, Stopped | BaseException]:
    """Every case at once (each waits mostly on its own start-up), instead of one topology after
    another. The SIGKILL case starts once the others are past their start's ring reaping, so no
    start of this module reaps the ring it is there to leave."""
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path_factory.mktemp("stops")

    def run(case: str) -> Stopped:
        if case.startswith("SIGKILL"):
            wait_for(lambda: all((root / c / "manifest.json").exists() or futures[c].done() for c in STOPS), 240,
                      "the other cases' manifests")
        return _stop_one(root / case, *CASES[case])

    with ThreadPoolExecutor(len(CASES)) as pool:
        futures = {}
        for case in CASES:
            futures[case] = pool.submit(run, case)
        return {case: f.exception() or f.result() for case, f in futures.items()}


def _result(stopped, case: str) -> Stopped:
    res = stopped[case]
    if isinstance(res, BaseException):
        raise res
    return res


@pytest.mark.parametrize("case", STOPS)
def test_serve_with_sigint_ignored_by_its_parent_stops_cleanly(case, stopped):
    sig, extra, when = CASES[case]
    _assert_stopped_cleanly(_result(stopped, case), sig, serving="--listen" in extra and when == "listening")


def test_sigterm_while_a_server_starts_its_ranks_stops_it_then(tmp_path):
    """``serve --listen`` stopped while its ranks start (events.jsonl is opened just before) stops
    then, as interrupted, not once every rank is ready (it used to serve, then end complete).
    Alone, not in the ``stopped`` fixture: its start-up would compete with theirs."""
    res = _stop_one(tmp_path / "run", signal.SIGTERM, ["--listen", "127.0.0.1:0"], "launching")
    _assert_stopped_cleanly(res, signal.SIGTERM, serving=False)
    assert json.loads((res.out / "manifest.json").read_text())["placement"] is None, "stopped once every rank was ready"


def _assert_stopped_cleanly(res: Stopped, sig: signal.Signals, serving: bool) -> None:
    out, err = res.out, res.err
    assert res.rc == (0 if serving else 128 + sig), err[-2000:]
    man = json.loads((out / "manifest.json").read_text())
    assert man["stopped_by"] == sig.name
    # a batch serve is interrupted, and so is a server still starting; a serving server's graceful
    # stop is how it normally ends
    expect = "complete" if serving else "interrupted"
    assert man["status"] == expect and man["error"] == (None if expect == "complete" else f"stopped by {sig.name}")
    assert run_status(out) == expect
    assert json.loads((out / "summary.json").read_text())["status"] == expect
    assert not list(out.rglob("*.tmp")) and not list(out.rglob("*.part")) and not (out / ".space-reserve").exists()
    assert not wait_gone(res.workers, 15), "worker processes left behind"
    assert not _rings_of(res.pid), "ring segments left behind"
    assert "Traceback" not in err, err[-2000:]


def test_sigkill_of_the_process_group_reads_abandoned_and_the_next_start_reaps_the_ring(stopped):
    res = _result(stopped, "SIGKILL-group-mid-run-serve")
    out = res.out
    assert res.rc == -signal.SIGKILL
    assert not wait_gone(res.workers, 15)
    man = json.loads((out / "manifest.json").read_text())
    assert man["status"] == "running" and man["owner"]["pid"] == res.pid
    assert run_status(out) == "abandoned"
    assert res.rings, "the killed group should have left its ring (else this test checks nothing)"
    left = [n for n in res.rings if (SHM / n).exists()]  # those another start has not reaped meanwhile
    planted = SHM / f"harness-{res.pid}-000000-{res.pid}-00000000-ctl"  # one of the dead owner's, surely still here
    planted.write_bytes(b"")
    removed = reap_dead_rings()
    assert {planted.name, *left} <= set(removed) and not _rings_of(res.pid)
    assert all(not alive(ring_owner(n)) for n in removed)
    # an abandoned run directory is refused too, and --overwrite clears it
    with pytest.raises(HarnessError, match="a run that is abandoned"):
        claim_out(out, overwrite=False)
    claim_out(out, overwrite=True)
    assert not any(out.iterdir())


def test_a_live_owner_keeps_its_ring_and_its_run_directory(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"status": "running", "owner": __import__(
        "harness.drivers.runstate", fromlist=["owner_record"]).owner_record()}))
    assert run_status(tmp_path) == "running"
    with pytest.raises(HarnessError, match="in use by a running run"):
        claim_out(tmp_path, overwrite=True)
    (tmp_path / "manifest.json").unlink()
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(HarnessError, match="not a run directory"):
        claim_out(tmp_path, overwrite=True)  # --overwrite never clears a directory that is not a run's
    assert (tmp_path / "notes.txt").exists()


def test_report_and_gate_refuse_an_abandoned_run_in_one_line(tmp_path, capsys):
    from harness import cli
    from harness.drivers.runstate import owner_record

    dead = owner_record()
    dead["start_ticks"] = (dead["start_ticks"] or 0) + 1  # same pid, another process instance: the owner is gone
    run = tmp_path / "run"
    (run / "outputs").mkdir(parents=True)
    (run / "events.jsonl").write_bytes(b"")
    (run / "manifest.json").write_text(json.dumps({"status": "running", "owner": dead}))
    assert run_status(run) == "abandoned"
    for argv in (["report", str(run)], ["gate", str(run), str(run)]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {run} is an abandoned run") and f"pid {os.getpid()}" in err and "\n" not in err
    assert not (run / "report.md").exists()


def test_a_full_disk_leaves_a_failed_manifest_and_no_summary(tmp_path):
    out = tmp_path / "run"
    cfg = override(load_preset("tiny"), runtime={"sessions": 1}, video={"chunks_per_session": 2})

    def disk_full(_res) -> None:  # the summary's temp file now writes into /dev/full: ENOSPC
        (out / "summary.json.tmp").symlink_to("/dev/full")

    with pytest.raises(RunFailed, match="No space left on device"):
        serve(cfg, ServeOptions(out=str(out), progress=False, probes=False), on_session=disk_full)
    man = json.loads((out / "manifest.json").read_text())
    assert man["status"] == "failed" and "summary not written: No space left on device" in man["error"]
    assert man["summary"] is None and not (out / "summary.json").exists()
    assert not list(out.rglob("*.tmp")), "a half-written file is left"


def test_a_stalled_worker_is_reported_within_the_bound_and_shows_in_the_summary(tmp_path, capfd):
    """A VAE rank that stops making progress for 4 s (alive, not dead) is reported at the driver's
    first look past the 1 s bound, while it is still stalled and long before rank_timeout_s; the
    run still completes with the frames of a clean run, and the summary lists the stall."""
    cfg = override(load_preset("tiny"), runtime={"sessions": 1, "stall_report_s": 1.0}, video={"chunks_per_session": 3})
    clean = serve(cfg, ServeOptions(out=str(tmp_path / "clean"), progress=False, probes=False))
    # on a loaded box an ordinary decode may pass the 1 s bound too; nothing there lasts like the injected stall
    assert not [s for s in clean.summary["stalls"] if s["lasted_s"] >= 3.0], clean.summary["stalls"]
    res = serve(cfg, ServeOptions(out=str(tmp_path / "stall"), progress=False, probes=False,
                                  faults={"vae:0": "stall-at-chunk:1:4"}))
    stalls = [s for s in res.summary["stalls"] if s["lasted_s"] >= 3.0]
    assert len(stalls) == 1 and stalls[0]["stage"] == "vae" and stalls[0]["chunk"] == 1, res.summary["stalls"]
    st = stalls[0]
    assert st["epoch"] == 0 and st["compile_allowance_s"] == 0.0  # named in the warm-up session: eager mode compiles nothing
    assert st["previous_check_s"] < st["bound_s"] == 1.0 <= st["reported_after_s"] < st["lasted_s"]
    assert "stalled" in res.summary["flags"] and res.summary["stall_report_s"] == 1.0
    assert "stall: vae (vae rank 0) made no progress" in capfd.readouterr().err  # the stage and its rank
    assert res.summary["status"] == "complete"
    hashes = [(r / "outputs" / "hashes.jsonl").read_text() for r in (clean.run_dir, res.run_dir)]
    assert hashes[0] == hashes[1]  # the stall changed no frame


def test_a_stop_signal_during_a_spawn_is_raised_once_the_spawn_is_done():
    """Stop signals inside ``signals.held()`` (the launcher wraps each worker's spawn in it) take
    effect when the block ends, never half-way through it."""
    from harness.drivers import signals as S

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    steps = []
    try:
        S.install()
        with pytest.raises(S.Stopped) as stop:
            with S.held():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)  # the handler has run by now, and raised nothing here
                steps.append("spawned")
        assert steps == ["spawned"] and stop.value.signum == signal.SIGTERM
    finally:
        for s, h in before.items():
            signal.signal(s, h)
        S._received.clear()


def test_a_stop_before_the_events_file_exists_still_reads_interrupted(tmp_path, monkeypatch):
    """SIGTERM at the very start of start-up (before the ring and events.jsonl exist) is an
    interrupted run with an empty summary, not a failed one whose summary found no events file."""
    from harness.drivers.signals import Stopped
    from harness.pipeline.ring import FrameRing

    def stop(*_a, **_k):
        raise Stopped(signal.SIGTERM)

    monkeypatch.setattr(FrameRing, "create", stop)
    out = tmp_path / "run"
    with pytest.raises(Stopped):
        serve(load_preset("tiny"), ServeOptions(out=str(out), progress=False, probes=False))
    man = json.loads((out / "manifest.json").read_text())
    assert (man["status"], man["error"], man["summary"]) == ("interrupted", "stopped by SIGTERM", "summary.json")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["sessions_completed"] == 0
    assert not (out / "events.jsonl").exists() and not list(out.rglob("*.tmp"))
