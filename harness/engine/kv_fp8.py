"""An FP8 (e4m3) KV cache, quantised once when written, and the attention that reads it.

``fa3-fp8`` (H6b) re-quantises the whole visible K/V — 28080 tokens at 480×832 — in every forward
of every layer: statistics, scale and cast of six times the chunk's tokens, about what the FP8
kernel saves. Here K (after its RMSNorm and RoPE) and V are cast to e4m3 as they go into the pool
(``write``: only the chunk's own tokens), so a forward quantises only its queries and the chunk's
new K/V, and the kernel reads the pool (a view in the window layout, H1c; an index_select of
1-byte rows in the paged one).

**Scales.** FA3's FP8 forward takes one descale per (batch, KV head) per call, so every row a call
reads must share its head's scale. The choice here: one scale per (session, layer, KV head),
set from the per-head amax of every write while the session has no committed history (its first
chunk: all its rows are rewritten by each forward, so the scale can follow them) and frozen at
the first commit; ``HEADROOM`` leaves room above that amax, and a later value beyond the range
saturates at ±448 (e4m3's largest finite value). e4m3 keeps 3 mantissa bits over 2⁻⁶…448, so the
headroom costs precision only at the bottom of the range. K is bounded by its RMSNorm (a token's
norm is √D times the norm's gain), V is not: whether saturation bites is for the gate to say.
Scales depend only on a head's tokens, which under Ulysses SP are all on the rank holding the
head: SP 1, 2 and 4 quantise the same values the same way.

**Kernels.** ``fa3`` hands the e4m3 Q/K/V and the descales to FlashAttention-3's FP8 forward
(CUDA, Hopper; the ``fa3-fwd`` wheel). ``emulated`` is the CPU stand-in with the same e4m3 grid
and scales: dequantise, scores in fp32, P rounded to e4m3 before P·V as FA3 does, normalised by
the fp32 row sum. It also stands behind the dense backend ``fp8-emulated`` (per-call per-head
quantisation of Q, K and V, ``fa3-fp8``'s numerics), for the cross-attention of a CPU run.
"""

from __future__ import annotations

import torch
from torch import Tensor

from harness.config import HarnessConfig
from harness.engine import fa3
from harness.engine.fa3 import FP8, FP8_MAX, MIN_AMAX, quantize_heads
from harness.engine.kvcache import PagedKVCache, SessionKV
from harness.errors import HarnessError

#: the first chunk's per-head amax maps to FP8_MAX / HEADROOM
HEADROOM = 4.0


def head_scales(x: Tensor, headroom: float = HEADROOM) -> Tensor:
    """(S, H, D) → per-head scale (H,) fp32 with ``headroom`` above the amax: x ≈ x8 · scale."""
    return x.abs().amax(dim=(0, 2)).float().clamp_min(MIN_AMAX) * (headroom / FP8_MAX)


def quantize_with(x: Tensor, scale: Tensor) -> Tensor:
    """(S, H, D) → e4m3 with the given per-head scale (H,), saturating at ±FP8_MAX: ``fa3``'s
    scale-and-cast pass (one fused kernel on CUDA) over the chunk's rows only."""
    n, h, d = x.shape
    inv = (1.0 / scale).repeat_interleave(d)
    cast = fa3._compiled_cast() if x.device.type == "cuda" else fa3._cast
    return cast(x.reshape(n, h * d), inv, None).view(n, h, d)


def emulated_attention(q8: Tensor, k8: Tensor, v8: Tensor, qs: Tensor, ks: Tensor, vs: Tensor) -> Tensor:
    """FA3's FP8 numerics on any device: e4m3 (S, H, D) operands and per-head descales (H,) →
    (Sq, H, D) fp32. Scores in fp32 from the dequantised Q and K; P = exp(s − max) rounded to
    e4m3 for P·V; the output divided by the fp32 row sum of the unrounded P."""
    q = q8.float() * qs[None, :, None]
    k = k8.float() * ks[None, :, None]
    v = v8.float() * vs[None, :, None]
    s = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    p = torch.exp(s - s.amax(-1, keepdim=True))
    o = torch.einsum("hqk,khd->hqd", p.to(FP8).float(), v) / p.sum(-1, keepdim=True)
    return o.transpose(0, 1)


def _emulated_kv(q: Tensor, k8: Tensor, v8: Tensor, ks: Tensor, vs: Tensor) -> Tensor:
    q8, qs, _ = quantize_heads(q)
    return emulated_attention(q8, k8, v8, qs, ks, vs).to(q.dtype)


