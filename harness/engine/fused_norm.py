"""The block's modulated LayerNorms in one Triton pass over the residual stream: the FFN's input
(H2f) — the cross-attention's residual add, LayerNorm (no affine), the per-frame modulation, the rounding to the runtime dtype and, for
an FP8 FFN, the per-row e4m3 quantisation FFN-up's GEMM reads — and the self-attention's input
with the previous block's carried FFN add in front of it (H2g).

Compiled, Inductor makes each of these one reduction kernel a block, but the stream's rows (5 120
wide at full size) are longer than the 1 024 columns it keeps in registers: its looped kernels walk
each row three times (mean, variance, then normalise-modulate-quantise, with the amax between) —
23.9 ms a steady chunk for the FFN's input and 21.1 ms for the first norm with the carried add on an
H200 at 480×832 with the stack of gpu-batch23. Here one program holds one row in registers: one read
(of the stream, and for H2g of the FFN output), the two moments, the modulation, one write (for H2g,
two: the new stream and the attention's input).

Per element they do what the block's own ops do (``ffn_norm.add_norm_modulate_reference``,
``attn_norm.add_norm_reference``): first for H2f ``x + c``, for H2g ``x + (y + bias) · gate[f]`` (the
bias add rounded to y's dtype; either sum in float32, rounded to the stream's dtype); then ``F.layer_norm`` in float32,
``shift[f] + x̂ · (1 + scale[f])`` for the token's latent frame f, rounded to bf16 (or kept
float32), and for H2f's FP8 form ``rowwise_quantize``: ``s = max(amax|h|, MIN_AMAX) / 448`` and
``q = e4m3(clamp(h / s))`` with an IEEE division, as the reference divides. What differs is below
float32's rounding: the moments are summed in another order and the GPU may contract a product and
sum into one FMA; a value within float32 rounding of a bf16 rounding boundary can so land one bf16
step away, and its code one e4m3 step (the tests count them).

Needs Triton (and a CUDA device, or the interpreter on CPU tensors); only ``ffn_norm``'s and
``attn_norm``'s CUDA kernels and the tests import this module.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.engine.fa3 import FP8, FP8_MAX, MIN_AMAX
from harness.engine.triton_round import to_bf16, to_e4m3


@triton.jit
def _modulated_norm(x, m, n_cols, eps, shift_ptr, scale_ptr, frame, mod_stride, cols):
    """One row (masked to ``m``) LayerNorm-ed and modulated by its frame's (shift, scale), float32."""
    mean = tl.sum(x, axis=0) / n_cols
    d = tl.where(m, x - mean, 0.0)
    xn = d * tl.math.rsqrt(tl.sum(d * d, axis=0) / n_cols + eps)
    shift = tl.load(shift_ptr + frame * mod_stride + cols, mask=m, other=0.0)
    scale = tl.load(scale_ptr + frame * mod_stride + cols, mask=m, other=0.0)
    return shift + xn * (1.0 + scale)


@triton.jit
def _ffn_norm_kernel(x_ptr, c_ptr, xo_ptr, shift_ptr, scale_ptr, out_ptr, s_ptr, n_cols, x_stride, c_stride,
                     mod_stride, out_stride, start, tpf, eps, BLOCK: tl.constexpr, ADD: tl.constexpr,
                     ROUND_X: tl.constexpr, ROUND: tl.constexpr, QUANT: tl.constexpr, FMAX: tl.constexpr,
                     AMIN: tl.constexpr, EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0).to(tl.float32)
    if ADD:  # the cross-attention's residual add, in the stream's dtype (H2f)
        x = x + tl.load(c_ptr + row * c_stride + cols, mask=m, other=0.0).to(tl.float32)
        if ROUND_X:
            x = to_bf16(x, EMULATE)
        tl.store(xo_ptr + row * n_cols + cols, x.to(xo_ptr.dtype.element_ty), mask=m)
    frame = (start + row) // tpf  # the rank's slice may start mid-frame (SP)
    h = _modulated_norm(x, m, n_cols, eps, shift_ptr, scale_ptr, frame, mod_stride, cols)
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


