"""Whole-model results of candidate H1b, read from ``compare.json`` files, to set next to the
local winners: does the kernel that wins one call also win the model (``--compare DIR``)?"""

from __future__ import annotations

import json
from pathlib import Path

from harness.errors import HarnessError
from harness.experiments.replay.op_backends import h1b_arms
from harness.limits import MAX_JSON_BYTES, read_bounded


def _h1b_row(spec: str, path: Path, data: dict) -> dict:
    gate = data.get("gate", {})
    ref = data.get("reference", "cpu_ready")
    row = next((r for r in data.get("rows", []) if r.get("boundary") == ref and str(r.get("metric", "")).startswith("steady")), None)
    ab = (row or {}).get("ab") or {}
    return {"candidate": spec, "file": str(path), "gate": gate.get("status"), "gate_kind": gate.get("kind"),
            "verdict": data.get("verdict"), "reason": data.get("reason"), "boundary": ref,
            # an interval too wide to state has no ends (stats.WIDEST_FACTOR): shown as its verdict alone
            "ratio": ab.get("value") if ab.get("low") is not None else None, "low": ab.get("low"), "high": ab.get("high"),
            "baseline_ms": (row or {}).get("baseline_ms"), "candidate_ms": (row or {}).get("candidate_ms")}


def load_h1b(compare_dir: str | Path | None) -> dict[str, dict]:
    """H1b argument → whole-model result, from every ``compare.json`` under ``compare_dir``
    whose candidate is H1b (the newest file wins when one argument appears twice)."""
    if not compare_dir:
        return {}
    root = Path(compare_dir)
    files = [root] if root.is_file() else sorted(root.rglob("compare.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise HarnessError(f"--compare {compare_dir}: no compare.json found")
    out: dict[str, dict] = {}
    for path in files:
        try:
            data = json.loads(read_bounded(path, MAX_JSON_BYTES, "compare.json"))
        except (OSError, ValueError):
            continue
        for spec in data.get("candidate", []):
            cid, _, arg = str(spec).partition(":")
            if cid.upper() != "H1B":
                continue
            out[arg or "cudnn"] = _h1b_row(spec, path, data)
    return out


def h1b_text(backend: str | None, h1b: dict[str, dict]) -> str:
    """What the whole model said about the H1b arm of a local winner, in one cell."""
    if backend is None:
        return "—"
    arg = h1b_arms().get(backend)
    if backend == "sdpa":
        return "the baseline (engine default)"
    if arg is None:
        return f"no H1b arm for {backend}"
    r = h1b.get(arg)
    if r is None:
        return f"H1b:{arg} not compared"
    if r["gate"] == "fail":
        return f"H1b:{arg} gate FAIL"
    if r["ratio"] is None:
        return f"H1b:{arg} gate {r['gate']}, {r['verdict']}"
    return f"H1b:{arg} gate {r['gate']}, ×{r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}] {r['verdict']}"
