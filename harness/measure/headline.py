"""The console headline a run prints at its end (``serve``, ``serve --listen``): the setting line
(``measure.setting``), then a table whose every label is a ``measure.figures`` label, so the
console, ``summary.json`` and the report name a figure alike; then every raised flag, defined."""

from __future__ import annotations

import json
from pathlib import Path

from harness.measure import figures as F
from harness.measure.setting import flag_lines, run_setting
from harness.measure.telemetry_figures import telemetry_line

#: the boundaries the headline has a row for, in data-flow order
HEADLINE_BOUNDARIES = ("cpu_ready", "encoded", "delivered")


def run_headline(run_dir: str | Path, summary: dict, with_dir: bool = True) -> list[str]:
    """Where the run is (unless the caller printed it at the start), what ran, and its headline;
    the scheduler (which names the handoff figure) is the manifest's, which candidates may have
    changed from the command line's."""
    try:
        manifest = json.loads((Path(run_dir) / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = {}
    where = [f"run directory: {Path(run_dir).resolve()}"] if with_dir else []
    return [*where, run_setting(run_dir, manifest), *headline(summary, manifest.get("scheduler"), manifest.get("mode"))]


#: The headline's columns, by figure name (``measure.figures`` defines and labels each). TTFC is a
#: column, so each row's TTFC is at that row's boundary — the same cell report.md prints.
HEADLINE_COLUMNS = ("boundary", "fps_mean", "fps_median", "interval_p50", "interval_p99", "ttfc_p50", "n")


def _ms(d: dict | None) -> str:
    return "—" if not d or d.get("p50_ms") is None else f"{d['p50_ms']:.1f}"


def headline(summary: dict, scheduler: str | None = None, mode: str | None = None) -> list[str]:
    """The console headline: every label is a ``measure.figures`` label (one definition each)."""
    rows: list[list[str]] = []
    bounds, ttfc = summary.get("boundaries", {}), summary.get("ttfc", {})
    flagged = False
    for name in HEADLINE_BOUNDARIES:
        b = bounds.get(name)
        if not b or not b["intervals"]["n"]:
            rows.append([name, "no steady samples"])
            continue
        iv = b["intervals"]
        flagged |= iv["p99_is_max"]
        rows.append([name, f"{b['fps_mean']:.2f}", "—" if b.get("fps_median") is None else f"{b['fps_median']:.2f}",
                     f"{iv['p50_ms']:.1f}", f"{iv['p99_ms']:.1f}" + ("*" if iv["p99_is_max"] else ""),
                     _ms(ttfc.get(name)), str(iv["n"])])
    out = F.console_table(HEADLINE_COLUMNS, rows)
    if flagged:
        out.append(f"  {F.label('p99_is_max')} {F.define('p99_is_max').formula}")
    h = summary.get("handoff", {})
    if h.get("p50_ms") is not None:
        out.append(f"  {F.label('handoff_p50', scheduler)}: {h['p50_ms']:.2f}")
    out += ttfc_parts_line(summary)
    out += compile_lines(summary, mode)
    tel = telemetry_line(summary.get("telemetry"))
    out += [f"  {tel}"] if tel else []
    out.append(f"  {F.label('fps_mean')} = Σ frames ÷ Σ intervals; {F.label('fps_median')} = frames ÷ that interval; "
               "percentiles are nearest-rank; every figure is defined in report.md and the README (Figures)")
    if not summary.get("valid", True):
        out.append("  INVALID: the figures above are not a measurement (see the flags marked invalid)")
    return out + flag_lines(summary.get("flags", []))


def ttfc_parts_line(summary: dict) -> list[str]:
    """Chunk 0's setup and stages (``summary.ttfc_parts``), the ones that took time: what bounds
    the TTFC, on one line."""
    parts = [(k, d["p50_ms"]) for k, d in (summary.get("ttfc_parts") or {}).items() if d.get("p50_ms") is not None]
    if not parts:
        return []
    shown = [f"{k} {v:.1f}" for k, v in parts if v >= 0.05]
    return [f"  {F.label('ttfc_parts')}: " + ", ".join(shown)]


def compile_lines(summary: dict, mode: str | None = None) -> list[str]:
    """The warm-up's first chunk beside the steady median, and the warm-up's excess
    (``summary.warmup``): what compilation (in a compiled mode) and first-touch allocation cost, on
    its own line rather than hidden in a stall."""
    stages = (summary.get("warmup") or {}).get("stages") or {}
    first = [f"{st} {x['first_ms']:.1f} (steady P50 {_num(x.get('steady_p50_ms'))})" for st, x in stages.items()
             if x.get("first_ms") is not None]
    excess = [f"{st} {x['excess_ms']:.1f}" for st, x in stages.items() if x.get("excess_ms") is not None]
    if not first:
        return []
    why = "mostly compilation" if mode in ("compiled", "deterministic") else "no compilation"
    out = [f"  {F.label('warmup_first_chunk')}: " + ", ".join(first) + f" ({mode or '?'} mode, {why})"]
    return out + ([f"  {F.label('warmup_excess')}: " + ", ".join(excess)] if excess else [])


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"
