"""H2f on CPU: the block's FFN input (the cross-attention's residual add, norm, modulation,
rounding, FP8 quantisation) as one op (``runtime.ffn_norm``).

The Triton kernel, in the interpreter (on a GPU, on CUDA): the summed stream exact, the rounded input within one bf16 step
of the module's own ops in a counted few elements (fp32 within a few float32 steps), every e4m3
code within one step of the reference's and the scales within one bf16 step, rows starting
mid-frame, a strided stream and modulation, and malformed inputs refused. The op in the engine
(its default, the module's own ops, which is what runs off the GPU): eager latents the bytes of
the ops path, bf16 and fp32, with the FFN residual carried or not, with H6e's FP8 FFN, through
window eviction, and under SP with 2 and 4 ranks (slices starting mid-frame); compiled, within the
threshold gate, nothing recompiling after a setting's first chunk."""

from __future__ import annotations

import re

import pytest
import torch

from harness import candidates as C
from harness.config import load_preset, override
from harness.engine.dit_engine import DitEngine
from harness.engine.ffn_norm import add_norm_modulate_reference, norm_modulate_reference
from harness.engine.fp8_linear import rowwise_quantize
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


# ---- the kernel -----------------------------------------------------------------------------------
def _inputs(n: int, dim: int, frames: int, dtype: torch.dtype, g: torch.Generator, device: str):
    x = 3 * torch.randn(n, dim, generator=g) + torch.randn(n, 1, generator=g)  # rows with an offset
    x[0, 1] = 200.0  # an outlier channel
    mod = 0.5 * torch.randn(frames, 6, dim, generator=g)  # the block's six, as ``unbind(1)`` views them
    return x.to(dtype).to(device), mod[:, 3].to(device), mod[:, 4].to(device)


def _codes_apart(q: torch.Tensor, s: torch.Tensor, q0: torch.Tensor, s0: torch.Tensor) -> int:
    """Codes of the kernel's (q, s) that differ from the reference's (q0, s0): the scales one bf16
    amax apart at most, and each differing code one e4m3 step (or one subnormal step) away."""
    assert q.dtype == torch.float8_e4m3fn and q.shape == q0.shape and s.shape == s0.shape
    assert float(((s - s0).abs() / s0).max()) <= 2.0 ** -7
    a, r = q.float() * s, q0.float() * s0
    step = torch.maximum(r.abs() * 2.0 ** -3, s0 * 2.0 ** -9) * (1 + 2.0 ** -7) + 2.0 ** -7 * r.abs()
    assert bool(((a - r).abs() <= step).all()), "a code more than one e4m3 step off"
    return int((a != r).sum())


