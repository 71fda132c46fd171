"""ab_arms: the arm syntax and its refusals, the rotated order, and one tiny CPU run where an
exact-gate arm (H2a) is byte-identical to the shared baseline and judged by ab-engine's rules."""

import pytest

from harness.config import load_preset
from harness.errors import HarnessError
from harness.experiments import ab_arms


def test_parse_arms_and_refusals():
    assert ab_arms.parse_arms(["fa3=H1b:fa3", "both=H6a+H1b:fa3"]) == {"fa3": ["H1b:fa3"], "both": ["H6a", "H1b:fa3"]}
    for bad in (["H6a"], ["=H6a"], ["x="], ["A=H6a"], ["x=H6a", "x=H1a"], []):
        with pytest.raises(HarnessError):
            ab_arms.parse_arms(bad)


def test_round_order_rotates_every_arm_through_every_slot():
    names = ["A", "x", "y"]
    orders = [ab_arms.round_order(names, r) for r in range(3)]
    assert orders == [["A", "x", "y"], ["x", "y", "A"], ["y", "A", "x"]]


def test_arm_that_changes_the_vae_or_nothing_is_refused_before_building():
    cfg = load_preset("tiny")
    with pytest.raises(HarnessError, match="use compare"):
        ab_arms.run(cfg, {"v": ["H3a"]}, rounds=1, chunks=6)
    with pytest.raises(HarnessError, match="more than 5 chunks"):
        ab_arms.run(cfg, {"c": ["H2a"]}, rounds=1, chunks=5)


def test_tiny_run_exact_arm_passes_against_shared_baseline():
    out = ab_arms.run(load_preset("tiny"), {"cam": ["H2a"]}, rounds=1, chunks=6)
    arm = out["arms"]["cam"]
    assert arm["gate"] == {"kind": "exact", "passed": True, "compared": 6, "failed": []}
    assert out["order"] == "A cam" and len(out["chunk_ms"]["A"][0]) == 6
    assert arm["verdict"]  # judged (one session per arm: no A/A floor, so no faster/slower claim)
    assert arm["verdict"] not in ("faster", "slower")
