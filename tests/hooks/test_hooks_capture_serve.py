"""``serve --hooks capture=…`` on the tiny preset (2 DiT ranks, 2 VAE ranks, 2 sessions): the
processes share one capture directory — one file per signature across all of them, one budget."""

from __future__ import annotations

from collections import Counter

import pytest

from harness.config import load_preset, override
from harness.drivers.serve_run import ServeOptions, serve
from harness.hooks import parse_hooks
from harness.hooks.capture import read_index

BUDGET = 3 << 20


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve-capture")
    cfg = override(load_preset("tiny"), runtime={"sessions": 2}, video={"chunks_per_session": 2})
    return serve(cfg, ServeOptions(out=str(out), progress=False, hooks=parse_hooks(f"capture={BUDGET >> 20}M")))


def test_serve_capture_shares_one_budget_and_dedupes_across_processes(served):
    run = served.run_dir
    recs = read_index(run)
    assert recs
    assert max(Counter(r["signature"] for r in recs).values()) == 1  # SP ranks and VAE strips dedupe
    saved = [r for r in recs if r["status"] == "saved"]
    files = list((run / "capture").glob("*.safetensors"))
    assert len(files) == len(saved) and sum(p.stat().st_size for p in files) <= BUDGET
    procs = {r["process"] for r in recs}
    assert "vae0" in procs and procs & {"dit0", "dit1"}  # the run's first records come from either DiT rank
    kinds = {r["kind"] for r in recs}
    assert {"attention", "linear", "conv", "convert"} <= kinds
    # SP 2: self-attention runs on all 96 tokens of 2 local heads (after the all-to-all)
    att = [r for r in recs if r["op"] == "self_attention" and r["status"] == "saved"]
    assert att and all(r["tensors"]["q"]["shape"][:2] == [96, 2] for r in att)
    assert all(r["context"].get("chunk") is not None for r in recs)
    cvt = next(r for r in recs if r["op"] == "convert_uint8")
    assert cvt["process"] == "vae0" and cvt["phase"] == "convert"


def test_serve_reports_the_capture_per_process(served):
    import json

    run = served.run_dir
    reports = {p.name: json.loads(p.read_text()) for p in run.glob("hooks.*.json")}
    dit = reports["hooks.dit0.json"]["capture"]
    assert dit["budget"] == BUDGET and dit["errors"] == []
    assert sum(r["capture"]["saved"] for r in reports.values() if "capture" in r) == \
        sum(1 for r in read_index(run) if r["status"] == "saved")
