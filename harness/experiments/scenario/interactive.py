"""interactive: one player session (``client --player``) against each of Case D, Case E and H5a on
one preset (``--arms`` picks them), each arm its own ``serve --listen`` subprocess with the command
line's candidates and ``--set``s on top of the arm's own. Prints the action-to-photon table and
its decomposition per arm, and checks the player invariants: every event applied exactly once (or
receipted as arriving after the last boundary), at a boundary no earlier than its arrival, in the
order sent, with two-phase receipts, and every chunk that applied an event delivered.

Decode overlap buys throughput with pipeline depth; this is where the harness shows what that costs
a player. H5a is the Case E schedule as an optimisation candidate (``candidates/h5a_decode_overlap``
sets ``runtime.scheduler = "case-e"`` and changes nothing else), so its arm runs the same schedule
as Case E's, reached the way a candidate run reaches it: the two labels are kept, as issue 24 asks,
and their difference is the run-to-run spread.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from harness.experiments.scenario.params import Params
from harness.experiments.scenario.findings import Report
from harness.experiments.scenario.server_process import (ServerDidNotStart, ServerProcess, check_stopped_cleanly,
                                                         preset_of)
from harness.experiments.scenario.topology import prompt_for
from harness.measure.figures import console_table
from harness.measure.interaction import (LATENCY_COLUMNS, PARTS_COLUMNS, A2PSummary, invariants, latency_cells,
                                         parts_cells)
from harness.serving.client import SessionReport, ViewerOptions, run_session
from harness.serving.player import parse_trace

#: (label, the serve options that make the arm), by the name ``--arms`` takes; every arm also runs
#: the command line's own candidates, so a stack is timed per key press under each schedule
ARMS = {"case-d": ("Case D", ["--scheduler", "case-d"]), "case-e": ("Case E", ["--scheduler", "case-e"]),
        "h5a": ("H5a", ["--candidate", "H5a"])}


def _one_arm(report: Report, label: str, serve_args: list[str], p: Params, out: Path) -> SessionReport | None:
    try:
        server = ServerProcess(serve_args, out)
    except ServerDidNotStart as e:  # e.g. out of GPU memory in its warm-up: the next arm still runs
        report.check(f"{label}: the server starts", False, str(e))
        return None
    try:
        rep = asyncio.run(run_session(server.url, preset=preset_of(serve_args), seed=p.seed, chunks=p.chunks,
                                      prompt=prompt_for(p.seed), opts=ViewerOptions(player=tuple(parse_trace(p.player)))))
    finally:
        workers = server.workers()
        rc = server.stop()
    check_stopped_cleanly(report, server, workers, rc, label)
    if not report.check(f"{label}: the player session completes", rep.outcome == "complete" and rep.interaction is not None,
                        rep.error or rep.outcome):
        return None
    for name, problems in invariants(rep.interaction):
        report.check_none(f"{label}: {name}", problems, f"{rep.a2p.applied} applied, {rep.a2p.late} late "
                                                         f"of {rep.a2p.events} sent")
    return rep


def cost_note(summaries: dict[str, A2PSummary]) -> str | None:
    """What overlap costs a player: the change of action-to-photon P50 at delivery against Case D,
    in Case D's boundary intervals."""
    base = summaries.get("Case D")
    if base is None or base.delivery_ms["p50"] is None or not base.interval_ms:
        return None
    parts = []
    for label, s in summaries.items():
        if label != "Case D" and s.delivery_ms["p50"] is not None:
            d = s.delivery_ms["p50"] - base.delivery_ms["p50"]
            parts.append(f"{label} {d:+.0f} ms ({d / base.interval_ms:+.2f} Case D chunk intervals)")
    return ("A2P delivery P50 against Case D: " + ", ".join(parts)) if parts else None


def interactive_ws(serve_args: list[str], p: Params, out_root: Path) -> Report:
    report = Report("interactive", "websocket")
    summaries: dict[str, A2PSummary] = {}
    for label, extra in (ARMS[a] for a in p.arms):
        rep = _one_arm(report, label, serve_args + extra, p, out_root / label.lower().replace(" ", "-"))
        if rep is not None and rep.a2p is not None:
            summaries[label] = rep.a2p
    if summaries:
        report.sections += [f"action-to-photon, player trace {p.player} (rule: latest-wins key state, applied at each "
                            "chunk boundary; columns defined in README, Figures)"]
        report.sections += console_table(("arm", *LATENCY_COLUMNS), [[k, *latency_cells(s)] for k, s in summaries.items()])
        report.sections += console_table(("arm", *PARTS_COLUMNS), [[k, *parts_cells(s)] for k, s in summaries.items()])
    note = cost_note(summaries)
    if note:
        report.notes.append(note)
    if "h5a" in p.arms:
        report.notes.append("H5a is Case E's schedule as a candidate (it sets runtime.scheduler = case-e, nothing else)")
    return report.done()
