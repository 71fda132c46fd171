"""H2c on CPU: a block's last residual add carried into the next block (``runtime.ffn_residual``).

Same ops in the same order: in eager the latents are the bytes of the blocks adding their own FFN
output, through window saturation and eviction, under a hook's per-layer phases, and under SP with
2 and 4 ranks (each rank's own bytes, within SP's tolerance of one rank); compiled, where the
carried add is part of the next block's norm kernel, within the threshold gate, and nothing
recompiles after a setting's first chunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import candidates as C
from harness.config import load_preset, override
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup, run_ranks
from harness.experiments.ab_engine import ENGINE_SWITCHES
from harness.hooks import context as hctx
from harness.measure.gates import latent_metrics, latent_passes
from tests.helpers.ranks import assert_ranks_match
from tests.helpers.sessions import session_bytes

CACHE = {"sink_frames": 3, "window_frames": 9}
CHUNKS = 5


def _cfg(sp: int = 1, mode: str = "eager", dtype: str = "float32"):
    return override(load_preset("tiny"), parallel={"sp": sp}, cache=CACHE, runtime={"mode": mode, "dtype": dtype})


def _session(eng: DitEngine, where: str) -> list[bytes]:
    eng.ffn_residual = where
    return session_bytes(eng, "h2c", CHUNKS)


def _same(a: list[bytes], b: list[bytes], exact: bool) -> None:
    if exact:
        assert a == b
        return
    for x, y in zip(a, b):  # compiled: another fusion may round an intermediate differently
        m = latent_metrics(np.frombuffer(y, np.float32), np.frombuffer(x, np.float32))
        assert not latent_passes(m), m


@pytest.mark.parametrize("mode,dtype", [("eager", "float32"), ("eager", "bfloat16"), ("compiled", "float32"),
                                        ("compiled", "bfloat16")])
def test_carried_add_gives_the_blocks_own_latents(mode, dtype):
    """Eager: the same bytes. Compiled: the carried add is generated into another kernel (the next
    norm's), whose fp32 intermediates need not round as the block-end kernel's did, so within the
    threshold gate (here, on the CPU, a few chunks differ in the last bits in bf16 and none in fp32)."""
    eng = DitEngine(_cfg(mode=mode, dtype=dtype), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    _same(_session(eng, "next"), _session(eng, "own"), exact=mode == "eager")
    eng.residual = "runtime"  # with H2b's rounding after each add too
    if dtype == "bfloat16":
        _same(_session(eng, "next"), _session(eng, "own"), exact=mode == "eager")
    if mode == "compiled":
        per_chunk = eng.compile_stats()["compiles_per_chunk"]
        for v in range(len(per_chunk) // CHUNKS):  # a setting's first chunk may trace; none after it
            assert per_chunk[v * CHUNKS + 1 : (v + 1) * CHUNKS] == [0] * (CHUNKS - 1), per_chunk


def test_the_fp8_ffns_bias_add_travels_with_the_carried_add():
    """H6e's FFN adds FFN-down's bias outside its GEMM: every block hands it on with its output
    (``ffn_unbiased``), never through the FFN's own forward; under H2c that add goes with the
    carried add into the next block (no kernel of its own at the graph's end), bitwise in eager."""
    from harness.candidates import get
    from harness.engine.dit import ffn_unbiased

    eng = DitEngine(_cfg(dtype="bfloat16"), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    block = eng.model.blocks[0]
    h = torch.randn(8, eng.cfg.model.dim, dtype=torch.bfloat16)
    y, bias = ffn_unbiased(block.ffn, h)  # a bf16 FFN adds its own
    assert bias is None and torch.equal(y, block.ffn(h))
    revert = get("H6e").patch_dit(eng, "ffn")
    try:
        y, bias = ffn_unbiased(block.ffn, h)
        assert bias is block.ffn.down.bias and torch.equal(y + bias, block.ffn(h))
        calls = {"forward": 0, "unbiased": 0}
        for b in eng.model.blocks:  # counts where an FFN adds its own bias (its forward) and where not
            b.ffn.forward = _counting(b.ffn.forward, calls, "forward")
            b.ffn.unbiased = _counting(b.ffn.unbiased, calls, "unbiased")
        carried = _session(eng, "next")
        passes = calls["unbiased"]
        assert passes > 0 and passes % (CHUNKS * eng.cfg.model.num_layers) == 0, calls
        assert calls["forward"] == 0  # every block handed its bias on
        own = _session(eng, "own")
        assert calls == {"forward": 0, "unbiased": 2 * passes}, calls
        _same(carried, own, exact=True)
    finally:
        revert()


def _counting(fn, calls: dict, key: str):
    def counted(*args):
        calls[key] += 1
        return fn(*args)
    return counted


def test_under_a_hook_each_layer_keeps_its_phase():
    eng = DitEngine(_cfg(), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    own = _session(eng, "own")
    layers = []

    class Layers:  # a hook's listener: the layer of every per-layer phase entered
        def enter(self, fields, phase, parent):
            if "layer" in fields:
                layers.append(fields["layer"])

        def exit(self, fields, phase, parent):
            pass

    listener = Layers()
    hctx.add_listener(listener)
    try:
        carried = _session(eng, "next")
    finally:
        hctx.remove_listener(listener)
    assert carried == own
    n = eng.cfg.model.num_layers
    assert sorted(set(layers)) == list(range(n)) and len(layers) == CHUNKS * 5 * n


def _rank(group: RankGroup, cfg) -> dict:
    eng = DitEngine(override(cfg, parallel={"sp": group.size}), group=group, device=torch.device("cpu"), seed=3)
    return {"own": _session(eng, "own"), "next": _session(eng, "next")}


@pytest.mark.parametrize("sp", [2, 4])
def test_sp_ranks_give_their_own_bytes(sp):
    one = run_ranks(_rank, 1, _cfg())[0]
    ranks = run_ranks(_rank, sp, _cfg())
    for r in ranks:
        assert r["next"] == r["own"]
    assert_ranks_match([r["next"] for r in ranks], ranks[0]["next"], one["next"], 1e-4)


def test_candidate_sets_the_switch():
    cfg = C.configure(["H2c"], load_preset("tiny"))
    assert cfg.runtime.ffn_residual == "next" and C.get("H2c").gate == "threshold"
    assert "ffn_residual" in ENGINE_SWITCHES
