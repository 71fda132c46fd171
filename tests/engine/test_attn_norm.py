"""H2g on CPU: the block's self-attention input (the carried FFN add, norm, modulation, rounding)
as one op (``runtime.attn_norm``).

The Triton kernel, in the interpreter (on a GPU, on CUDA): the new stream within one bf16 step of
the module's own add in a counted few elements (fp32 within a few float32 steps), the attention's
input within one bf16 step of the module's norm and modulation of that stream, rows starting
mid-frame, with and without the FFN's bias, a strided stream, and malformed inputs refused. The op
in the engine (its default, the module's own ops, which is what runs off the GPU): eager latents
the bytes of the ops path, bf16 and fp32, with the FFN residual carried or not, with a bf16 stream
(H2b), with H6e's FP8 FFN (whose bias travels with the carried add), through window eviction, and
under SP with 2 and 4 ranks; compiled, within the threshold gate, nothing recompiling after a
setting's first chunk."""

from __future__ import annotations

import re

import pytest
import torch

from harness import candidates as C
from harness.config import load_preset, override
from harness.engine.attn_norm import add_norm_reference
from harness.engine.dit_engine import DitEngine
from harness.engine.ffn_norm import norm_modulate_reference
from harness.engine.groups import RankGroup
from tests.candidates.test_h6e_fp8_ffn_fused import cpu_fp8
from tests.helpers.interpreter import check_in_interpreter, steps_apart
from tests.helpers.switches import (
    assert_compiled_switch_within_gate,
    assert_sp_ranks_switch_alike,
    assert_switch_candidate,
    switched_session,
)

CACHE = {"sink_frames": 3, "window_frames": 9}  # evicts from chunk 3 on
CHUNKS = 4
F32, BF16 = torch.float32, torch.bfloat16


# ---- the kernel -----------------------------------------------------------------------------------
def _inputs(n: int, dim: int, frames: int, x_dtype: torch.dtype, y_dtype: torch.dtype, g: torch.Generator,
            device: str):
    x = 3 * torch.randn(n, dim, generator=g) + torch.randn(n, 1, generator=g)  # rows with an offset
    x[0, 1] = 200.0  # an outlier channel
    y = 2 * torch.randn(n, dim, generator=g)
    bias = torch.randn(dim, generator=g)
    mod = 0.5 * torch.randn(frames, 6, dim, generator=g)  # the block's six, as ``unbind(1)`` views them
    return (x.to(x_dtype).to(device), y.to(y_dtype).to(device), bias.to(y_dtype).to(device),
            *(mod[:, i].to(device) for i in (2, 0, 1)))  # gate, shift, scale: strided views


def check(device: str, bound: float) -> None:
    from harness.engine import fused_norm as fused

    g = torch.Generator().manual_seed(0)
    off = total = 0
    # (rows, dim, frames, tokens a frame, first row): whole frames, a slice starting mid-frame, the full width
    for n, dim, frames, tpf, start in ((12, 64, 3, 4, 0), (10, 64, 3, 4, 1), (7, 5120, 2, 5, 3), (9, 1000, 3, 3, 0)):
        for residual, y_dtype, out in ((F32, BF16, BF16), (BF16, BF16, BF16), (F32, F32, F32), (BF16, BF16, F32)):
            x, y, bias, gate, shift, scale = _inputs(n, dim, frames, residual, y_dtype, g, device)
            for b in (bias, None):
                want_x, _ = add_norm_reference(x, y, b, gate, shift, scale, 1e-6, start, tpf, residual, out)
                got_x, got_h = fused.add_norm_modulate(x, y, b, gate, shift, scale, 1e-6, start, tpf, residual, out)
                assert got_x.dtype == residual and got_h.dtype == out and got_h.shape == x.shape
                # the norm of the stream the kernel made: a flipped stream element moves its row's moments
                want_h = norm_modulate_reference(got_x, shift, scale, 1e-6, start, tpf, out)
                for got, want in ((got_x, want_x), (got_h, want_h)):
                    d = steps_apart(got, want)  # fp32: within float32 steps, but a contracted FMA moves many
                    if got.dtype == BF16:
                        off, total = off + d, total + got.numel()
    assert off <= bound * total, f"{off} of {total} elements differ"
    # a strided stream (unit column stride) is read in place; malformed inputs are refused
    x, y, bias, gate, shift, scale = _inputs(6, 64, 2, F32, BF16, g, device)
    wide = torch.cat([x, x], dim=1)[:, :64]
    args = (y, bias, gate, shift, scale, 1e-6, 0, 3, F32, BF16)
    assert all(torch.equal(a, b) for a, b in zip(fused.add_norm_modulate(wide, *args), fused.add_norm_modulate(x, *args)))
    for bad, why in (((x, y[:, :32], bias, gate), "FFN output"), ((x, y.half(), bias, gate), "FFN output"),
                     ((x, y, bias.float(), gate), "bias"), ((x, y, bias[:32], gate), "bias"),
                     ((x, y, bias, gate.bfloat16()), "fp32 gate"), ((x, y, bias, gate[:1]), "fp32 gate"),
                     ((x.half(), y, bias, gate), "fp32 or bf16 residual stream")):
        with pytest.raises(ValueError, match=re.escape(why)):
            fused.add_norm_modulate(*bad, shift, scale, 1e-6, 0, 3, F32, BF16)
    with pytest.raises(ValueError, match="do not fit 2 frames"):
        fused.add_norm_modulate(x, y, bias, gate, shift, scale, 1e-6, 1, 3, F32, BF16)
    with pytest.raises(ValueError, match="bf16 or fp32 residual"):
        fused.add_norm_modulate(x, y, bias, gate, shift, scale, 1e-6, 0, 3, torch.float16, BF16)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test covers it")