@triton.jit
def _add_norm_kernel(x_ptr, y_ptr, bias_ptr, gate_ptr, shift_ptr, scale_ptr, xo_ptr, h_ptr, n_cols, x_stride,
                     y_stride, gate_stride, mod_stride, start, tpf, eps, BLOCK: tl.constexpr, BIAS: tl.constexpr,
                     ROUND_Y: tl.constexpr, ROUND_X: tl.constexpr, ROUND_H: tl.constexpr, EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * y_stride + cols, mask=m, other=0.0).to(tl.float32)
    if BIAS:
        y = y + tl.load(bias_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if ROUND_Y:  # the FFN's bias add, in its dtype
            y = to_bf16(y, EMULATE)
    frame = (start + row) // tpf
    x = x + y * tl.load(gate_ptr + frame * gate_stride + cols, mask=m, other=0.0)
    if ROUND_X:  # a bf16 residual stream (H2b)
        x = to_bf16(x, EMULATE)
    tl.store(xo_ptr + row * n_cols + cols, x.to(xo_ptr.dtype.element_ty), mask=m)
    h = _modulated_norm(x, m, n_cols, eps, shift_ptr, scale_ptr, frame, mod_stride, cols)
    if ROUND_H:
        h = to_bf16(h, EMULATE)
    tl.store(h_ptr + row * n_cols + cols, h.to(h_ptr.dtype.element_ty), mask=m)


#: on the GPU, the number of warps timed per row width and form at the first call (the interpreter has no timer)
_WARPS = [triton.Config({}, num_warps=w) for w in (4, 8, 16)]
_tuned_kernel = triton.autotune(configs=_WARPS, key=["n_cols", "ADD", "QUANT"])(_ffn_norm_kernel)
_tuned_add_kernel = triton.autotune(configs=_WARPS, key=["n_cols", "BIAS", "ROUND_X"])(_add_norm_kernel)


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


def _launch(x, c, shift, scale, eps, start, tpf, out, s) -> torch.Tensor | None:
    """The kernel over the stream ``x`` (plus ``c`` first, unless None) into ``out`` (and the
    per-row scales ``s``, unless None); returns the summed stream (None without ``c``)."""
    _check(x, shift, scale, start, tpf)
    x = x if x.stride(1) == 1 else x.contiguous()
    xo = None
    if c is not None:
        if c.shape != x.shape or c.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"expected the {tuple(x.shape)} fp32 or bf16 cross-attention output, got "
                             f"{tuple(c.shape)} {c.dtype}")
        c = c if c.stride(1) == 1 else c.contiguous()
        xo = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, c.dtype), device=x.device)
    n, dim = x.shape
    if not n:
        return xo
    kernel = _tuned_kernel if x.is_cuda else _ffn_norm_kernel
    quant = s is not None
    add = c is not None
    kernel[(n,)](x, c if add else x, xo if add else out, shift, scale, out, s if quant else out, dim, x.stride(0),
                 c.stride(0) if add else 0, shift.stride(0), out.stride(0), start, tpf, eps,
                 BLOCK=triton.next_power_of_2(dim), ADD=add, ROUND_X=add and xo.dtype == torch.bfloat16,
                 ROUND=quant or out.dtype == torch.bfloat16, QUANT=quant, FMAX=FP8_MAX, AMIN=MIN_AMAX,
                 EMULATE=not x.is_cuda)
    return xo


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"expected a bf16 or fp32 output, got {dtype}")


def norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, start: int, tpf: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """(n, dim) stream, rows ``start``.. of the chunk at ``tpf`` tokens a frame → its modulated norm
    in ``dtype`` (bf16 or fp32): a first block's attention input (H2g)."""
    _check_dtype(dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    _launch(x, None, shift, scale, eps, start, tpf, out, None)
    return out


def ffn_input(x: torch.Tensor, c: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, start: int,
              tpf: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, dim) stream and the cross-attention's output ``c`` → the new stream ``x + c`` (a new
    tensor, in the dtype the pair promotes to) and its modulated norm, the FFN's input, in ``dtype``."""
    _check_dtype(dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    return _launch(x, c, shift, scale, eps, start, tpf, out, None), out


def ffn_input_quantize(x: torch.Tensor, c: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                       start: int, tpf: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ffn_input`` with the FFN's input in bf16 as e4m3 (n, dim) codes and the per-row fp32 scale (n, 1)."""
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    s = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    return _launch(x, c, shift, scale, eps, start, tpf, q, s), q, s


def _check_add(x, y, bias, gate, shift, residual, dtype) -> None:
    n, dim = x.shape
    if y.shape != x.shape or y.dtype not in (torch.float32, torch.bfloat16) or y.stride(1) != 1:
        raise ValueError(f"expected the ({n}, {dim}) fp32 or bf16 FFN output with unit column stride, got "
                         f"{tuple(y.shape)} {y.dtype}")
    if bias is not None and (bias.shape != (dim,) or bias.dtype != y.dtype or bias.stride(0) != 1):
        raise ValueError(f"expected a ({dim},) {y.dtype} bias, got {tuple(bias.shape)} {bias.dtype}")
    if gate.shape != shift.shape or gate.dtype != torch.float32 or gate.stride(1) != 1:
        raise ValueError(f"expected a {tuple(shift.shape)} fp32 gate, got {tuple(gate.shape)} {gate.dtype}")
    for what, d in (("residual", residual), ("output", dtype)):
        if d not in (torch.float32, torch.bfloat16):
            raise ValueError(f"expected a bf16 or fp32 {what}, got {d}")


def add_norm_modulate(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor,
                      shift: torch.Tensor, scale: torch.Tensor, eps: float, start: int, tpf: int,
                      residual: torch.dtype, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, dim) stream plus the previous block's FFN output ``y`` (+ ``bias``) · ``gate`` of each
    row's frame → the new stream in ``residual`` and its modulated norm, the self-attention's input,
    in ``dtype``. The stream is a new tensor (a CUDA graph must not mutate its input)."""
    _check(x, shift, scale, start, tpf)
    _check_add(x, y, bias, gate, shift, residual, dtype)
    x = x if x.stride(1) == 1 else x.contiguous()
    n, dim = x.shape
    xo = torch.empty(x.shape, dtype=residual, device=x.device)
    h = torch.empty(x.shape, dtype=dtype, device=x.device)
    if n:
        kernel = _tuned_add_kernel if x.is_cuda else _add_norm_kernel
        kernel[(n,)](x, y, y if bias is None else bias, gate, shift, scale, xo, h, dim, x.stride(0), y.stride(0),
                     gate.stride(0), shift.stride(0), start, tpf, eps, BLOCK=triton.next_power_of_2(dim),
                     BIAS=bias is not None, ROUND_Y=y.dtype == torch.bfloat16, ROUND_X=residual == torch.bfloat16,
                     ROUND_H=dtype == torch.bfloat16, EMULATE=not x.is_cuda)
    return xo, h


def tune(rows: int, dim: int, frames: int, device: torch.device) -> str:
    """Run the autotuning of every form now, on (rows, dim) zeros, so that it happens outside a
    compiled graph's capture; returns the chosen configurations (or "" off the GPU)."""
    if device.type != "cuda":
        return ""
    x = torch.zeros((rows, dim), dtype=torch.float32, device=device)
    mod = torch.zeros((frames, dim), dtype=torch.float32, device=device)
    tpf = -(-rows // frames)
    norm_modulate(x, mod, mod, 1e-6, 0, tpf, torch.bfloat16)
    for residual in (torch.float32, torch.bfloat16):  # the FFN's input after the add, either stream
        ffn_input(x.to(residual), x.bfloat16(), mod, mod, 1e-6, 0, tpf, torch.bfloat16)
        ffn_input_quantize(x.to(residual), x.bfloat16(), mod, mod, 1e-6, 0, tpf)
    y, bias = x.bfloat16(), torch.zeros(dim, dtype=torch.bfloat16, device=device)
    for residual in (torch.float32, torch.bfloat16):  # with the bias (H6e's FFN) and without, either stream
        for b in (bias, None):
            add_norm_modulate(x.to(residual), y, b, mod, mod, mod, 1e-6, 0, tpf, residual, torch.bfloat16)
    tuned = {**_tuned_kernel.cache, **_tuned_add_kernel.cache}
    return ", ".join(f"{k}: {v}" for k, v in tuned.items())