def _fa3_kv(q: Tensor, k8: Tensor, v8: Tensor, ks: Tensor, vs: Tensor) -> Tensor:
    fa = fa3._require(q)
    q8, qs, _ = quantize_heads(q)
    o = fa.flash_attn_func(q8[None], k8[None], v8[None], q_descale=qs[None], k_descale=ks[None], v_descale=vs[None])
    return o[0]


#: name → attention over an e4m3 cache: q (Sq, H, D), K/V e4m3 (Sk, H, D), descales (H,) → (Sq, H, D)
KERNELS = {"fa3": _fa3_kv, "emulated": _emulated_kv}


def fp8_emulated_dense(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """A dense backend, (1, H, S, D) views → (1, H, Sq, D): ``fa3-fp8``'s per-call per-head
    quantisation of Q, K and V, then the emulated FP8 attention."""
    (q8, qs, _), (k8, ks, _), (v8, vs, _) = (quantize_heads(x[0].transpose(0, 1)) for x in (q, k, v))
    return emulated_attention(q8, k8, v8, qs, ks, vs).to(q.dtype).transpose(0, 1)[None]


def _rows(pool: Tensor, ids: Tensor | slice) -> Tensor:
    """The pool's blocks ``ids`` as (tokens, H, D): a view for a slice, a copy for a block table
    (through a uint8 view: index_select/index_copy have no float8 kernels on every device)."""
    if isinstance(ids, slice):
        return pool[ids].flatten(0, 1)
    return pool.view(torch.uint8).index_select(0, ids).view(FP8).flatten(0, 1)


class Fp8KVCache(PagedKVCache):
    """``PagedKVCache`` with e4m3 pools and per-(session, layer, head) scales (module docstring)."""

    appends = False  # its pools hold e4m3 with per-head scales: only its own write may fill them

    def __init__(self, *, kernel: str, **geometry):
        if kernel not in KERNELS:
            raise HarnessError(f"unknown FP8 KV kernel {kernel!r} (known: {', '.join(KERNELS)})")
        super().__init__(dtype=FP8, **geometry)
        self.kernel = kernel
        self.num_layers = len(self.k)
        self.local_heads = self.k[0].shape[2] if self.k else 0
        #: session id → (layers, 2, heads) fp32 scales of K (0) and V (1)
        self.scales: dict[int, Tensor] = {}

    @classmethod
    def from_config(cls, cfg: HarnessConfig, *, sp: int, device: torch.device, kernel: str) -> "Fp8KVCache":
        m = cfg.model
        return cls(kernel=kernel, num_layers=m.num_layers, local_heads=m.num_heads // sp, head_dim=m.head_dim,
                   block_size=cfg.block_size, tokens_per_frame=cfg.tokens_per_frame,
                   sink_frames=cfg.cache.sink_frames, window_frames=cfg.cache.window_frames,
                   max_sessions=cfg.cache.max_sessions, device=device)

    def open(self, layout: str = "paged") -> SessionKV:
        s = super().open(layout)
        self.scales[s.sid] = torch.ones(self.num_layers, 2, self.local_heads, device=self.device)
        return s

    def free_session(self, s: SessionKV) -> None:
        super().free_session(s)
        self.scales.pop(s.sid, None)

    def write(self, layer: int, s: SessionKV, k: Tensor, v: Tensor) -> None:
        sc = self.scales[s.sid][layer]
        if s.next_frame == 0:  # no committed history yet: the scale follows the first chunk's rows
            sc[0], sc[1] = head_scales(k), head_scales(v)
        shape = (-1, self.block_size, *k.shape[1:])
        for pool, x, scale in ((self.k[layer], k, sc[0]), (self.v[layer], v, sc[1])):
            x8 = quantize_with(x, scale).reshape(shape)
            pool.view(torch.uint8).index_copy_(0, s.current_ids, x8.view(torch.uint8))

    def attend(self, layer: int, s: SessionKV, q: Tensor, kv_fn, *, attend, group_blocks: int) -> Tensor:
        """The visible e4m3 K/V with their descales through ``KERNELS[self.kernel]`` (the KV path
        and dense backend switches do not apply: this cache has one reader)."""
        ids = self.visible(s)
        ks, vs = self.scales[s.sid][layer]
        return KERNELS[self.kernel](q, _rows(self.k[layer], ids), _rows(self.v[layer], ids), ks, vs)
