"""H1a/H1b pick the attention kernels through one typed seam: the DiT model holds a frozen
``AttentionChoice`` (KV path + dense kernel, checked against the engine's registries when made)
that is installed whole, instead of reading two loose strings at each forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness import candidates
from harness.config import load_preset, override
from harness.engine.attention import DENSE, KV_PATHS, AttentionChoice
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup
from harness.errors import HarnessError


def _engine(specs: list[str]) -> DitEngine:
    cfg = candidates.configure(specs, override(load_preset("tiny"), parallel={"sp": 1}))
    return DitEngine(cfg, group=RankGroup.single(), device=torch.device("cpu"), seed=0)


def test_h1a_and_h1b_arrive_as_one_typed_choice_on_the_model():
    eng = _engine(["H1a", "H1b:math"])
    assert eng.model.attention_choice == AttentionChoice(kv_path="paged", dense="math")
    assert not hasattr(eng.model, "kv_path") and not hasattr(eng.model, "attention")
    assert _engine([]).model.attention_choice == AttentionChoice()


def test_a_choice_is_frozen_and_refuses_unknown_names_when_made():
    c = AttentionChoice()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.dense = "math"  # type: ignore[misc]
    with pytest.raises(HarnessError, match="unknown KV path"):
        AttentionChoice(kv_path="nope")
    with pytest.raises(HarnessError, match="unknown attention backend"):
        AttentionChoice(dense="nope")


def test_kernels_are_looked_up_in_the_registries_at_each_call():
    # a hook's wrapper put into a table must be what the next forward runs
    c = AttentionChoice(kv_path="paged", dense="math")
    kv, dense = c.kernels()
    assert kv is KV_PATHS["paged"] and dense is DENSE["math"]
    original = DENSE["math"]
    DENSE["math"] = wrapped = lambda q, k, v: original(q, k, v)
    try:
        assert c.kernels()[1] is wrapped
    finally:
        DENSE["math"] = original
