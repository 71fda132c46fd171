"""The console headline a run prints at its end (``serve``, ``serve --listen``): every label is a
``measure.figures`` label, so the console, ``summary.json`` and the report name a figure alike."""

from __future__ import annotations

import json
from pathlib import Path

from harness.measure import figures as F


def run_headline(run_dir: str | Path, summary: dict) -> list[str]:
    """Where the run is, and its headline; the scheduler (which names the handoff figure) is the
    manifest's, which candidates may have changed from the command line's."""
    try:
        scheduler = json.loads((Path(run_dir) / "manifest.json").read_text()).get("scheduler")
    except (OSError, ValueError):
        scheduler = None
    return [f"run directory: {run_dir}", *headline(summary, scheduler)]


#: The headline's columns, by figure name (``measure.figures`` defines and labels each).
HEADLINE_COLUMNS = ("boundary", "fps_mean", "fps_median", "interval_p50", "interval_p99", "n")


def headline(summary: dict, scheduler: str | None = None) -> list[str]:
    """The console headline: every label is a ``measure.figures`` label (one definition each)."""
    rows: list[list[str]] = []
    bounds = summary.get("boundaries", {})
    flagged = False
    for name in ("cpu_ready", "encoded", "delivered"):
        b = bounds.get(name)
        if not b or not b["intervals"]["n"]:
            rows.append([name, "no steady samples"])
            continue
        iv = b["intervals"]
        flagged |= iv["p99_is_max"]
        rows.append([name, f"{b['fps_steady']:.2f}", "—" if b.get("fps_median") is None else f"{b['fps_median']:.2f}",
                     f"{iv['p50_ms']:.1f}", f"{iv['p99_ms']:.1f}" + ("*" if iv["p99_is_max"] else ""), str(iv["n"])])
    out = F.console_table(HEADLINE_COLUMNS, rows)
    if flagged:
        out.append(f"  {F.label('p99_is_max')} {F.define('p99_is_max').formula}")
    ttfc = summary.get("ttfc", {}).get("delivered", {})
    if ttfc.get("p50_ms") is not None:
        out.append(f"  {F.label('ttfc_p50')} @ delivered: {ttfc['p50_ms']:.1f}")
    h = summary.get("handoff", {})
    if h.get("p50_ms") is not None:
        out.append(f"  {F.label('handoff_p50', scheduler)}: {h['p50_ms']:.2f}")
    out.append(f"  {F.label('fps_mean')} = Σ frames ÷ Σ intervals; percentiles are nearest-rank; every figure is "
               "defined in report.md and the README (Figures)")
    if not summary.get("valid", True):
        out.append(f"  summary flags: {', '.join(summary.get('flags', []))}")
    return out
