"""The ``scenario`` command: check the arguments, run the scenario over the chosen way in, print
its report; exit 1 when an invariant breaks."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

from harness.candidates import split_id
from harness.drivers.config_options import resolve_config
from harness.errors import HarnessError
from harness.experiments.scenario.bad_input import bad_input_inprocess
from harness.experiments.scenario.bad_messages import bad_input_ws
from harness.experiments.scenario.cancel import cancel_inprocess, cancel_ws
from harness.experiments.scenario.crash import crash_inprocess, crash_ws
from harness.experiments.scenario.session_figures import MS
from harness.experiments.scenario.interactive import interactive_ws
from harness.experiments.scenario.params import Params, params_from
from harness.experiments.scenario.points import cancel_points, ws_cancel_points
from harness.experiments.scenario.findings import Report
from harness.experiments.scenario.server_process import REPO_ROOT, ServerProcess, check_stopped_cleanly, serve_argv
from harness.experiments.scenario.slow_consumer import slow_consumer_inprocess, slow_consumer_ws
from harness.experiments.scenario.topology import Topology, leak_checks
from harness.serving.client import session_url
from harness.serving.player import parse_trace


def _print_points(args: argparse.Namespace) -> int:
    """``--points list``: the points of the chosen transport (their timings illustrative)."""
    points = (cancel_points(20 * MS, 500 * MS, args.cancel_chunks) if args.over == "inprocess"
              else ws_cancel_points(1.0, args.cancel_chunks))
    for pt in points:
        print(f"{pt.name:<28} {pt.target}")
    return 0


def _check_ranks(p: Params, cfg) -> None:
    max_rank = {"dit": cfg.parallel.sp, "vae": cfg.parallel.vae_ranks}
    for r in p.ranks:
        role, _, idx = r.partition(":")
        if int(idx) >= max_rank[role]:
            raise HarnessError(f"--ranks: {r} does not exist (sp={cfg.parallel.sp}, vae_ranks={cfg.parallel.vae_ranks})")


def _check_interactive(args: argparse.Namespace) -> None:
    """interactive launches one server per arm (its scheduler and candidate) and plays a trace."""
    if args.over == "inprocess":
        raise HarnessError("interactive runs over websocket only (a player needs the network protocol)")
    if args.connect:
        raise HarnessError("interactive launches its own servers, one per arm; --connect cannot be used")
    if args.scheduler:
        raise HarnessError("interactive sets the scheduler of each arm (Case D, Case E, H5a); drop --scheduler "
                           "and pick arms with --arms")
    if any(split_id(c)[0] == "H5a" for c in args.candidate):
        raise HarnessError("interactive runs H5a as an arm (--arms h5a); drop --candidate H5a")
    parse_trace(args.player)


def run(args: argparse.Namespace) -> int:
    if args.scenario == "interactive":
        _check_interactive(args)
    args.over = args.over or ("websocket" if args.scenario == "interactive" else "inprocess")
    if args.points == "list":
        return _print_points(args)
    if getattr(args, "launcher", "local") != "local":
        raise HarnessError("scenarios run on the local launcher only (they watch worker processes through /proc)")
    cfg = resolve_config(args)
    p = params_from(args, Path(tempfile.gettempdir()))  # checked before anything is made
    work = Path(tempfile.mkdtemp(prefix="harness-scenario-"))
    p = dataclasses.replace(p, workdir=work)
    out_root = Path(args.out) if args.out else REPO_ROOT / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-scenario-{args.scenario}"
    if args.scenario == "crash":
        _check_ranks(p, cfg)
    try:
        report = _dispatch(args, cfg, p, out_root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(report.text())
    print(f"output: {out_root}")
    return 0 if report.ok else 1


def _inprocess(args: argparse.Namespace, cfg, p: Params, out_root: Path) -> Report:
    if args.scenario == "crash":
        return crash_inprocess(cfg, p, out_root)
    if args.scenario == "bad-input":
        return bad_input_inprocess(cfg, p, serve_argv(args), out_root)
    fn = slow_consumer_inprocess if args.scenario == "slow-consumer" else cancel_inprocess
    topo = Topology(cfg, str(out_root), candidates=tuple(args.candidate))
    with topo:
        report = topo.run(lambda bench: fn(bench, p))
    leak_checks(report, topo.pids, topo.result.ring_prefix if topo.result else None)
    return report


def _websocket(args: argparse.Namespace, p: Params, out_root: Path) -> Report:
    sargs = serve_argv(args)
    if args.scenario == "crash":
        if args.connect:
            raise HarnessError("crash --over websocket launches its own faulty servers; --connect cannot be used")
        return crash_ws(sargs, p, out_root)
    if args.scenario == "interactive":
        return interactive_ws(sargs, p, out_root)
    server = None if args.connect else ServerProcess(sargs, out_root)
    url = server.url if server else session_url(args.connect)
    try:
        if args.scenario == "slow-consumer":
            report = slow_consumer_ws(url, p, server)
        elif args.scenario == "cancel":
            report = cancel_ws(url, p, server)
        else:
            report = bad_input_ws(url, p)
    finally:
        if server is not None:
            workers = server.workers()
            rc = server.stop()
    if server is not None:
        check_stopped_cleanly(report, server, workers, rc)
    return report


def _dispatch(args: argparse.Namespace, cfg, p: Params, out_root: Path) -> Report:
    return _inprocess(args, cfg, p, out_root) if args.over == "inprocess" else _websocket(args, p, out_root)
