"""``harness replay`` on the CPU: every backend that exists here runs each captured input and
passes the FP64 check; those that do not exist, or are broken on purpose, are failures with a
reason and no time; ``--single`` runs one input; H1b whole-model results sit next to the winners."""

from __future__ import annotations

import json

import pytest
import torch

from harness.cli import main as cli_main
from harness.experiments.replay.op_backends import Prepared, attn_views, register_backend, unregister_backend
from harness.experiments.replay.cases import Case, load_cases, synthetic_case, synthetic_cases
from harness.experiments.replay.reference import REL_L2
from harness.experiments.replay.runner import replay_cases

CPU_ATTENTION = ("sdpa", "sdpa-flash", "sdpa-math", "flex", "gather", "paged")
pytestmark = pytest.mark.usefixtures("one_thread", "hooks_reset")


@pytest.fixture(scope="module")
def cases(captured):
    return load_cases(captured["dir"])


def _pick(cases, kind, n=None, op=None):
    out = [c for c in cases if c.kind == kind and (op is None or c.op == op)]
    return out if n is None else out[:n]


def test_attention_backends_that_exist_on_cpu_pass_the_fp64_check(cases):
    att = _pick(cases, "attention")
    assert {c.op for c in att} == {"self_attention", "cross_attention"}
    entries = replay_cases(att, device=torch.device("cpu"), warmup=0, repeats=2, log=None)
    for e in entries:
        by = {r["backend"]: r for r in e["results"]}
        for name in CPU_ATTENTION:
            r = by[name]
            if name in ("gather", "paged") and e["op"] == "cross_attention":
                assert r["status"] == "unsupported" and "block table" in r["reason"]
                continue
            assert r["status"] == "ok", (e["op_id"], name, r)
            assert r["check"]["passed"] and r["check"]["rel_l2"] <= REL_L2
            assert r["median_ms"] > 0 and len(r["times_ms"]) == 2
        for name in ("sdpa-cudnn", "sdpa-efficient"):
            assert by[name]["status"] == "unsupported" and by[name]["median_ms"] is None and by[name]["reason"]
        assert e["winner"] in CPU_ATTENTION


def test_linear_conv_convert_replay_and_check(cases):
    picked = _pick(cases, "linear", 2) + _pick(cases, "conv", 2) + _pick(cases, "convert", 1)
    entries = replay_cases(picked, device=torch.device("cpu"), warmup=0, repeats=1, log=None)
    for e in entries:
        oks = [r for r in e["results"] if r["status"] == "ok"]
        assert oks and e["winner"] in {r["backend"] for r in oks}, e
        assert all(r["check"]["passed"] for r in oks)
    conv = next(e for e in entries if e["kind"] == "conv")
    assert {r["backend"] for r in conv["results"]} == {"aten", "channels-last"}
    cvt = next(e for e in entries if e["kind"] == "convert")
    assert cvt["results"][0]["check"]["mismatches"] == 0


def test_synthetic_weight_when_the_weight_was_not_captured(cases):
    c = _pick(cases, "linear", 1)[0]
    meta = {**c.meta, "weight_saved": False}
    real_load = c.load

    def load(device):
        t = real_load(device)
        t.pop("weight"), t.pop("bias", None)
        return t

    case = Case(**{**c.__dict__, "meta": meta, "load": load})
    (e,) = replay_cases([case], device=torch.device("cpu"), warmup=0, repeats=1, log=None)
    assert e["results"][0]["status"] == "ok"


def test_broken_backends_are_failures_with_a_reason_and_no_time(cases):
    def wrong(case, t, device):
        q = attn_views(case, t)["q"]
        return Prepared(lambda: torch.ones_like(q))

    def raises(case, t, device):
        def boom():
            raise RuntimeError("deliberately broken kernel")
        return Prepared(boom)

    def nan(case, t, device):
        q = attn_views(case, t)["q"]
        return Prepared(lambda: torch.full_like(q, float("nan")))

    register_backend("attention", "fake-wrong", wrong, default=False)
    register_backend("attention", "fake-raise", raises, default=False)
    register_backend("attention", "fake-nan", nan, default=False)
    try:
        att = _pick(cases, "attention", 2)
        entries = replay_cases(att, device=torch.device("cpu"), backends=["sdpa-math", "fake-wrong", "fake-raise", "fake-nan"],
                               warmup=0, repeats=2, log=None)
    finally:
        for n in ("fake-wrong", "fake-raise", "fake-nan"):
            unregister_backend("attention", n)
    for e in entries:
        by = {r["backend"]: r for r in e["results"]}
        assert by["sdpa-math"]["status"] == "ok"
        assert by["fake-wrong"]["status"] == "numerics" and "allclose" in by["fake-wrong"]["reason"]
        assert by["fake-raise"]["status"] == "error" and "deliberately broken" in by["fake-raise"]["reason"]
        assert by["fake-nan"]["status"] == "numerics" and "non-finite" in by["fake-nan"]["reason"]
        for n in ("fake-wrong", "fake-raise", "fake-nan"):
            assert by[n]["median_ms"] is None and "times_ms" not in by[n] and "tflops" not in by[n]
        assert e["winner"] == "sdpa-math"


