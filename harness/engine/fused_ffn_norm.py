"""The FFN's input in one Triton pass over the residual stream: LayerNorm (no affine), the
per-frame modulation, the rounding to the runtime dtype and, for an FP8 FFN, the per-row e4m3
quantisation FFN-up's GEMM reads (H2f).

Compiled, Inductor makes these one reduction kernel a block, but the stream's rows (5 120 wide at
full size) are longer than the 1 024 columns it keeps in registers: its looped kernel walks each
row three times (mean, variance, then normalise-modulate-quantise, with the amax between), 23.9 ms
a steady chunk on an H200 at 480×832 with the stack of gpu-batch23, where one read of the fp32
stream and one write of the e4m3 codes is ≈ 120 MB a call. Here one program holds one row in
registers: one read, the two moments, the modulation, the amax, one write.

Per element it does what ``ffn_norm.norm_modulate_reference`` (the block's own ops) does:
``F.layer_norm`` in float32, ``shift[f] + x̂ · (1 + scale[f])`` for the token's latent frame f,
rounded to bf16 (or kept float32), then ``rowwise_quantize``: ``s = max(amax|h|, MIN_AMAX) / 448``
and ``q = e4m3(clamp(h / s))`` with an IEEE division, as the reference divides. What differs is
below float32's rounding: the moments are summed in another order and the GPU may contract the
modulation's product and sum into one FMA; a value within float32 rounding of a bf16 rounding
boundary can so land one bf16 step away, and its code one e4m3 step (the tests count them).

Needs Triton (and a CUDA device, or the interpreter on CPU tensors); only ``ffn_norm``'s CUDA
kernels and the tests import this module.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.engine.fa3 import FP8, FP8_MAX, MIN_AMAX
from harness.engine.triton_round import to_bf16, to_e4m3


@triton.jit
def _ffn_norm_kernel(x_ptr, shift_ptr, scale_ptr, out_ptr, s_ptr, n_cols, x_stride, mod_stride, out_stride,
                     start, tpf, eps, BLOCK: tl.constexpr, ROUND: tl.constexpr, QUANT: tl.constexpr,
                     FMAX: tl.constexpr, AMIN: tl.constexpr, EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    d = tl.where(m, x - mean, 0.0)
    xn = d * tl.math.rsqrt(tl.sum(d * d, axis=0) / n_cols + eps)
    frame = (start + row) // tpf  # the rank's slice may start mid-frame (SP)
    shift = tl.load(shift_ptr + frame * mod_stride + cols, mask=m, other=0.0)
    scale = tl.load(scale_ptr + frame * mod_stride + cols, mask=m, other=0.0)
    h = shift + xn * (1.0 + scale)
    if ROUND:
        h = to_bf16(h, EMULATE)
    if QUANT:
        h = tl.where(m, h, 0.0)
        s = tl.maximum(tl.max(tl.abs(h), axis=0), AMIN) / FMAX
        # a NaN stays NaN (the reference's does), so a blow-up reaches the gate
        q = tl.minimum(tl.maximum(tl.math.div_rn(h, s), -FMAX, propagate_nan=tl.PropagateNan.ALL), FMAX,
                       propagate_nan=tl.PropagateNan.ALL)
        tl.store(out_ptr + row * out_stride + cols, to_e4m3(q, EMULATE), mask=m)
        tl.store(s_ptr + row, s)
    else:
        tl.store(out_ptr + row * out_stride + cols, h.to(out_ptr.dtype.element_ty), mask=m)


#: on the GPU, the number of warps timed per row width at the first call (the interpreter has no timer)
_tuned_kernel = triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (4, 8, 16)],
                                key=["n_cols", "QUANT"])(_ffn_norm_kernel)


def _check(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, start: int, tpf: int) -> None:
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"expected the (n, dim) fp32 or bf16 residual stream, got {tuple(x.shape)} {x.dtype}")
    n, dim = x.shape
    if shift.dim() != 2 or shift.shape != scale.shape or shift.shape[1] != dim or shift.stride() != scale.stride() \
            or shift.stride(1) != 1 or shift.dtype != torch.float32 or scale.dtype != torch.float32:
        raise ValueError(f"expected (frames, {dim}) fp32 shift and scale with one layout, got "
                         f"{tuple(shift.shape)} {shift.dtype} and {tuple(scale.shape)} {scale.dtype}")
    if start < 0 or tpf <= 0 or (n and (start + n - 1) // tpf >= shift.shape[0]):
        raise ValueError(f"tokens {start}..{start + n} at {tpf} a frame do not fit {shift.shape[0]} frames")


def _launch(x, shift, scale, eps, start, tpf, out, s) -> None:
    _check(x, shift, scale, start, tpf)
    x = x if x.stride(1) == 1 else x.contiguous()
    n, dim = x.shape
    if not n:
        return
    kernel = _tuned_kernel if x.is_cuda else _ffn_norm_kernel
    quant = s is not None
    kernel[(n,)](x, shift, scale, out, s if quant else out, dim, x.stride(0), shift.stride(0), out.stride(0),
                 start, tpf, eps, BLOCK=triton.next_power_of_2(dim), ROUND=quant or out.dtype == torch.bfloat16,
                 QUANT=quant, FMAX=FP8_MAX, AMIN=MIN_AMAX, EMULATE=not x.is_cuda)


def norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, start: int, tpf: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """(n, dim) stream, rows ``start``.. of the chunk at ``tpf`` tokens a frame → the FFN's input in
    ``dtype`` (bf16 or fp32)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"expected a bf16 or fp32 output, got {dtype}")
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    _launch(x, shift, scale, eps, start, tpf, out, None)
    return out


def norm_modulate_quantize(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, start: int,
                           tpf: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm_modulate`` in bf16, as e4m3 (n, dim) codes and the per-row fp32 scale (n, 1)."""
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    s = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    _launch(x, shift, scale, eps, start, tpf, q, s)
    return q, s


def tune(rows: int, dim: int, frames: int, device: torch.device) -> str:
    """Run the autotuning of both forms now, on (rows, dim) zeros, so that it happens outside a
    compiled graph's capture; returns the chosen configurations (or "" off the GPU)."""
    if device.type != "cuda":
        return ""
    x = torch.zeros((rows, dim), dtype=torch.float32, device=device)
    mod = torch.zeros((frames, dim), dtype=torch.float32, device=device)
    tpf = -(-rows // frames)
    norm_modulate(x, mod, mod, 1e-6, 0, tpf, torch.bfloat16)
    norm_modulate_quantize(x, mod, mod, 1e-6, 0, tpf)
    return ", ".join(f"{k}: {v}" for k, v in _tuned_kernel.cache.items())
