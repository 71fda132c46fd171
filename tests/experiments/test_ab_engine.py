"""``ab-engine``: a DiT-engine candidate A/B'd inside one engine per launch (tiny preset, CPU/gloo),
gate first, then the paired launch-level ratio; one launch is no verdict; pipeline candidates are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness.cli import main
from harness.experiments import ab_engine as E


def test_h2a_over_two_sp_ranks_passes_its_exact_gate(tmp_path):
    out = tmp_path / "ab.json"
    assert main(["ab-engine", "--candidate", "H2a", "--sp", "2", "--pairs", "2", "--chunks", "7", "--launches", "2",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["order"] == "A B B A" and res["sp"] == 2 and res["launches"] == 2
    assert res["gate"] == {"kind": "exact", "passed": True, "compared": 28, "failed": []}
    assert [len(s) for launch in res["chunk_ms"] for s in launch["A"] + launch["B"]] == [7] * 8
    r = res["ratio"]
    assert r["level"] == "launch" and r["paired"] and (r["n_a"], r["n_b"]) == (2, 2) and r["df"] == 1
    if r["low"] is None:  # two launches far apart on a loaded box (t = 12.7 at 1 df): too wide to state
        assert r["high"] is None and res["verdict"] == "no verdict" and res["reason"].startswith("interval wider than")
    else:
        # an MDE beyond ×10 at 1 df is no figure (None), not a number
        assert r["low"] <= r["value"] <= r["high"] and (res["mde"] is None or res["mde"] > 0)
        assert res["verdict"] in ("faster", "slower", "equivalent", "no resolvable difference")


def test_h1a_switches_the_kv_path_and_passes_the_threshold_gate(tmp_path):
    out = tmp_path / "ab.json"
    assert main(["ab-engine", "--candidate", "H1a", "--sp", "1", "--pairs", "1", "--chunks", "7", "--launches", "1",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    g = res["gate"]
    assert g["kind"] == "threshold" and g["passed"] and g["compared"] == 7
    assert g["worst_rel_l2"] < 1e-4  # the paged path reads the same K/V, summed in another order
    assert res["verdict"] == "no verdict" and res["reason"].startswith("one launch") and res["ratio"] is None


def test_a_vae_candidate_is_judged_on_decode_sessions_over_two_vae_ranks(tmp_path):
    """H3b:fp16 on 2 width-sharded VAE ranks: the pixel gate over every chunk pair (fp16 is within
    it at the tiny preset) with PSNR and max|Δ|, then the launch-level judgement of decode times."""
    out = tmp_path / "ab.json"
    assert main(["ab-engine", "--candidate", "H3b:fp16", "--set", "parallel.vae_ranks=2", "--pairs", "1",
                 "--chunks", "2", "--launches", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    g = res["gate"]
    assert res["stage"] == "vae" and res["sp"] == 2 and res["steady_from_chunk"] == 1 and res["launches"] == 2
    assert g["kind"] == "threshold" and g["passed"] and g["compared"] == 4 and g["failed"] == []
    assert 0 < g["worst_rmse"] <= 0.01 and g["min_psnr_db"] >= 46 and 0 < g["worst_max_abs"] <= 0.03
    assert [len(s) for launch in res["chunk_ms"] for s in launch["A"] + launch["B"]] == [2] * 4
    assert res["ratio"]["level"] == "launch" and res["verdict"]


def test_a_vae_candidate_that_fails_the_pixel_gate_gets_no_verdict(tmp_path):
    """H3b:bf16 at the tiny preset: PSNR above 46 dB but max|Δ| over 0.03 — the gate fails, the
    command exits 1 and says so, and no timing verdict is given."""
    out = tmp_path / "ab.json"
    assert main(["ab-engine", "--candidate", "H3b", "--pairs", "1", "--chunks", "2", "--launches", "1",
                 "--json", str(out)]) == 1
    res = json.loads(out.read_text())
    g = res["gate"]
    assert not g["passed"] and g["failed"] and g["worst_max_abs"] > 0.03 and g["min_psnr_db"] >= 46
    assert res["verdict"] == "no verdict" and "pixel gate failed" in res["reason"] and "ratio" not in res


@pytest.mark.parametrize("argv, why", [
    (["--candidate", "H5a"], "changes runtime.scheduler, not just the DiT engine: use compare"),
    (["--candidate", "H3b", "--candidate", "H2a"], "changes the VAE: use compare"),
    (["--candidate", "H3b", "--chunks", "1"], "needs more than 1 chunk"),
    (["--candidate", "H2a", "--chunks", "5"], "need more than 5 chunks"),
    (["--candidate", "H2a", "--pairs", "0"], "--pairs, --launches and --chunks must be"),
    (["--candidate", "H2a", "--launches", "0"], "--pairs, --launches and --chunks must be"),
    ([], "needs --candidate"),
    (["--candidate", "H1a", "--set", "runtime.kv_path=paged"], "changes nothing in this config"),
])
def test_refusals_are_one_line_and_run_nothing(argv, why, capsys):
    assert main(["ab-engine", "--sp", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err


def test_gate_and_judgement():
    same = [[b"\x00" * 8, b"\x01" * 8]]
    assert E.gate_pairs("exact", same, same, (2,))["passed"]
    g = E.gate_pairs("exact", same, [[b"\x00" * 8, b"\x02" * 8]], (2,))
    assert not g["passed"] and g["failed"] == ["pair 0 chunk 1"]
    a = np.float32([1, 2]).tobytes()
    assert not E.gate_pairs("threshold", [[a]], [[np.float32([1, 2.5]).tobytes()]], (2,))["passed"]
    assert E.arm_order(3) == ["A", "B", "B", "A", "A", "B"]
    rng = np.random.default_rng(0)
    launch = lambda mu, shift: {"A": [list(100 * shift + rng.normal(0, 0.5, 8)) for _ in range(2)],  # noqa: E731
                                "B": [list(mu * shift + rng.normal(0, 0.5, 8)) for _ in range(2)]}
    # each launch shifts both arms alike (±10 %): paired over launches that cancels, and 3 % shows
    fast = [launch(97, s) for s in (1.0, 1.1, 0.9)]
    j = E.judge(fast, steady=5, gate_passed=True)
    assert j["verdict"] == "faster" and j["ratio"]["high"] < 1 and j["ratio"]["paired"] and j["launches"] == 3
    assert E.judge([launch(100, s) for s in (1.0, 1.1, 0.9)], steady=5, gate_passed=True)["verdict"] != "faster"
    one = E.judge(fast[:1], steady=5, gate_passed=True)
    w = one["within_launch"]
    assert one["verdict"] == "no verdict" and one["ratio"] is None and w["low"] <= w["value"] <= w["high"] and w["value"] < 1
