"""crash: a DiT or VAE rank SIGKILLed mid-session. The error names the rank and surfaces within a
bound, nothing hangs, every process is reaped, shared memory is unlinked, and the run directory
says the run failed and is valid up to the failure."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

from harness.config import override
from harness.drivers.launcher import RankFailed
from harness.drivers.procwatch import DeathWatch, FirstDeath, wait_gone
from harness.experiments.scenario.session_figures import MS, ms
from harness.experiments.scenario.params import Params
from harness.experiments.scenario.findings import Report, check_reaped, reaped_cells
from harness.experiments.scenario.server_process import ServerProcess, preset_of
from harness.experiments.scenario.topology import prompt_for, serve_watched
from harness.measure.clock import now
from harness.measure.events import EventFormatError, read_events, validate_events
from harness.serving.client import ViewerOptions, run_session


def _rank_name(key: str) -> str:
    role, _, rank = key.partition(":")
    return f"{role} rank {rank}"


def _names(message: str, key: str, first: FirstDeath | None) -> bool:
    """The error leads with the faulted rank, and the pid it names is a process that died first
    (one the watch cannot tell apart from the first, when a look found two gone at once)."""
    head = message.split(";")[0].removeprefix("error: ")
    return head.startswith(_rank_name(key)) and (first is None or any(f"pid {pid})" in head for pid in first.pids))


def _in_bound(t_det: int | None, first: FirstDeath | None, p: Params) -> bool:
    """Surfaced after the death (never before the last look that saw the process running) and within
    the bound of the earliest moment it can have died: no slack for how often the watch looks."""
    return None not in (t_det, first) and first.after_ns <= t_det <= first.after_ns + p.detect_bound_s * 1e9


def _run_dir_checks(report: Report, run_dir: Path, rank: str, completed_sessions: int | None) -> None:
    try:
        man = json.loads((run_dir / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        report.check(f"{rank}: manifest readable", False, str(e))
        return
    try:
        events = read_events(run_dir / "events.jsonl")
        problems = validate_events(events)
    except (OSError, EventFormatError) as e:
        events, problems = [], [str(e)]
    summary_ok = (run_dir / "summary.json").exists() and json.loads((run_dir / "summary.json").read_text()).get("status") == "failed"
    named = _rank_name(rank) in (man.get("error") or "")
    bad_media = [p.name for p in (run_dir / "media").glob("*")
                 if p.name.endswith(".part") or (completed_sessions is not None and p.suffix == ".mkv"
                                                 and int(p.stem.removeprefix("session")) >= completed_sessions)]
    ok = man.get("status") == "failed" and named and not problems and summary_ok and not bad_media
    report.check(f"{rank}: run directory valid up to the failure", ok,
                 f"manifest status {man.get('status')!r}{'' if named else ' (error does not name the rank)'}, "
                 f"{len(events)} events parse and validate" + (f" — {problems[:2]}" if problems else "")
                 + ("" if summary_ok else ", summary.json missing or not 'failed'")
                 + (f", unfinished media left: {bad_media}" if bad_media else ""))


def _crash_rank_inprocess(report: Report, cfg, p: Params, key: str, chunks: int, out: Path) -> None:
    detect: dict = {}

    def runner(ctx) -> None:
        try:
            ctx.add_result(ctx.driver.run_session(session=0, epoch=0, seed=p.seed, chunks=chunks))
        except RankFailed:
            detect["t"] = now()
            raise

    run = serve_watched(cfg, out, runner, "scenario-crash", faults={key: f"die-at-chunk:{p.fault_chunk}"})
    msg, first, t_det = run.message, run.first_death, detect.get("t")
    det_ns = None if (first is None or t_det is None) else t_det - first.by_ns  # may be < 0 by the watch's period
    tear_ns = None if t_det is None else run.returned_ns - t_det
    report.rows.append([key, f"chunk {p.fault_chunk}", msg or "(no error)", ms(det_ns), ms(tear_ns),
                        *reaped_cells(run.workers, run.left, run.shm_left)])
    report.check(f"{key}: a clear error naming the rank", isinstance(run.error, RankFailed) and _names(msg, key, first),
                 msg or "no error raised")
    report.check(f"{key}: surfaced within {p.detect_bound_s:g} s of the death", _in_bound(t_det, first, p),
                 f"{max(det_ns, 0) / MS:.1f} ms" if det_ns is not None else "death or error not observed")
    report.check(f"{key}: no hang (teardown within {p.teardown_bound_s:g} s)", tear_ns is not None and tear_ns <= p.teardown_bound_s * 1e9,
                 f"{tear_ns / 1e9:.2f} s" if tear_ns is not None else "-")
    check_reaped(report, key, run.workers, run.left, run.shm_left)
    _run_dir_checks(report, out, key, completed_sessions=0)


def crash_inprocess(cfg, p: Params, out_root: Path) -> Report:
    report = Report("crash", "inprocess")
    report.header = ["rank", "dies at", "error", "detect ms", "teardown ms", "processes", "shm"]
    chunks = p.fault_chunk + 2
    cfg = override(cfg, video={"chunks_per_session": max(chunks, 1)}, runtime={"sessions": 1})
    for key in p.ranks:
        _crash_rank_inprocess(report, cfg, p, key, chunks, out_root / key.replace(":", ""))
    return report.done()


def _crash_rank_ws(report: Report, serve_args: list[str], p: Params, key: str, chunks: int, out: Path) -> None:
    server = ServerProcess(serve_args, out, extra=["--fault", f"{key}=die-at-chunk:{p.fault_chunk}"])
    workers = server.workers()
    with DeathWatch(server.pid, recursive=True, exclude_existing=False) as watch:
        rep = asyncio.run(run_session(server.url, preset=preset_of(serve_args), seed=p.seed, chunks=chunks,
                                      prompt=prompt_for(p.seed), opts=ViewerOptions()))
        try:
            rc = server.wait(p.teardown_bound_s)
        except subprocess.TimeoutExpired:
            rc = None
        t_exit = now()
    if rc is None:
        server.stop(5)
    first = watch.first_death()
    left = wait_gone(workers, 10.0)
    shm_left = server.shm_left()
    err_lines = [ln for ln in server.stderr().splitlines() if ln.startswith("error:")]
    det_ns = None if first is None else rep.t_end_ns - first.by_ns
    exit_ns = None if first is None else t_exit - first.by_ns
    report.rows.append([key, f"chunk {p.fault_chunk}", rep.error or rep.outcome, rc, ms(det_ns), ms(exit_ns),
                        *reaped_cells(workers, left, shm_left)])
    report.check(f"{key}: the client gets a clear error naming the rank",
                 rep.outcome == "error" and _names(rep.error, key, first), rep.error or rep.outcome)
    report.check(f"{key}: the server exits 1 with one error line naming the rank",
                 rc == 1 and len(err_lines) == 1 and _names(err_lines[0], key, first),
                 f"rc {rc}; {err_lines or 'no error line'}")
    report.check(f"{key}: surfaced within {p.detect_bound_s:g} s of the death, no hang", _in_bound(rep.t_end_ns, first, p) and rc is not None,
                 f"client told after {ms(det_ns)} ms, server gone after {ms(exit_ns)} ms")
    check_reaped(report, key, workers, left, shm_left)
    _run_dir_checks(report, out, key, completed_sessions=0)


def crash_ws(serve_args: list[str], p: Params, out_root: Path) -> Report:
    report = Report("crash", "websocket")
    report.header = ["rank", "dies at", "client got", "server rc", "detect ms", "server exit ms", "processes", "shm"]
    for key in p.ranks:
        _crash_rank_ws(report, serve_args, p, key, p.fault_chunk + 2, out_root / f"ws-{key.replace(':', '')}")
    return report.done()
