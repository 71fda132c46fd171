"""What a replay leaves in ``--out`` (default: the run directory): ``replay.json``, ``replay.md``
(a table per op kind: median ms and ratio to the row's best, the local winner, and — for attention
— the whole-model result of candidate H1b for that kernel when ``--compare DIR`` holds a
``compare.json`` of ``compare --candidate H1b:<backend>``), and ``replay_<kind>.png`` heat maps of
time / best per shape."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib
import numpy as np
import torch
from matplotlib.figure import Figure

from harness.experiments.replay.op_backends import h1b_arms
from harness.experiments.replay.h1b import h1b_text, load_h1b
from harness.experiments.replay.reference import ATOL, REL_L2, RTOL
from harness.experiments.replay.settings import KINDS

SCHEMA = 1


def _cell(r: dict) -> str:
    if r["status"] == "ok":
        return f"{r['median_ms']:.3f} ({r['ratio']:.2f}×)"
    if r["status"] == "numerics" and r.get("median_ms") is not None:  # a model-gated backend, timed
        return f"✗ numerics, {r['median_ms']:.3f}"
    return {"unsupported": "n/a", "numerics": "✗ numerics", "oom": "✗ OOM", "error": "✗ error"}.get(r["status"], "✗")


def _kind_section(kind: str, entries: list[dict], h1b: dict) -> list[str]:
    """One op kind's table (a row per input, a column per backend) and its failures."""
    names = list(dict.fromkeys(r["backend"] for e in entries for r in e["results"]))
    head = ["shape", "op id", *names, "winner"] + (["H1b (whole model)"] if kind == "attention" else [])
    lines = [f"## {kind}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        by = {r["backend"]: r for r in e["results"]}
        row = [e["label"], f"`{e['op_id']}`", *[_cell(by[n]) if n in by else "" for n in names], e["winner"] or "none"]
        if kind == "attention":
            row.append(h1b_text(e["winner"], h1b))
        lines.append("| " + " | ".join(row) + " |")
    fails = [(e, r) for e in entries for r in e["results"] if r["status"] != "ok"]
    if fails:
        lines += ["", "<details><summary>failures</summary>", ""]
        for e, r in fails:
            lines.append(f"- `{e['op_id']}` {r['backend']}: **{r['status']}** — {r['reason']}")
        lines += ["", "</details>"]
    lines.append("")
    return lines


def _h1b_section(doc: dict, h1b: dict) -> list[str]:
    """Local wins of each H1b kernel next to its whole-model gate and ratio."""
    lines = ["## H1b: local kernel vs whole model", "", "| H1b arm | local wins | gate | whole-model ratio @ boundary | verdict |",
             "|---|---:|---|---|---|"]
    att = [e for e in doc["cases"] if e["kind"] == "attention"]
    for local, arg in h1b_arms().items():
        r = h1b.get(arg)
        if r is None:
            continue
        wins = sum(1 for e in att if e["winner"] == local)
        ratio = "—" if r["ratio"] is None else f"×{r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}] @ {r['boundary']}"
        lines.append(f"| {r['candidate']} | {wins}/{len(att)} | {r['gate']} ({r['gate_kind']}) | {ratio} | {r['verdict']} |")
    lines.append("")
    return lines


def render_md(doc: dict) -> str:
    h1b = doc.get("h1b", {})
    lines = [f"# replay: {doc['source']}", "",
             f"- device: {doc['device']} · torch {doc['torch']} · warm-up {doc['warmup']}, repeats {doc['repeats']} "
             f"({'CUDA events' if doc['device_type'] == 'cuda' else 'perf_counter'}), median ms; (n×) = time / best of the row",
             f"- check: FP64 reference, sampled; allclose(atol={ATOL}, rtol={RTOL}) and relative L2 ≤ {REL_L2} "
             "(convert: exact). Failures carry no time, except a backend whose gate is its candidate's on the whole "
             "model (FP8 attention: \"✗ numerics, ms\").", ""]
    if doc.get("compare_dir"):
        lines.append(f"- whole-model H1b results from `{doc['compare_dir']}`: "
                     + (", ".join(f"{k}: gate {v['gate']}, {v['verdict']}" for k, v in sorted(h1b.items())) or "none found"))
        lines.append("")
    for kind in KINDS:
        entries = [e for e in doc["cases"] if e["kind"] == kind]
        if entries:
            lines += _kind_section(kind, entries, h1b)
    if h1b:
        lines += _h1b_section(doc, h1b)
    return "\n".join(lines)


def _ratio_grid(entries: list[dict], names: list[str]) -> tuple[np.ndarray, list[list[str]]]:
    """log2(time / best) per input × backend (NaN where it failed) and the text of each cell."""
    m = np.full((len(entries), len(names)), np.nan)
    text = [["" for _ in names] for _ in entries]
    short = {"unsupported": "n/a", "numerics": "num", "oom": "OOM", "error": "err"}
    for i, e in enumerate(entries):
        for r in e["results"]:
            j = names.index(r["backend"])
            if r["status"] == "ok":
                m[i, j] = math.log2(max(r["ratio"], 1.0))
                text[i][j] = f"{r['ratio']:.2f}"
            else:
                text[i][j] = short.get(r["status"], "✗")
    return m, text


def write_heatmap(doc: dict, kind: str, path: Path) -> Path | None:
    entries = [e for e in doc["cases"] if e["kind"] == kind]
    if not entries:
        return None
    names = list(dict.fromkeys(r["backend"] for e in entries for r in e["results"]))
    m, text = _ratio_grid(entries, names)
    # a Figure of its own, not pyplot: no display and no process-wide backend switch
    fig = Figure(figsize=(2.0 + 0.9 * len(names), 1.5 + 0.32 * len(entries)))
    ax = fig.subplots()
    cmap = matplotlib.colormaps["viridis_r"].with_extremes(bad="#d9d9d9")
    vmax = float(np.nanmax(m)) if np.isfinite(m).any() else 1.0
    im = ax.imshow(np.ma.masked_invalid(m), cmap=cmap, aspect="auto", vmin=0.0, vmax=max(vmax, 1.0))
    for i in range(len(entries)):
        for j in range(len(names)):
            ax.text(j, i, text[i][j], ha="center", va="center", fontsize=7,
                    color="black" if not np.isfinite(m[i, j]) or m[i, j] < 0.6 * max(vmax, 1.0) else "white")
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    ax.set_yticks(range(len(entries)), [e["label"] for e in entries], fontsize=7)
    ax.set_title(f"{kind}: time / fastest backend of the shape ({doc['device']})", fontsize=9)
    fig.colorbar(im, ax=ax, label="log2(time / best)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def build_doc(entries: list[dict], *, source: str, device, warmup: int, repeats: int, compare_dir: str | None = None) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    return {"schema": SCHEMA, "source": source, "device": name, "device_type": device.type, "torch": torch.__version__,
            "warmup": warmup, "repeats": repeats, "tolerances": {"atol": ATOL, "rtol": RTOL, "rel_l2": REL_L2},
            "compare_dir": compare_dir, "h1b": load_h1b(compare_dir), "cases": entries}


def write_outputs(doc: dict, out: str | Path) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "replay.json", "md": out / "replay.md"}
    paths["json"].write_text(json.dumps(doc, indent=1))
    paths["md"].write_text(render_md(doc))
    for kind in KINDS:
        p = write_heatmap(doc, kind, out / f"replay_{kind}.png")
        if p is not None:
            paths[kind] = p
    return paths
