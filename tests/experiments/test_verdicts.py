"""``verdicts``: compare and ab-engine results side by side, reported exactly as judged."""

from __future__ import annotations

import json

import pytest

from harness.cli import main
from harness.errors import HarnessError
from harness.experiments import verdicts as V

AB = {"candidate": ["H2a"], "preset": "tiny", "mode": "compiled", "sp": 2, "layers": 40, "pairs": 4, "chunks": 7,
      "order": "A B B A A B B A", "steady_from_chunk": 5,
      "gate": {"kind": "exact", "passed": True, "compared": 28, "failed": []},
      "baseline_ms": 2319.0, "candidate_ms": 2079.6, "ratio": {"value": 0.8967, "low": 0.894, "high": 0.8984},
      "noise_floor": 0.0035, "verdict": "faster", "reason": "below the band"}


def _compare(gate_status="pass", verdict="slower"):
    row = lambda b, v: {"metric": f"steady interval P50 @ {b}", "boundary": b, "baseline_ms": 1000.0,  # noqa: E731
                        "candidate_ms": 1000.0 * v, "ab": {"value": v, "low": v - 0.01, "high": v + 0.01},
                        "noise_floor": 0.004, "verdict": verdict}
    return {"candidate": ["H4a", "H4b"], "reference": "cpu_ready", "rounds_run": 2, "verdict": verdict,
            "protocol": {"sessions": 3, "warmup_sessions": 1},
            "gate": {"kind": "exact", "status": gate_status, "n_compared": 70},
            "rows": [row("encoded", 0.5), row("cpu_ready", 1.07), {"metric": "TTFC P50 @ delivered", "boundary": "delivered"}],
            "setting": {"mode": "deterministic", "layers": 10, "sp": 1,
                        "placement": {"dit rank 0": "cuda:0", "vae rank 0": "cuda:1", "encoder": "cpu"}}}


def test_a_compare_verdict_is_its_reference_row_as_judged():
    v = V.from_compare(_compare(), "c.json")
    assert (v.candidate, v.method, v.statistic) == ("H4a+H4b", "compare", "steady interval P50 @ cpu_ready")
    assert v.ratio == pytest.approx(1.07) and (v.low, v.high) == pytest.approx((1.06, 1.08)) and v.noise_floor == 0.004
    assert v.verdict == "slower" and v.gate == "exact pass (70 compared)" and v.gate_passed
    assert v.setting == "deterministic, 10 layers, SP=1, VAE on its own GPU, 2 rounds × 2 measured sessions per launch"
    assert not V.from_compare(_compare("fail", "no verdict"), "c.json").gate_passed


#: ab-engine with launches (schema 2): a paired launch-level interval
AB3 = {**{k: v for k, v in AB.items() if k != "noise_floor"}, "launches": 3, "noise_floor": None, "mde": 0.0123,
       "ratio": {"value": 0.8967, "low": 0.89, "high": 0.9, "level": "launch", "paired": True, "n_a": 3, "n_b": 3}}


def test_an_ab_engine_verdict_keeps_its_gate_and_setting():
    v = V.from_ab_engine(AB3, "ab.json")
    assert (v.candidate, v.method, v.verdict, v.launches) == ("H2a", "ab-engine", "faster", 3)
    assert v.gate == "exact pass (28 chunks)" and v.ratio == 0.8967 and v.baseline_ms == 2319.0
    assert v.setting == "compiled, 40 layers, SP=2, 3 launch(es) × 4 pairs × 7 chunks"
    line = V.table([v]).splitlines()[2]
    # rounded to the interval's width (0.01 wide: three decimals), the ms columns to match
    assert "| 2319 ms | 2080 ms | 0.897 | [0.890, 0.900] (launch-level t) | 3 | — | 1.2 % | **faster** |" in line


def test_one_launch_is_no_verdict_whatever_was_recorded():
    # an ab-engine JSON from before --launches: one process, so one launch
    v = V.from_ab_engine(AB, "ab.json")
    assert v.launches == 1 and v.verdict == "no verdict: one launch (recorded: faster)"
    assert "| 0.8967 | [0.8940, 0.8984] (session bootstrap) | 1 | ±0.0035 | — | **no verdict: one launch" in V.table([v])
    one_round = {**_compare(), "rounds_run": 1}
    assert V.from_compare(one_round, "c.json").verdict == "no verdict: one launch (recorded: slower)"
    assert V.from_compare(_compare(), "c.json").interval == "session bootstrap"  # schema 1: launch variance missing


def test_vae_placement():
    assert V.vae_placement({"dit rank 0": "cuda:0", "dit rank 1": "cuda:1", "vae rank 0": "cuda:1"}) == "VAE shares the DiT's GPU"
    assert V.vae_placement({"dit rank 0": "cuda:0", "vae rank 0": "cuda:1"}) == "VAE on its own GPU"
    assert V.vae_placement({"dit rank 0": "cpu", "vae rank 0": "cpu"}) == "" and V.vae_placement(None) == ""


def test_bad_results_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "ab.json").write_text(json.dumps(AB))
    (tmp_path / "bench.json").write_text(json.dumps({"preset": "tiny", "dit_mfu": 0.7}))
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "short.json").write_text(json.dumps({k: v for k, v in AB.items() if k != "verdict"}))
    for name, msg in (("missing", "no such file"), ("bench.json", "neither a compare result"),
                      ("broken.json", "not readable JSON"), ("short.json", "incomplete result")):
        with pytest.raises(HarnessError, match=msg):
            V.load(tmp_path / name)
        assert main(["verdicts", str(tmp_path / "ab.json"), str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1
    out = tmp_path / "v.json"
    assert main(["verdicts", str(tmp_path / "ab.json"), "--json", str(out)]) == 0
    assert json.loads(out.read_text())[0]["verdict"] == "no verdict: one launch (recorded: faster)"
    assert main(["verdicts", str(tmp_path / "ab.json"), "--json", str(tmp_path / "no" / "such" / "v.json")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_an_old_compare_takes_its_setting_from_round0_and_refuses_a_broken_one(tmp_path):
    old = {k: v for k, v in _compare().items() if k != "setting"}
    (tmp_path / "compare.json").write_text(json.dumps(old))
    assert V.load(tmp_path).setting == "2 rounds × 2 measured sessions per launch"
    (tmp_path / "round0-A").mkdir()
    manifest = {"preset": "x", "mode": "eager", "placement": {"dit rank 0": "cuda:0", "vae rank 0": "cuda:0"},
                "config": {"model": {"num_layers": 4}, "parallel": {"sp": 2}}}
    (tmp_path / "round0-A" / "manifest.json").write_text(json.dumps(manifest))
    assert V.load(tmp_path).setting.startswith("eager, 4 layers, SP=2, VAE shares the DiT's GPU")
    for broken in ("{truncated", "[1, 2]"):
        (tmp_path / "round0-A" / "manifest.json").write_text(broken)
        with pytest.raises(HarnessError, match="not readable JSON|incomplete result"):
            V.load(tmp_path)


def test_a_failed_gate_shows_no_figures_it_does_not_have():
    failed = {**{k: v for k, v in AB.items() if k not in ("ratio", "baseline_ms", "candidate_ms", "noise_floor")},
              "gate": {"kind": "exact", "passed": False, "compared": 28, "failed": ["pair 0 chunk 0"]},
              "verdict": "no verdict"}
    v = V.from_ab_engine(failed, "ab.json")
    assert not v.gate_passed and v.ratio is None and v.verdict == "no verdict"
    assert "| — | — | — | 1 | — | — | **no verdict** |" in V.table([v])
