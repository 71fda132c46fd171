"""Tests of an engine switch between the module's own ops (``"ops"``) and one op (``"kernel"``):
H2d's ``qk_norm_rope`` and H2f's ``ffn_norm``, each a property of ``DitEngine``. What such a
switch must show is the same for every op — eager bytes, the compiled gate, SP ranks, the
candidate's one-line refusal off the GPU — so it is written once here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import candidates as C
from harness.config import load_preset, override
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup, run_ranks
from harness.errors import HarnessError
from harness.experiments.ab_engine import ENGINE_SWITCHES
from harness.measure.gates import latent_metrics, latent_passes
from tests.helpers.ranks import assert_ranks_match
from tests.helpers.sessions import session_bytes


def switched_session(eng: DitEngine, switch: str, how: str, chunks: int) -> list[bytes]:
    """One session's latents with ``eng.<switch> = how`` (the prompt names the switch)."""
    setattr(eng, switch, how)
    return session_bytes(eng, switch, chunks)


def assert_compiled_switch_within_gate(eng: DitEngine, switch: str, chunks: int) -> None:
    """Compiled: the op's latents within the threshold gate of the ops' (the op is eager's
    arithmetic where Inductor fused its own), repeatable, and nothing recompiling after each
    setting's first chunk."""
    try:
        ops, kernel = (switched_session(eng, switch, how, chunks) for how in ("ops", "kernel"))
        for a, b in zip(kernel, ops):
            m = latent_metrics(np.frombuffer(b, np.float32), np.frombuffer(a, np.float32))
            assert not latent_passes(m), m
        assert switched_session(eng, switch, "kernel", chunks) == kernel
        per_chunk = eng.compile_stats()["compiles_per_chunk"]
        for v in range(3):  # each setting's first chunk may trace; nothing after it compiles
            assert per_chunk[v * chunks + 1 : (v + 1) * chunks] == [0] * (chunks - 1), per_chunk
    finally:
        # the blocks' frames compiled with the op stay in Dynamo's per-code cache, where the later
        # compiled tests of this process would count them against their recompile limits
        torch._dynamo.reset()


def _rank(group: RankGroup, cfg, switch: str, chunks: int) -> dict:
    torch.set_num_threads(1)
    eng = DitEngine(override(cfg, parallel={"sp": group.size}), group=group, device=torch.device("cpu"), seed=3)
    return {how: switched_session(eng, switch, how, chunks) for how in ("ops", "kernel")}


def assert_sp_ranks_switch_alike(cfg, sp: int, switch: str, chunks: int) -> None:
    """Under SP each rank's op gives its own ops' bytes, and the ranks one rank's within SP's tolerance."""
    one = run_ranks(_rank, 1, cfg, switch, chunks)[0]
    ranks = run_ranks(_rank, sp, cfg, switch, chunks)
    for r in ranks:
        assert r["kernel"] == r["ops"]
    assert_ranks_match([r["kernel"] for r in ranks], ranks[0]["kernel"], one["kernel"], 1e-4)


def assert_switch_candidate(cid: str, name: str, switch: str, eng: DitEngine) -> None:
    """The candidate sets the switch on CUDA, is refused in one line on the CPU, and the engine
    refuses a setting it does not know, keeping its own."""
    cuda = override(load_preset("tiny"), runtime={"device": "cuda"})
    c = C.get(cid)
    assert c.gate == "threshold" and switch in ENGINE_SWITCHES
    assert getattr(c.configure(cuda, "").runtime, switch) == "kernel"
    with pytest.raises(HarnessError, match=rf"^candidate {cid} \({name}\) needs cuda; this run is on cpu$"):
        C.resolve([cid], load_preset("tiny"))
    with pytest.raises(HarnessError, match=f"{switch} must be ops or kernel"):
        setattr(eng, switch, "triton")
    assert getattr(eng, switch) == "ops"
