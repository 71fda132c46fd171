"""H2d on CPU: the q/k norms + RoPE (+ H1f's K/V store) as one op (``runtime.qk_norm_rope``).

The Triton kernel, in the interpreter (on a GPU, on CUDA): q and k within one bf16 step of the
module's own ops in a counted few elements (fp32 within a few float32 steps), V stored bit for
bit, every other block of the pools untouched, and malformed inputs refused. The op in the
engine (its default, the module's own ops, which is what runs off the GPU): eager latents the
bytes of the ops path with either K/V writer, through window eviction, and under SP with 2 and 4
ranks; compiled, within the threshold gate, nothing recompiling after a setting's first chunk,
and the pools written in place by the op (no copy of a pool in the generated code)."""

from __future__ import annotations

import re

import pytest
import torch

from harness.config import load_preset, override
from harness.engine.dit import store_kv
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup
from harness.engine.qk_norm_rope import norm_rope_reference, qk_norm_rope_store
from tests.helpers.interpreter import check_in_interpreter
from tests.helpers.switches import (
    assert_compiled_switch_within_gate,
    assert_sp_ranks_switch_alike,
    assert_switch_candidate,
    switched_session,
)

CACHE = {"sink_frames": 3, "window_frames": 9}  # evicts from chunk 3 on
CHUNKS = 5


