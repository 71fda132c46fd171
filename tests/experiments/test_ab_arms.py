"""``ab-arms``: the arm syntax and its refusals (one line, exit 2, nothing built), the rotated
order, the engine state an arm sets and puts back (also when its session fails), and one tiny
CPU run through the command where an exact-gate arm (H2a) is byte-identical to the shared
baseline and judged by ab-engine's rules."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from harness.cli import main
from harness.config import load_preset
from harness.errors import HarnessError
from harness.experiments import ab_arms
from harness.experiments.ab_engine import ArmPlan, EngineArm


def test_parse_arms_and_refusals():
    assert ab_arms.parse_arms(["fa3=H1b:fa3", "both=H6a+H1b:fa3"]) == {"fa3": ["H1b:fa3"], "both": ["H6a", "H1b:fa3"]}
    # a '+' inside an argument (H6a's layer sets ffn+o, ffn+attn-smooth) does not start a candidate
    assert ab_arms.parse_arms(["o=H6a:ffn+o+H1b:fa3", "s=H1c+H6a:ffn+attn-smooth"]) == {
        "o": ["H6a:ffn+o", "H1b:fa3"], "s": ["H1c", "H6a:ffn+attn-smooth"]}
    # an unknown id after a '+' stays a candidate of its own (refused by name later), empty pieces go
    assert ab_arms.parse_arms(["u=H6a:ffn+H9z++H1c"]) == {"u": ["H6a:ffn", "H9z", "H1c"]}
    for bad in (["H6a"], ["=H6a"], ["x="], ["A=H6a"], ["x=H6a", "x=H1a"], []):
        with pytest.raises(HarnessError):
            ab_arms.parse_arms(bad)


def test_round_order_rotates_every_arm_through_every_slot():
    names = ["A", "x", "y"]
    orders = [ab_arms.round_order(names, r) for r in range(3)]
    assert orders == [["A", "x", "y"], ["x", "y", "A"], ["y", "A", "x"]]


@pytest.mark.parametrize("argv, why", [
    ([], "give at least one --arm"),
    (["--arm", "v=H3a"], "changes the VAE: use compare"),
    (["--arm", "c=H2a", "--chunks", "5"], "more than 5 chunks"),
    (["--arm", "c=H2a", "--rounds", "0"], "--rounds and --chunks must be"),
    (["--arm", "f=H1b:fa3"], "needs cuda"),
    (["--arm", "f=H6a"], "needs cuda"),
    (["--arm", "c=H2a", "--set", "parallel.sp=2"], "use ab-engine --sp N"),
    (["--arm", "c=H2a", "--json", "no-such-folder/x.json"], "its folder does not exist"),
    (["--arm", "c=H2a", "--launches", "0"], "--launches must be ≥ 1"),
    (["--arm", "c=H2a", "--peak-tflops", "0"], "--peak-tflops must be positive"),
    (["--arm", "c=H2a", "--set", "runtime.attention=fa3"], "runtime.attention=fa3: FlashAttention-3"),
    (["--arm", "c=H2a", "--versus", "c/best"], "no arm named 'best'"),
    (["--arm", "c=H2a", "--versus", "c/c"], "two different arm names"),
    (["--arm", "c=H2a", "--versus", "c"], "expected ARM/ARM"),
])
def test_refusals_are_one_line_and_build_nothing(argv, why, capsys, monkeypatch):
    def no_engine(*a, **k):
        raise AssertionError("the engine was built before the refusal")

    monkeypatch.setattr(ab_arms, "dit_engine_for", no_engine)
    assert main(["ab-arms", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert why in err and len(err.strip().splitlines()) == 1, err


def test_engine_arm_sets_switches_and_puts_them_back_even_on_failure():
    eng = SimpleNamespace(attention="sdpa", kv_path="gather")
    arm = EngineArm(eng, ArmPlan(chosen=(), switches={"attention": "math", "kv_path": "paged"}, gate="exact"))
    with arm:
        assert (eng.attention, eng.kv_path) == ("math", "paged")
    assert (eng.attention, eng.kv_path) == ("sdpa", "gather")
    with pytest.raises(RuntimeError), arm:
        raise RuntimeError("a session failed")
    assert (eng.attention, eng.kv_path) == ("sdpa", "gather")


def test_tiny_run_exact_arm_passes_against_shared_baseline(tmp_path, capsys):
    out = tmp_path / "arms.json"
    assert main(["ab-arms", "--device", "cpu", "--arm", "cam=H2a", "--rounds", "1", "--chunks", "6", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    arm = res["arms"]["cam"]
    assert arm["gate"] == {"kind": "exact", "passed": True, "compared": 6, "failed": []}
    assert res["order"] == "A cam" and res["sp"] == 1 and [len(s) for s in res["chunk_ms"]["A"]] == [6]
    # an ab-arms run is one launch: launch-to-launch variance is unknown, so no faster/slower claim
    assert arm["verdict"] == "no verdict" and "one launch" in arm["reason"]
    assert set(res["rates"]) == {"A", "cam"} and res["rates"]["A"]["mfu_bf16"] is None  # no peak on the CPU
    assert "cam (H2a): gate exact pass" in capsys.readouterr().out


def test_launches_give_each_arm_a_verdict_over_fresh_processes(tmp_path, capsys):
    out = tmp_path / "arms.json"
    argv = ["ab-arms", "--device", "cpu", "--arm", "cam=H2a", "--arm", "cam2=H2a", "--rounds", "1", "--chunks", "6",
            "--launches", "2", "--versus", "cam2/cam"]
    assert main([*argv, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    arm = res["arms"]["cam"]
    assert res["launches"] == 2 and len(res["chunk_ms_by_launch"]) == 2
    assert [len(s) for s in res["chunk_ms"]["cam"]] == [6, 6]  # one session per round per launch
    # the gate covers every chunk of both launches, and the interval is taken over the launches
    assert arm["gate"]["compared"] == 12 and arm["gate"]["passed"]
    assert arm["launches"] == 2 and arm["ratio"] is not None and "one launch" not in arm["reason"]
    # one arm against another: the same launch-level judgement, its columns the two arms' own medians
    v = res["versus"]["cam2/cam"]
    assert v["launches"] == 2 and v["ratio"] is not None
    assert v["baseline_ms"] == arm["candidate_ms"] and v["candidate_ms"] == res["arms"]["cam2"]["candidate_ms"]
    printed = capsys.readouterr().out
    assert "2 launches × 1 rounds" in printed and "cam2/cam: " in printed


def test_versus_gives_no_verdict_when_either_arm_failed_its_gate():
    runs = [{"times": {"A": [[10.0] * 6], "x": [[9.0] * 6], "y": [[8.0] * 6]}}] * 2
    arms = {"x": {"gate": {"passed": True}}, "y": {"gate": {"passed": False}}}
    v = ab_arms.judge_versus(runs, "y", "x", 3, arms)
    assert v["verdict"] == "no verdict" and "y failed its gate" in v["reason"]
    assert ab_arms.judge_versus(runs, "x", "A", 3, arms)["candidate_ms"] == pytest.approx(9.0)


def test_a_launch_that_fails_leaves_the_launches_before_it_on_disk_judged(tmp_path, monkeypatch):
    """A GPU step stopped in launch 3 (a step limit, a crash) once kept only launches 1 and 2's raw
    times: each finished launch is now on disk, every arm gated and judged over the launches so far,
    before the next one starts."""
    out, calls = tmp_path / "arms.json", []
    lat = [bytes([c]) * 4 for c in range(6)]  # the exact gate compares the latents' bytes

    def launch(k: int) -> dict:
        return {"times": {"A": [[10.0 + 0.1 * k] * 6], "cam": [[9.0 + 0.1 * k] * 6]},
                "latents": {"A": [lat], "cam": [lat]}}

    def fake_run_ranks(fn, n, *a, **kw):  # launches 1 and 2 measured, launch 3 dies
        calls.append(n)
        if len(calls) == 3:
            raise RuntimeError("launch 3 died")
        return [launch(len(calls))]

    monkeypatch.setattr(ab_arms, "run_ranks", fake_run_ranks)
    argv = ["ab-arms", "--device", "cpu", "--arm", "cam=H2a", "--rounds", "1", "--chunks", "6", "--launches", "3",
            "--versus", "cam/A"]
    with pytest.raises(RuntimeError, match="launch 3 died"):
        main([*argv, "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["complete"] is False and res["launches_done"] == 2 and res["launches"] == 3
    assert res["chunk_ms_by_launch"] == [launch(1)["times"], launch(2)["times"]]
    arm = res["arms"]["cam"]
    assert arm["candidates"] == ["H2a"] and arm["gate"]["passed"] and arm["gate"]["compared"] == 12
    # judged over the two launches on disk: a launch-level interval, B/A below 1 in both launches
    assert arm["launches"] == 2 and arm["ratio"] is not None and arm["ratio"]["value"] < 1
    assert res["versus"]["cam/A"]["launches"] == 2
    assert not (tmp_path / "arms.json.tmp").exists()


def test_a_given_peak_is_the_share_of_peaks_denominator_and_is_named(capsys):
    """Two runs on one card compare shares only against one peak: a given one is used and said to be given."""
    out = {"steady_from_chunk": 1, "chunk_ms": {"A": [[30.0, 20.0, 20.0]]}}
    ab_arms.add_rates(out, load_preset("tiny"), torch.device("cpu"), 500.0)
    assert out["peak_source"] == "given" and out["peak_bf16_tflops"] == 500.0
    r = out["rates"]["A"]
    assert r["steady_ms"] == 20.0 and r["mfu_bf16"] == pytest.approx(r["tflops_bf16_equiv"] / 500.0)
    none = {"steady_from_chunk": 1, "chunk_ms": {"A": [[30.0, 20.0, 20.0]]}}
    ab_arms.add_rates(none, load_preset("tiny"), torch.device("cpu"))
    assert none["peak_source"] is None and none["rates"]["A"]["mfu_bf16"] is None  # no peak measured off the GPU