def test_kernel_matches_the_ops_in_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (it comes with the vllm extra)")
    check_in_interpreter(__file__, bound=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_matches_the_ops_on_cuda():
    pytest.importorskip("triton")
    check("cuda", bound=5e-3)


# ---- the op in the engine -------------------------------------------------------------------------
def _cfg(sp: int = 1, mode: str = "eager", dtype: str = "bfloat16", ffn_residual: str = "next", **runtime):
    return override(load_preset("tiny"), parallel={"sp": sp}, cache=CACHE,
                    runtime={"mode": mode, "dtype": dtype, "ffn_residual": ffn_residual, **runtime})


def _session(eng: DitEngine, how: str) -> list[bytes]:
    return switched_session(eng, "attn_norm", how, CHUNKS)


@pytest.mark.parametrize("dtype, ffn_residual, residual", [("float32", "next", "float32"), ("bfloat16", "own", "float32"),
                                                           ("bfloat16", "next", "float32"), ("bfloat16", "next", "runtime")])
def test_eager_op_gives_the_modules_bytes(dtype, ffn_residual, residual):
    eng = DitEngine(_cfg(dtype=dtype, ffn_residual=ffn_residual, residual=residual), group=RankGroup.single(),
                    device=torch.device("cpu"), seed=3)
    ops = _session(eng, "ops")
    assert _session(eng, "kernel") == ops


@cpu_fp8
def test_eager_op_gives_h6es_bytes():
    """H6e's FFN leaves FFN-down's bias to the carried add: the op adds it, the same latents."""
    eng = DitEngine(_cfg(), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    bf16 = _session(eng, "ops")
    revert = C.get("H6e").patch_dit(eng, "ffn")
    try:
        ops = _session(eng, "ops")
        assert ops != bf16  # the FP8 FFN is in
        assert _session(eng, "kernel") == ops
        eng.ffn_norm = "kernel"  # with H2f's op making FFN-up's codes too
        assert _session(eng, "kernel") == ops
    finally:
        revert()


def test_compiled_op_within_the_gate_and_nothing_recompiles():
    eng = DitEngine(_cfg(mode="compiled"), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    assert_compiled_switch_within_gate(eng, "attn_norm", CHUNKS)


@pytest.mark.parametrize("sp", [2, 4])
def test_sp_ranks_give_their_own_bytes(sp):
    """At SP 4 the tiny preset's 32-token frames split into 24-token slices: ranks 1 and 2 start mid-frame."""
    assert_sp_ranks_switch_alike(_cfg(), sp, "attn_norm", CHUNKS)


def test_candidate_sets_the_switch_and_needs_the_gpu():
    eng = DitEngine(_cfg(), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    assert_switch_candidate("H2g", "attn_norm_kernel", "attn_norm", eng)
