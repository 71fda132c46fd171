"""FFN-up's epilogue in one Triton pass: bias add, tanh-GELU and the per-row e4m3 quantisation
that FFN-down's FP8 GEMM reads, from FFN-up's bf16 output.

Under ``torch.compile`` the same three steps become one reduction kernel, but the row (the FFN
width, 13 824 at full size) is too long for Inductor's persistent reductions: its looped kernel
reads the row twice (once for the amax, once to quantise) and computes the GELU twice, and ran
at ≈ 0.29 ms a call at 480×832 (58.8 ms a chunk, gpu-batch16) against a ≈ 0.05 ms memory floor.
Here one program holds one whole row in registers: one read, one amax, one write.

Per element it does what ``fp8_ffn.bias_gelu_quantize_reference`` (H6a's eager order) does,
rounding where it rounds (to nearest, ties to even): ``v = bf16(u + b)``, ``g = bf16(gelu_tanh(v))``
(computed in float32), ``s = max(amax|g|, MIN_AMAX) / 448`` and ``q = e4m3(clamp(g / s))``. Two
things differ, both in float32 below what the bf16 and e4m3 roundings keep: the GELU is
``v·sigmoid(2z)`` with the GPU's fast ``exp`` and division, not PyTorch's tanh, and ``g / s`` is
``g · (448 / amax)``, one division a row. A value within float32 rounding of a bf16 or e4m3
rounding boundary can so land one step away: rare (the tests count them), and one e4m3 step at
most in ``q``. A NaN stays NaN in its own code (the reference's whole row turns NaN): either way
the gate sees a non-finite latent. The per-row work is memory-light but not compute-free (an exp and a division per
element over 13 824 columns), so the kernel keeps the instruction count low; the number of warps
is autotuned per width.

Needs Triton (and a CUDA device, or the interpreter on CPU tensors); importing this module
without Triton raises ImportError, which is why only ``fp8_ffn``'s CUDA kernel imports it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.engine.fa3 import FP8, FP8_MAX, MIN_AMAX
from harness.engine.triton_round import to_bf16, to_e4m3

_SQRT_2_OVER_PI = 0.7978845608028654


@triton.jit
def _bias_gelu_quant_kernel(u_ptr, b_ptr, q_ptr, s_ptr, n_cols, u_stride, q_stride, BLOCK: tl.constexpr,
                            FMAX: tl.constexpr, AMIN: tl.constexpr, C: tl.constexpr, EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    u = tl.load(u_ptr + row * u_stride + cols, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
    v = to_bf16(u + b, EMULATE)
    # 0.5·v·(1 + tanh(z)) = v·sigmoid(2z): no cancellation where tanh(z) → −1 (v ≪ 0)
    z = C * (v + 0.044715 * (v * v * v))
    g = to_bf16(v / (1.0 + tl.exp(-2.0 * z)), EMULATE)
    g = tl.where(m, g, 0.0)
    amax = tl.maximum(tl.max(tl.abs(g), axis=0), AMIN)
    # a NaN stays NaN (as the reference's does), so a blow-up reaches the gate
    q = tl.minimum(tl.maximum(g * (FMAX / amax), -FMAX, propagate_nan=tl.PropagateNan.ALL), FMAX,
                   propagate_nan=tl.PropagateNan.ALL)
    tl.store(q_ptr + row * q_stride + cols, to_e4m3(q, EMULATE), mask=m)
    tl.store(s_ptr + row, amax / FMAX)


#: on the GPU, the number of warps timed per row width at the first call (the interpreter has no timer)
_tuned_kernel = triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (4, 8, 16, 32)],
                                key=["n_cols"])(_bias_gelu_quant_kernel)


def bias_gelu_quantize(u: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, N) bf16 FFN-up output and its (N,) bias → e4m3 (M, N) and the per-row fp32 scale (M, 1)."""
    if u.dim() != 2 or bias.shape != (u.shape[1],):
        raise ValueError(f"expected (M, N) and (N,), got {tuple(u.shape)} and {tuple(bias.shape)}")
    if u.dtype != torch.bfloat16 or bias.dtype != torch.bfloat16:
        raise ValueError(f"the kernel rounds as bf16 does: expected bf16 inputs, got {u.dtype} and {bias.dtype}")
    u = u if u.stride(1) == 1 else u.contiguous()
    m, n = u.shape
    q = torch.empty((m, n), dtype=FP8, device=u.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=u.device)
    if m:
        kernel = _tuned_kernel if u.is_cuda else _bias_gelu_quant_kernel
        kernel[(m,)](u, bias.contiguous(), q, s, n, u.stride(0), q.stride(0), BLOCK=triton.next_power_of_2(n),
                     FMAX=FP8_MAX, AMIN=MIN_AMAX, C=_SQRT_2_OVER_PI, EMULATE=not u.is_cuda)
    return q, s


def tune(rows: int, cols: int, device: torch.device) -> str:
    """Run the autotuning for ``cols`` now, on a (rows, cols) input, so that it happens outside a
    compiled graph's capture; returns the chosen configuration and every one's timing (or "" off
    the GPU)."""
    if device.type != "cuda":
        return ""
    u = torch.zeros((rows, cols), dtype=torch.bfloat16, device=device)
    bias_gelu_quantize(u, torch.zeros(cols, dtype=torch.bfloat16, device=device))
    timings = getattr(_tuned_kernel, "configs_timings", None) or {}  # Triton ≥ 3: config → [ms, …]
    return f"{_tuned_kernel.best_config} of " + ", ".join(f"{c}: {t}" for c, t in timings.items())
