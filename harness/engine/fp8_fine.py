"""FP8 attention with finer scales, or in P·V only: the numerics of H6f, emulated on any device.

H6b's FP8 attention (FlashAttention-3's FP8 forward, one descale per head for each of Q, K and V)
fails its gate on random weights; its ``smooth-early`` form passes only by running FP8 in three of
a chunk's five forwards. Two ways to spend FP8's error budget better, each on its own and together:

* **P·V only** (``pv``): Q·Kᵀ stays in the inputs' precision (scores in fp32), the softmax's P and V
  go through e4m3. P = exp(s − rowmax) lies in (0, 1], so it is scaled by 448 before its cast and
  uses e4m3's whole range (FA3 casts P unscaled, where values under 2⁻⁶ lose bits); V gets one scale
  per (head, channel) over the keys, which factors out of the sum exactly. The output is divided
  by the fp32 row sum of the unrounded P, as FA3 does.
* **Per-block Q/K scales** (``qk-block``): K gets one scale per (head, block of ``K_BLOCK`` keys)
  and Q one per (head, query row) — a block of one row, the finest, and the one block size that
  no SP split can move (under Ulysses a rank's cross-attention queries are its own tokens; its
  self-attention queries and every K are the head's whole sequence, so every scale here is the
  same on 1, 2 or 4 ranks). Scores from the e4m3 operands times the outer product of the scales;
  P·V in the inputs' precision.
* ``qk-block+pv``: both.

This module answers the gate's question — does the rounding pass — at any size on any device,
slowly (the scores of ``Q_CHUNK`` queries at a time are materialised in fp32): the dense backends
``fp8-<mode>-emulated``. The kernel that answers what a placement buys is
``engine/fused_fp8_attention`` (Triton, FlashAttention's single pass with these scales), the dense
backends ``fp8-<mode>``, on CUDA only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from harness.engine.fa3 import FP8, FP8_MAX, MIN_AMAX

#: keys per K scale (FA3's and SageAttention's tile along the keys)
K_BLOCK = 128
#: queries whose fp32 scores are materialised at once: bounds the emulation's memory
#: (40 heads × 1024 × 14040 keys × 4 B ≈ 2.3 GB at 480×832 on one rank)
Q_CHUNK = 1024
MODES = {"pv": (False, True), "qk-block": (True, False), "qk-block+pv": (True, True)}


def e4m3_codes(x: Tensor, scale: Tensor | float) -> Tensor:
    """x / scale rounded to e4m3 (saturating at ±448): an FP8 operand's codes."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def to_e4m3(x: Tensor, scale: Tensor | float) -> Tensor:
    """``e4m3_codes`` back in fp32 and still divided by the scale: the values an FP8 operand holds."""
    return e4m3_codes(x, scale).float()


def amax_scale(x: Tensor, dim: int | tuple[int, ...]) -> Tensor:
    """The scale that maps the amax over ``dim`` to 448 (kept dims)."""
    return x.abs().amax(dim=dim, keepdim=True).clamp_min(MIN_AMAX) / FP8_MAX


def block_amax_scales(k: Tensor, block: int = K_BLOCK) -> Tensor:
    """(H, Sk, D) fp32 → one scale per (head, block of ``block`` keys) (H, ⌈Sk / block⌉), the last
    block partial."""
    h, sk, d = k.shape
    pad = -sk % block
    padded = torch.nn.functional.pad(k, (0, 0, 0, pad)) if pad else k
    return amax_scale(padded.view(h, -1, block, d), dim=(2, 3))[:, :, 0, 0]


def key_block_scales(k: Tensor, block: int = K_BLOCK) -> Tensor:
    """(H, Sk, D) fp32 → per-(head, key) scale (H, Sk, 1): each block of ``block`` keys shares its amax's."""
    return block_amax_scales(k, block).repeat_interleave(block, dim=1)[:, :k.shape[1], None]


def attention(q: Tensor, k: Tensor, v: Tensor, *, qk_block: bool, pv: bool) -> Tensor:
    """(H, Sq, D), (H, Sk, D), (H, Sk, D) in any float dtype → (H, Sq, D) fp32 with H6f's rounding."""
    q, k, v = q.float(), k.float(), v.float()
    if qk_block:
        qs = amax_scale(q, dim=2)  # (H, Sq, 1): per query row
        q = to_e4m3(q, qs) * qs
        ks = key_block_scales(k)
        k = to_e4m3(k, ks) * ks
    vs = amax_scale(v, dim=1) if pv else None  # (H, 1, D): per (head, channel), over the keys
    v8 = to_e4m3(v, vs) if pv else v
    scale = q.shape[-1] ** -0.5
    out = []
    for i in range(0, q.shape[1], Q_CHUNK):
        s = torch.einsum("hqd,hkd->hqk", q[:, i:i + Q_CHUNK], k) * scale
        p = torch.exp(s - s.amax(-1, keepdim=True))
        if pv:
            o = torch.einsum("hqk,hkd->hqd", to_e4m3(p, 1.0 / FP8_MAX), v8) * vs * (1.0 / FP8_MAX)
        else:
            o = torch.einsum("hqk,hkd->hqd", p, v8)
        out.append(o / p.sum(-1, keepdim=True))
    return torch.cat(out, dim=1)


def dense(mode: str):
    """The dense backend of ``mode``: (1, H, S, D) views → (1, H, Sq, D) in q's dtype."""
    qk_block, pv = MODES[mode]

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attention(q[0], k[0], v[0], qk_block=qk_block, pv=pv).to(q.dtype)[None]

    return attend


def backend_name(mode: str) -> str:
    return f"fp8-{mode}-emulated"


def kernel_name(mode: str) -> str:
    return f"fp8-{mode}"