def check(device: str, bound: float) -> None:
    from harness.engine import fused_norm as fused

    g = torch.Generator().manual_seed(0)
    off = total = 0
    # (rows, dim, frames, tokens a frame, first row): whole frames, a slice starting mid-frame, the full width
    for n, dim, frames, tpf, start in ((12, 64, 3, 4, 0), (10, 64, 3, 4, 1), (7, 5120, 2, 5, 3), (9, 1000, 3, 3, 0)):
        for x_dtype in (torch.float32, torch.bfloat16):
            x, shift, scale = _inputs(n, dim, frames, x_dtype, g, device)
            for out in (torch.float32, torch.bfloat16):
                want = norm_modulate_reference(x, shift, scale, 1e-6, start, tpf, out)
                got = fused.norm_modulate(x, shift, scale, 1e-6, start, tpf, out)
                assert got.shape == x.shape and got.dtype == out
                d = steps_apart(got, want)
                if out == torch.bfloat16:
                    off, total = off + d, total + got.numel()
            for c_dtype in (torch.bfloat16, torch.float32):  # the cross-attention's output, in the runtime dtype
                c = (2 * torch.randn(n, dim, generator=g)).to(c_dtype).to(device)
                want_x, want = add_norm_modulate_reference(x, c, shift, scale, 1e-6, start, tpf, torch.bfloat16)
                got_x, got = fused.ffn_input(x, c, shift, scale, 1e-6, start, tpf, torch.bfloat16)
                assert got_x.dtype == want_x.dtype and torch.equal(got_x, want_x)  # the add is exact
                off, total = off + steps_apart(got, want), total + got.numel()
                q0, s0 = rowwise_quantize(want)
                got_x, q, s = fused.ffn_input_quantize(x, c, shift, scale, 1e-6, start, tpf)
                assert torch.equal(got_x, want_x)
                off, total = off + _codes_apart(q, s, q0, s0), total + q.numel()
    assert off <= bound * total, f"{off} of {total} elements differ"
    # a strided stream (unit column stride) is read in place; malformed inputs are refused
    x, shift, scale = _inputs(6, 64, 2, torch.float32, g, device)
    wide = torch.cat([x, x], dim=1)[:, :64]
    assert torch.equal(fused.norm_modulate(wide, shift, scale, 1e-6, 0, 3, torch.bfloat16),
                       fused.norm_modulate(x, shift, scale, 1e-6, 0, 3, torch.bfloat16))
    c = x.bfloat16()
    assert torch.equal(fused.ffn_input(wide, c, shift, scale, 1e-6, 0, 3, torch.bfloat16)[1],
                       fused.ffn_input(x, torch.cat([c, c], dim=1)[:, :64], shift, scale, 1e-6, 0, 3, torch.bfloat16)[1])
    for args, why in (((x, c[:, :32], shift, scale, 1e-6, 0, 3, torch.bfloat16), "cross-attention output"),
                      ((x, c.half(), shift, scale, 1e-6, 0, 3, torch.bfloat16), "cross-attention output")):
        with pytest.raises(ValueError, match=re.escape(why)):
            fused.ffn_input(*args)
    for args, why in (((x.half(), shift, scale, 1e-6, 0, 3, torch.bfloat16), "fp32 or bf16 residual"),
                      ((x, shift[:, :32], scale, 1e-6, 0, 3, torch.bfloat16), "shift and scale"),
                      ((x, shift.double(), scale.double(), 1e-6, 0, 3, torch.bfloat16), "shift and scale"),
                      ((x, shift, scale, 1e-6, 1, 3, torch.bfloat16), "do not fit 2 frames"),
                      ((x, shift, scale, 1e-6, 0, 3, torch.float16), "bf16 or fp32 output")):
        with pytest.raises(ValueError, match=re.escape(why)):
            fused.norm_modulate(*args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test covers it")
def test_kernel_matches_the_ops_in_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (it comes with the vllm extra)")
    check_in_interpreter(__file__, bound=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_matches_the_ops_on_cuda():
    pytest.importorskip("triton")
    check("cuda", bound=5e-3)


# ---- the op in the engine -------------------------------------------------------------------------
def _cfg(sp: int = 1, mode: str = "eager", dtype: str = "bfloat16", **runtime):
    return override(load_preset("tiny"), parallel={"sp": sp}, cache=CACHE,
                    runtime={"mode": mode, "dtype": dtype, **runtime})


def _session(eng: DitEngine, how: str) -> list[bytes]:
    return switched_session(eng, "ffn_norm", how, CHUNKS)


@pytest.mark.parametrize("dtype, ffn_residual", [("float32", "own"), ("bfloat16", "own"), ("bfloat16", "next")])
def test_eager_op_gives_the_modules_bytes(dtype, ffn_residual):
    eng = DitEngine(_cfg(dtype=dtype, ffn_residual=ffn_residual), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    ops = _session(eng, "ops")
    assert _session(eng, "kernel") == ops


@cpu_fp8
def test_eager_op_gives_h6es_bytes():
    """With H6e's FP8 FFN the op makes FFN-up's codes and scales itself: the same latents."""
    eng = DitEngine(_cfg(ffn_residual="next"), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    bf16 = _session(eng, "ops")
    revert = C.get("H6e").patch_dit(eng, "ffn")
    try:
        ops = _session(eng, "ops")
        assert ops != bf16  # the FP8 FFN is in
        assert _session(eng, "kernel") == ops
    finally:
        revert()


def test_compiled_op_within_the_gate_and_nothing_recompiles():
    eng = DitEngine(_cfg(mode="compiled"), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    assert_compiled_switch_within_gate(eng, "ffn_norm", CHUNKS)


@pytest.mark.parametrize("sp", [2, 4])
def test_sp_ranks_give_their_own_bytes(sp):
    """At SP 4 the tiny preset's 32-token frames split into 24-token slices: ranks 1 and 2 start mid-frame."""
    assert_sp_ranks_switch_alike(_cfg(), sp, "ffn_norm", CHUNKS)


def test_candidate_sets_the_switch_and_needs_the_gpu():
    eng = DitEngine(_cfg(), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    assert_switch_candidate("H2f", "ffn_norm_kernel", "ffn_norm", eng)
