"""Round-to-nearest casts for the project's Triton kernels that give the GPU's result in the
interpreter too.

On the GPU a cast to bf16 or e4m3 is one instruction that rounds to nearest, ties to even. The
interpreter (``TRITON_INTERPRET=1``, how the kernels are tested on the CPU) casts through numpy,
which truncates, so there the kernels round in integer arithmetic first and the cast after it is
exact. ``EMULATE`` picks the form: a constexpr, so the GPU's code carries none of it.

Needs Triton: only the kernel modules import this one.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_mantissa(x, BITS: tl.constexpr):
    """float32 → the nearest float32 with BITS mantissa bits (ties to even), in integer arithmetic."""
    bits = x.to(tl.uint32, bitcast=True)
    drop: tl.constexpr = 23 - BITS
    bits = ((bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) >> drop) << drop
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def to_bf16(x, EMULATE: tl.constexpr):
    """float32 → bf16 to nearest, ties to even, back in float32."""
    if EMULATE:
        return round_mantissa(x, 7)
    return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def to_e4m3(x, EMULATE: tl.constexpr):
    """|x| ≤ 448 → e4m3fn to nearest, ties to even (the GPU's cvt.rn.satfinite); in the interpreter
    3 mantissa bits down to 2⁻⁶, then the subnormals' fixed 2⁻⁹ step (an IEEE add of 1.5·2¹⁴,
    where float32's step is 2⁻⁹, and its subtraction), so that the cast after it is exact."""
    if EMULATE:
        x = tl.where(tl.abs(x) < 0.015625, (x + 24576.0) - 24576.0, round_mantissa(x, 3))
    return x.to(tl.float8e4nv)