# ---- the kernel -----------------------------------------------------------------------------------
def _inputs(n: int, dim: int, heads: int, dtype: torch.dtype, g: torch.Generator, device: str):
    qkv = (3 * torch.randn(n, 3 * dim, generator=g)).to(dtype)
    wq, wk = ((1 + 0.2 * torch.randn(dim, generator=g)).to(dtype) for _ in range(2))
    ang = 40 * torch.rand(n, 1, dim // heads // 2, generator=g, dtype=torch.float64)  # up to 40 rad
    rot = torch.stack([ang.cos(), ang.sin()], dim=-1).float()
    return [t.to(device) for t in (qkv, wq, wk, rot)]


def _steps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements of a (the kernel's) and b (the ops') that differ, after checking that none is
    further than the kernel's float32 error can move it: a few float32 steps of the head's
    largest value (a rotated pair's difference may cancel to far below it), plus, in bf16, one
    bf16 step of the value itself (the rounding that error can tip)."""
    x, y = a.double().flatten(0, -2), b.double().flatten(0, -2)  # rows: one head of one token
    err = (x - y).abs()
    bound = 1e-6 * y.abs().amax(dim=-1, keepdim=True) + (2.0 ** -7 * y.abs() if a.dtype == torch.bfloat16 else 0)
    assert bool((err <= bound).all()), f"{int((err > bound).sum())} elements off by up to {float(err.max()):.3g}"
    return int((a != b).sum())


def check(device: str, bound: float) -> None:
    from harness.engine import fused_qk_norm_rope as fused

    g = torch.Generator().manual_seed(0)
    off = total = 0
    for n, dim, heads, dtype in ((24, 64, 4, torch.float32), (24, 64, 4, torch.bfloat16), (9, 5120, 40, torch.bfloat16),
                                 (6, 5120, 40, torch.float32), (12, 192, 3, torch.bfloat16)):
        qkv, wq, wk, rot = _inputs(n, dim, heads, dtype, g, device)
        want_q, want_k = norm_rope_reference(qkv, wq, wk, rot, 1e-6, heads)
        q, k = fused.qk_norm_rope(qkv, wq, wk, rot, 1e-6, heads)
        assert q.shape == k.shape == (n, heads, dim // heads) and q.dtype == dtype
        for got, want in ((q, want_q), (k, want_k)):
            d = _steps_apart(got, want)
            if dtype == torch.bfloat16:
                off, total = off + d, total + got.numel()
        # the stored form: token t at row t % B of block ids[t // B]; V bit for bit; no other block touched
        tokens = 3
        blocks = n // tokens
        k_pool = torch.full((blocks + 3, tokens, heads, dim // heads), 7.0, dtype=dtype, device=device)
        v_pool = torch.full_like(k_pool, -5.0)
        want_kp, want_vp = k_pool.clone(), v_pool.clone()
        ids = torch.randperm(blocks + 3, generator=g)[:blocks].to(device)
        q2 = fused.qk_norm_rope_store(qkv, wq, wk, rot, 1e-6, heads, k_pool, v_pool, ids)
        store_kv((want_kp, want_vp, ids), want_k, qkv[:, 2 * dim :].view(n, heads, dim // heads))
        assert torch.equal(q2, q) and torch.equal(v_pool, want_vp)
        _steps_apart(k_pool, want_kp)
        untouched = torch.ones(blocks + 3, dtype=torch.bool)
        untouched[ids.cpu()] = False
        assert bool((k_pool[untouched.to(device)] == 7.0).all())
    assert off <= bound * total, f"{off} of {total} bf16 elements differ"
    # a strided QKV (unit column stride) is read in place; malformed inputs are refused
    qkv, wq, wk, rot = _inputs(6, 64, 4, torch.bfloat16, g, device)
    wide = torch.cat([qkv, qkv], dim=1)[:, : qkv.shape[1]]  # row stride 6·dim
    assert torch.equal(fused.qk_norm_rope(wide, wq, wk, rot, 1e-6, 4)[0], fused.qk_norm_rope(qkv, wq, wk, rot, 1e-6, 4)[0])
    for args, why in (((qkv[:, :190], wq, wk, rot, 1e-6, 4), "3·dim"), ((qkv, wq, wk, rot, 1e-6, 5), "heads"),
                      ((qkv, wq[:8], wk, rot, 1e-6, 4), "norm weights"), ((qkv, wq, wk, rot.double(), 1e-6, 4), "rotation"),
                      ((qkv.half(), wq, wk, rot, 1e-6, 4), "bf16 or fp32")):
        with pytest.raises(ValueError, match=re.escape(why)):
            fused.qk_norm_rope(*args)
    pool = torch.zeros(3, 2, 4, 16, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="do not fill"):
        fused.qk_norm_rope_store(qkv, wq, wk, rot, 1e-6, 4, pool, pool.clone(), torch.arange(2, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        fused.qk_norm_rope_store(qkv, wq, wk, rot, 1e-6, 4, pool.float(), pool.clone(), torch.arange(3, device=device))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test covers it")
def test_kernel_matches_the_ops_in_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (it comes with the vllm extra)")
    check_in_interpreter(__file__, bound=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_matches_the_ops_on_cuda():
    pytest.importorskip("triton")
    check("cuda", bound=5e-3)


# ---- the op in the engine -------------------------------------------------------------------------
def _cfg(sp: int = 1, mode: str = "eager", dtype: str = "float32", **runtime):
    return override(load_preset("tiny"), parallel={"sp": sp}, cache=CACHE,
                    runtime={"mode": mode, "dtype": dtype, **runtime})


def _session(eng: DitEngine, how: str) -> list[bytes]:
    return switched_session(eng, "qk_norm_rope", how, CHUNKS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_write", ["copy", "graph"])
def test_eager_op_gives_the_modules_bytes(kv_write, dtype):
    eng = DitEngine(_cfg(dtype=dtype, kv_write=kv_write), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    assert _session(eng, "kernel") == _session(eng, "ops")


def test_compiled_op_within_the_gate_and_nothing_recompiles():
    eng = DitEngine(_cfg(mode="compiled", dtype="bfloat16", kv_write="graph"), group=RankGroup.single(),
                    device=torch.device("cpu"), seed=3)
    assert_compiled_switch_within_gate(eng, "qk_norm_rope", CHUNKS)


def test_compiled_op_writes_the_pools_in_place():
    """The stored form mutates its pools: Inductor must hand it the graph's own inputs (a CUDA
    graph then replays the write into the static pools), not copies written back after it."""
    from torch._inductor.utils import run_and_get_code

    n, dim, heads = 24, 64, 4
    qkv, wq, wk, rot = _inputs(n, dim, heads, torch.float32, torch.Generator().manual_seed(1), "cpu")
    k_pool, v_pool = torch.zeros(10, 3, heads, dim // heads), torch.zeros(10, 3, heads, dim // heads)
    ids = torch.tensor([9, 1, 2, 3, 4, 5, 6, 0])

    def block(x, k_pool, v_pool, ids):
        return qk_norm_rope_store(x * 2, wq, wk, rot, 1e-6, heads, k_pool, v_pool, ids) + 1

    pointers = (k_pool.data_ptr(), v_pool.data_ptr())
    out, code = run_and_get_code(torch.compile(block), qkv, k_pool, v_pool, ids)
    # (the doubled QKV, the weights and table as inputs, eps, heads, then the pools and ids as inputs)
    call = r"qk_norm_rope_store\.default\(buf\d+, (arg\d+_1, ){3}[^,]+, 4, (arg\d+_1, ){2}arg\d+_1\)"
    assert re.search(call, code[0]), code[0][-2000:]
    assert ".copy_(" not in code[0] and "clone" not in code[0]
    want_k, want_v = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
    q, k = norm_rope_reference(qkv * 2, wq, wk, rot, 1e-6, heads)
    store_kv((want_k, want_v, ids), k, (qkv * 2)[:, 2 * dim :].view(n, heads, dim // heads))
    assert torch.equal(out, q + 1) and torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    assert (k_pool.data_ptr(), v_pool.data_ptr()) == pointers


@pytest.mark.parametrize("sp", [2, 4])
def test_sp_ranks_give_their_own_bytes(sp):
    """Under SP the op returns K and the core's all-to-all moves them (no store in the graph)."""
    assert_sp_ranks_switch_alike(_cfg(kv_write="graph"), sp, "qk_norm_rope", CHUNKS)


def test_candidate_sets_the_switch_and_needs_the_gpu():
    eng = DitEngine(_cfg(), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    assert_switch_candidate("H2d", "qk_norm_rope_kernel", "qk_norm_rope", eng)
