"""How a ``compare`` result reads: compare.md and the console summary (``experiments.compare``
computes it). Every ratio is printed with the columns it is the quotient of and rounded to the
width of its interval (``stats.ratio_text``); a figure too wide to state reads "no verdict: …"."""

from __future__ import annotations

from pathlib import Path

import msgspec

from harness.drivers.rundir import write_json
from harness.measure import stats as S

# The records (compare.CompareResult, Row, Ratio) live with the computation, which imports this
# module: they are read here by their fields, unannotated, so there is no import circle.


def ms_text(x: float | None, r) -> str:
    """A column in ms, to the resolution the row's interval supports (its relative width × x)."""
    if x is None:
        return "—"
    width = x * (r.high - r.low) / r.value if r is not None and r.low is not None else x
    return f"{x:.{S.decimals(width, most=1)}f}"


def mde_text(r) -> str:
    if r.mde is not None:
        return f"{100 * r.mde:.2g} %"
    return "—" if r.ab is None else f"no verdict: beyond ×{S.WIDEST_FACTOR:g} at this look's level"


def _window_text(w) -> str:
    if not isinstance(w, dict):
        return "?"
    return f"chunks {w.get('first_chunk', '?')}–{w.get('last_chunk', '?')} of each session after {w.get('warmup_epochs', '?')} warm-up"


#: what the baseline and candidate columns hold, said once under every table that prints them
COLUMNS_NOTE = ("baseline, candidate: geometric mean of the launch medians (one launch: of its session medians) — the "
                "units the ratio reads, so ratio = candidate / baseline; interval and MDE rounded to the interval's width")


def render_md(res) -> str:
    g, lv = res.gate, res.interval
    seq = res.sequential
    lines = [
        f"# compare: {' + '.join(res.candidate)} vs baseline {' + '.join(res.baseline) or '(no candidate)'}",
        "",
        f"**Verdict @ {res.reference}: {res.verdict}** — {res.reason}",
        "",
        f"- **{gate_line(g)}**",
        f"- rounds: {res.rounds_run} of {res.rounds_requested} " + ("at most (--until-resolved)" if seq else "requested")
        + f", order {res.order}" + (f"; stopped early: {res.stopped_early}" if res.stopped_early else ""),
        f"- protocol per launch: {res.protocol.get('name', 'timing')}, {res.protocol.get('sessions', '?')} sessions "
        f"(1 warm-up), {res.protocol.get('chunks_per_session', '?')} chunks, window {_window_text(res.protocol.get('window'))}",
        *[f"- {'baseline' if arm == 'A' else 'candidate'} ({arm}, first launch): `{line}`"
          for arm, line in sorted(res.setting_lines.items())],
        f"- verdict: {res.method}",
        f"- interval: {S.level_text(1 - lv['level'])} (the nominal level of this look); equivalent = "
        f"within 1 ± {lv['margin']:g}",
    ]
    if seq:
        lines.append(f"- sequential: looks after rounds {seq['looks'][0]}–{seq['looks'][-1]}, alpha spent O'Brien–Fleming-"
                     f"type (overall false faster/slower ≈ {seq['alpha']:g}); {seq.get('outcome', '')}; minimum detectable "
                     f"effect (80 % power): {pct_text(seq.get('mde_before'))} for the whole budget after round "
                     f"{seq['looks'][0]}, {pct_text(seq.get('mde_after'))} at the end")
    lines += [
        "",
        "| metric | baseline | candidate | ratio [interval] | launches | A/A ratio [interval] | MDE (80 %) | verdict |",
        "|---|---:|---:|---|---|---|---:|---|",
    ]
    for r in res.rows:
        ab = r.ab or r.within_launch
        note = " (within one launch: no verdict)" if r.ab is None and r.within_launch else ""
        launches = f"{ab.launches[0]}+{ab.launches[1]}" if r.ab else "—"
        lines.append(
            f"| {r.metric} | {ms_text(r.baseline_ms, ab)} ms | {ms_text(r.candidate_ms, ab)} ms | "
            f"{S.ratio_text(ab) if ab else '—'}{note} | {launches} | {S.ratio_text(r.aa) if r.aa else '—'} | "
            f"{mde_text(r)} | {r.verdict} |"
        )
    lines += ["", COLUMNS_NOTE + ".", "", "## runs", "", "| round | arm | candidates | status | directory |",
              "|---:|---|---|---|---|"]
    for r in res.runs:
        lines.append(f"| {r.round} | {r.arm} | {', '.join(r.candidates) or '—'} | {r.status} | `{r.dir}` |")
    lines += ["", "Units: one per launch, the median of its steady intervals pooled over its sessions (TTFC: over its "
              "measured sessions).", ""]
    return "\n".join(lines)


def pct_text(x: float | None) -> str:
    return f"no figure (beyond ×{S.WIDEST_FACTOR:g} or no interval)" if x is None else f"{100 * x:.2g} %"


def write_outputs(out: Path, res) -> tuple[Path, Path]:
    j, md = out / "compare.json", out / "compare.md"
    write_json(j, msgspec.to_builtins(res))
    tmp = md.with_suffix(".md.tmp")
    tmp.write_text(render_md(res))
    tmp.replace(md)
    return j, md


def gate_line(g) -> str:
    """``gate (exact): pass: 28 files …`` — the status said once."""
    return f"gate ({g.kind}): {g.verdict if g.verdict.startswith(g.status) else f'{g.status}: {g.verdict}'}"


def summary_lines(res, with_gate: bool = True) -> list[str]:
    """The console summary; ``with_gate`` False when the loop has already printed the gate line."""
    out = [gate_line(res.gate)] if with_gate else []
    for r in res.rows:
        ab = r.ab or (r.within_launch if r.verdict == "no verdict" else None)
        if r.ab:
            out.append(f"  {r.metric:<34} {ms_text(r.baseline_ms, ab)} → {ms_text(r.candidate_ms, ab)} ms  ratio "
                       f"{S.ratio_text(ab)} over {ab.launches[0]}+{ab.launches[1]} launches  {r.verdict}")
        else:
            out.append(f"  {r.metric:<34} {r.verdict}: {r.reason}")
    if any(r.ab for r in res.rows):
        out.append("  (" + COLUMNS_NOTE + ")")
    if res.sequential:
        q = res.sequential
        out.append(f"sequential: {q.get('outcome')}; minimum detectable effect (80 % power) {pct_text(q.get('mde_before'))} "
                   f"for {q['max_rounds']} rounds (seen after round {q['looks'][0]}), {pct_text(q.get('mde_after'))} at the end")
    out.append(f"verdict @ {res.reference}: {res.verdict}" + (f" — {res.reason}" if res.verdict == "no verdict" else ""))
    return out