def test_a_model_gated_backend_failing_the_op_check_is_timed_but_never_the_winner(cases):
    """FP8 attention fails the op check on random inputs by design (its gate is the candidate's, on
    the whole model): its row keeps the failure and a time, so the replay shows what it buys."""
    from harness.experiments.replay.outputs import _cell

    def rough(case, t, device):
        a = attn_views(case, t)
        return Prepared(lambda: torch.nn.functional.scaled_dot_product_attention(a["q"], a["k"], a["v"]) * 1.2)

    register_backend("attention", "fake-gated", rough, default=False, model_gated=True)
    try:
        entries = replay_cases(_pick(cases, "attention", 1), device=torch.device("cpu"),
                               backends=["sdpa-math", "fake-gated"], warmup=0, repeats=2, log=None)
    finally:
        unregister_backend("attention", "fake-gated")
    for e in entries:
        r = {r["backend"]: r for r in e["results"]}["fake-gated"]
        assert r["status"] == "numerics" and r["median_ms"] > 0 and r["repeats"] == 2
        assert e["winner"] == "sdpa-math" and "ratio" not in r
        assert _cell(r).startswith("✗ numerics, ")


def test_cli_writes_json_md_and_heatmaps_with_h1b_next_to_the_winner(captured, tmp_path):
    cmp_dir = tmp_path / "cmp"
    cmp_dir.mkdir()
    (cmp_dir / "compare.json").write_text(json.dumps({
        "candidate": ["H1b:flash"], "reference": "cpu_ready", "verdict": "faster", "reason": "r",
        "gate": {"kind": "threshold", "status": "pass", "verdict": "ok"},
        "rows": [{"metric": "steady interval", "boundary": "cpu_ready", "baseline_ms": 10.0, "candidate_ms": 9.0,
                  "ab": {"value": 0.9, "low": 0.88, "high": 0.92, "n_sessions": 4, "n_samples": 16}}],
    }))
    out = tmp_path / "rep"
    rc = cli_main(["replay", str(captured["dir"]), "--ops", "attention", "--backends", "sdpa-flash,sdpa-cudnn",
                   "--repeats", "2", "--warmup", "0", "--limit", "3", "--compare", str(cmp_dir), "--out", str(out),
                   "--device", "cpu"])
    assert rc == 0
    doc = json.loads((out / "replay.json").read_text())
    assert len(doc["cases"]) == 3 and doc["h1b"]["flash"]["ratio"] == 0.9
    assert all(e["winner"] == "sdpa-flash" for e in doc["cases"])
    md = (out / "replay.md").read_text()
    assert "H1b:flash gate pass, ×0.900" in md and "| H1b:flash | 3/3 |" in md
    assert (out / "replay_attention.png").stat().st_size > 1000


def test_single_runs_one_op_and_lists_its_aten_ops(captured, cases, capsys):
    op = _pick(cases, "attention", op="self_attention")[-1].op_id
    assert cli_main(["replay", str(captured["dir"]), "--single", op, "--backend", "paged", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert op in text and "aten::index_select" in text and "aten::_scaled_dot_product_flash_attention_for_cpu" in text
    assert "aten::as_strided" not in text  # views are left out
    assert cli_main(["replay", str(captured["dir"]), "--single", "nope", "--device", "cpu"]) == 2


def test_synthetic_production_shapes_without_allocating():
    cases = synthetic_cases("lingbot-480x832")
    self_ = [c for c in cases if c.op == "self_attention"]
    assert len(self_) == 2 * 2 * 3  # SP × phase × K length
    sp2 = next(c for c in self_ if c.meta["sp"] == 2 and c.shapes["k"][0] == 28080)
    assert sp2.shapes["q"] == [4680, 20, 128] and sp2.dtype == "bfloat16"
    assert sp2.shapes["block_ids"] == [28080 // 8] and sp2.meta["group_blocks"] == 195 * 6
    assert sp2.flops() == 4 * 4680 * 28080 * 20 * 128
    cross = next(c for c in cases if c.op == "cross_attention" and c.meta["sp"] == 1)
    assert cross.shapes["k"] == [1, 40, 512, 128]


def test_synthetic_tiny_replays_on_cpu(tmp_path):
    rc = cli_main(["replay", "--synthetic", "tiny", "--kv", "96,288", "--sp", "2", "--backends", "sdpa-math,paged",
                   "--repeats", "1", "--warmup", "0", "--out", str(tmp_path), "--device", "cpu"])
    assert rc == 0
    doc = json.loads((tmp_path / "replay.json").read_text())
    self_ = [e for e in doc["cases"] if e["op"] == "self_attention"]
    assert len(self_) == 4 and all(r["status"] == "ok" for e in self_ for r in e["results"])


def test_bf16_inputs_pass_the_threshold_check_on_cpu():
    meta = {"layout": {"q": "shd", "k": "shd", "v": "shd"}, "block_size": 32, "group_blocks": 6, "sp": 1}
    case = synthetic_case("bf16-self", "self_attention", "denoise", meta,
                          {"q": [96, 4, 64], "k": [288, 4, 64], "v": [288, 4, 64], "block_ids": [9]}, "bfloat16", 3)
    (e,) = replay_cases([case], device=torch.device("cpu"), backends=["sdpa-flash", "sdpa-math", "paged", "flex"],
                        warmup=0, repeats=1, log=None)
    assert all(r["status"] == "ok" for r in e["results"]), e["results"]
    assert max(r["check"]["rel_l2"] for r in e["results"]) < REL_L2
