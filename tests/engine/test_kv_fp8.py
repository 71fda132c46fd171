"""H6d's FP8 KV cache (``engine/kv_fp8.py``) on CPU: what it stores is exactly the e4m3
quantisation of what a bf16 cache stores, through eviction and cancel in both layouts; its
emulated FP8 attention is within the declared threshold of bf16 attention; SP 2 and 4 give SP 1's
latents; the revert brings the bf16 engine back bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.candidates import get
from harness.config import load_preset, override
from harness.engine.attention import dense, gather_attention
from harness.engine.conditions import SessionConditions
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup, run_ranks
from harness.engine.kv_fp8 import Fp8KVCache, emulated_attention, quantize_with
from harness.engine.kvcache import PagedKVCache
from harness.errors import HarnessError

GEOMETRY = dict(num_layers=2, local_heads=2, head_dim=8, block_size=4, tokens_per_frame=8, sink_frames=1,
                window_frames=5, max_sessions=2, device=torch.device("cpu"))
FRAMES = 2  # a chunk: 16 tokens; the window keeps the sink and 2 recent frames
#: declared op-level threshold: rel-L2 of the FP8 attention output against exact attention. On
#: random operands (near-uniform attention) e4m3's rounding of Q, K, V and P gives ≈ 0.053 for
#: D = 8…128 whatever the scaling (a power-of-two headroom rounds identically): the bound is that
#: with room, and H6d must stay comparable (≤ 1.25×: another scale is another rounding draw, and
#: these operands are small) with H6b's per-call quantisation of the same operands.
ATTN_REL_L2 = 0.08
VS_PER_CALL = 1.25


def _chunk(g: torch.Generator, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    n = FRAMES * GEOMETRY["tokens_per_frame"]
    return tuple(scale * torch.randn(n, 2, 8, generator=g).to(torch.bfloat16) for _ in range(2))


@pytest.mark.parametrize("layout", ["paged", "window"])
def test_stored_cache_is_exactly_the_quantised_bf16_cache(layout):
    ref = PagedKVCache(dtype=torch.bfloat16, **GEOMETRY)
    f8 = Fp8KVCache(kernel="emulated", **GEOMETRY)
    g = torch.Generator().manual_seed(0)
    sr, s8 = ref.open(layout), f8.open(layout)
    checked = 0
    for chunk in range(6):  # the window saturates at chunk 2 and evicts from chunk 3
        cancelled = chunk == 3
        for c, s in ((ref, sr), (f8, s8)):
            c.begin_chunk(s, FRAMES)
        for forward in range(2 if cancelled else 3):  # chunk 3 is cancelled after two forwards
            for layer in range(2):
                # a later chunk's V beyond the first chunk's range ×4: those values saturate
                k, v = _chunk(g, 6.0 if chunk == 4 and layer == 1 else 1.0)
                ref.write(layer, sr, k, v)
                f8.write(layer, s8, k, v)
                ids = ref.visible(sr)
                for pool_r, pool_8, i in ((ref.k, f8.k, 0), (ref.v, f8.v, 1)):
                    want = quantize_with(_visible(pool_r[layer], ids), f8.scales[s8.sid][layer, i])
                    got = _visible(pool_8[layer], f8.visible(s8))
                    assert got.view(torch.uint8).equal(want.view(torch.uint8)), (chunk, forward, layer, i)
                    checked += 1
        if not cancelled:
            ref.commit(sr)
            f8.commit(s8)
    assert checked == 2 * 2 * (5 * 3 + 2) and f8.visible_tokens(s8) == ref.visible_tokens(sr) == 5 * 8
    frozen = f8.scales[s8.sid].clone()
    f8.free_session(s8)
    assert s8.sid not in f8.scales and f8.blocks_used == 0 and frozen.gt(0).all()


def _visible(pool: torch.Tensor, ids) -> torch.Tensor:
    if isinstance(ids, slice):
        return pool[ids].flatten(0, 1)
    return pool.view(torch.uint8).index_select(0, ids).view(pool.dtype).flatten(0, 1) if pool.dtype.itemsize == 1 \
        else pool.index_select(0, ids).flatten(0, 1)


def test_emulated_fp8_attention_is_within_its_threshold_of_bf16():
    g = torch.Generator().manual_seed(1)
    ref = PagedKVCache(dtype=torch.float32, **GEOMETRY)
    f8 = Fp8KVCache(kernel="emulated", **GEOMETRY)
    sr, s8 = ref.open("window"), f8.open("window")
    for chunk in range(4):
        q = torch.randn(16, 2, 8, generator=g)
        k, v = (torch.randn(16, 2, 8, generator=g) for _ in range(2))
        for c, s in ((ref, sr), (f8, s8)):
            c.begin_chunk(s, FRAMES)
            c.write(0, s, k, v)
        want = ref.attend(0, sr, q, gather_attention, attend=dense("math"), group_blocks=4)
        per_call = ref.attend(0, sr, q, gather_attention, attend=dense("fp8-emulated"), group_blocks=4)
        got = f8.attend(0, s8, q, gather_attention, attend=dense("math"), group_blocks=4)
        rel, rel_call = (float((x - want).norm() / want.norm()) for x in (got, per_call))
        assert 0 < rel <= ATTN_REL_L2 and rel <= VS_PER_CALL * rel_call, (chunk, rel, rel_call)
        for c, s in ((ref, sr), (f8, s8)):
            c.commit(s)
    # the dense backend (cross-attention): per-call quantisation, the same emulated kernel
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (16, 40, 40))
    want = dense("math")(q, k, v)
    rel = float((dense("fp8-emulated")(q, k, v) - want).norm() / want.norm())
    assert 0 < rel <= ATTN_REL_L2, rel


def test_emulation_rounds_p_to_e4m3_like_the_kernel():
    """With exactly representable operands and unit scales, only P's rounding separates the
    emulation from exact attention: it must be visible (the emulation is not plain SDPA)."""
    g = torch.Generator().manual_seed(2)
    q8, k8, v8 = (torch.randn(8, 1, 16, generator=g).to(torch.float8_e4m3fn) for _ in range(3))
    one = torch.ones(1)
    got = emulated_attention(q8, k8, v8, one, one, one)
    want = dense("math")(*(x.float().transpose(0, 1)[None] for x in (q8, k8, v8)))[0].transpose(0, 1)
    assert 0 < float((got - want).abs().max()) < 0.1


# ---- the engine: SP 1/2/4, both layouts, eviction and cancel, revert ------------------------------
#: the tiny preset with a 3-sink + 6-recent window (saturated at chunk 2, evicting from chunk 3)
#: and 2 denoising steps: eviction and re-written chunks as the preset's 9 + 9 window and 4 steps
#: have them, in 4 chunks of half the forwards instead of 7 chunks
CACHE = {"sink_frames": 3, "window_frames": 9}
STEPS = (1000, 500)
CHUNKS = 4


def _engine_run(group: RankGroup, layouts: tuple[str, ...], revert_check: bool = False) -> dict:
    torch.set_num_threads(1)
    cfg = override(load_preset("tiny"), parallel={"sp": group.size}, cache=CACHE, schedule={"timesteps": STEPS})
    eng = DitEngine(cfg, group=group, device=torch.device("cpu"), seed=3)
    image = torch.randn(16, 1, cfg.video.latent_h, cfg.video.latent_w, generator=torch.Generator().manual_seed(5))
    out = {}

    def session(tag: str) -> None:
        s = eng.start_session(SessionConditions(prompt="kv fp8", seed=11, image_latent=image))
        out[tag] = [eng.generate_chunk(s, ["W", "", "D"]).numpy().copy() for _ in range(CHUNKS)]
        eng.end_session(s)

    session("bf16")
    for layout in layouts:
        eng.kv_layout = layout
        revert = get("H6d").patch_dit(eng, "emulated")  # its configure part changes nothing here
        try:
            session(f"fp8:{layout}")
        finally:
            revert()
            eng.kv_layout = "paged"
    if revert_check:
        session("after")
    return out


@pytest.fixture(scope="module")
def sp1():
    return run_ranks(_engine_run, 1, ("paged", "window"), True)[0]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_fp8_kv_engine_runs_and_reverts_bit_exactly(sp1):
    assert all(a.tobytes() == b.tobytes() for a, b in zip(sp1["after"], sp1["bf16"]))
    for layout in ("paged", "window"):
        errs = [_rel(a, b) for a, b in zip(sp1[f"fp8:{layout}"], sp1["bf16"])]
        assert all(np.isfinite(x).all() for x in sp1[f"fp8:{layout}"])
        assert 0 < min(errs) and max(errs) < 0.5, errs  # FP8 changes the latents, not beyond recognition
    # the window layout reads the same e4m3 values in the same order as the paged gather
    assert all(a.tobytes() == b.tobytes() for a, b in zip(sp1["fp8:window"], sp1["fp8:paged"]))


@pytest.mark.parametrize("sp", [2, 4])
def test_fp8_kv_sp_ranks_give_sp1s_latents(sp1, sp):
    """Each head's tokens are all on the rank that holds it, so its scales, its e4m3 values and its
    attention are the ones SP=1 computes: FP8 adds no dependence on the split of its own — where
    the bf16 path is bit-identical to SP=1 (it is on this box), so is the FP8 path; in any case
    both within the SP test's 1e-4 (tests/engine/test_dit_sp.py)."""
    layouts = ("paged", "window") if sp == 2 else ("window",)
    results = run_ranks(_engine_run, sp, layouts)
    bf16_exact = all(a.tobytes() == b.tobytes() for a, b in zip(results[0]["bf16"], sp1["bf16"]))
    for r in results:
        for tag in ("bf16", *(f"fp8:{x}" for x in layouts)):
            for c in range(CHUNKS):
                assert np.array_equal(r[tag][c], results[0][tag][c]), f"rank differs: {tag} chunk {c}"
                err = _rel(r[tag][c], sp1[tag][c])
                assert err <= 1e-4, f"SP={sp} {tag}: chunk {c} relative error {err:.2e}"
                if bf16_exact:
                    assert r[tag][c].tobytes() == sp1[tag][c].tobytes(), f"SP={sp} {tag}: chunk {c} differs"


def test_h6d_is_refused_while_a_session_is_open():
    cfg = override(load_preset("tiny"), parallel={"sp": 1})
    eng = DitEngine(cfg, group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    s = eng.start_session(SessionConditions(prompt="open", seed=1))
    with pytest.raises(HarnessError, match="no session open"):
        get("H6d").patch_dit(eng, "emulated")
    assert type(eng.cache) is PagedKVCache
    eng.end_session(s)
    get("H6d").patch_dit(eng, "emulated")()  # applies and reverts once none is open
    assert type(eng.cache) is PagedKVCache
