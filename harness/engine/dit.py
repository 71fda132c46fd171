"""The LingBot-World DiT (Wan2.1-14B-like, camera-controlled, causal over chunks) in one file.

Module and parameter names are the checkpoint's (DESIGN §2), so real weights load with
``load_state_dict``. What differs from the offline Wan model is only how a forward is fed:

* one call denoises (or commits) one chunk of F latent frames; self-attention sees the session's
  paged KV cache (sink + recent frames + this chunk), whose K is stored RoPE-rotated at absolute
  latent-frame positions;
* under Ulysses SP each rank holds a contiguous slice of the chunk's tokens, and self-attention
  runs on all tokens of the rank's heads between two all-to-alls;
* modulation comes from one timestep per latent frame and is broadcast over that frame's tokens;
* the text K/V of cross-attention are computed once per session (``text_kv``), for all heads:
  cross-attention runs on the rank's own tokens with every head, with no all-to-all (the text is
  short, so holding all of its K/V on every rank costs ≈ 0.4 GB at full size, and under SP it
  saves two of a block's four all-to-alls, a third of their traffic).

Numerics follow Wan's: parameters and GEMM inputs/outputs are in the runtime dtype (bf16 on GPU,
fp32 for the tiny CPU preset), but the residual stream, every norm, the modulation, RoPE and the
gated residual adds are fp32, rounded to the runtime dtype only where a GEMM or an attention
kernel reads them. Besides matching the reference model, this is what lets the compiled mode pass
the threshold gate against eager: a bf16 rounding between two elementwise ops is exactly what
inductor's fusion removes, so eager must not have one there either. The velocity leaves the model
in fp32 for the scheduler. vLLM-Omni's transformer keeps the residual stream in the model dtype
instead, rounding it after each of a block's four residual updates; ``ForwardContext.residual``
(H2b) does the same, with its camera update in that dtype's arithmetic as production's is. Norms,
modulation and RoPE stay fp32 either way; rounding points are explicit casts, which inductor keeps
(``emulate_precision_casts``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from harness.config import ModelConfig
from harness.engine.attention import (AppendFn, AttentionChoice, DenseFn, KvPathFn, OutputBuffers, cross_attention,
                                      settle, writing_into)
from harness.engine.groups import RankGroup
from harness.engine.kvcache import PagedKVCache, SessionKV
from harness.engine.static_inputs import StaticInputs
from harness.engine.ulysses import gather_tokens, heads_to_seq, seq_to_heads
from harness.errors import HarnessError
from harness.hooks import context as hctx
from harness.limits import ROPE_MAX_FRAMES  # one definition: the up-front session checks read it too

ROPE_THETA = 10000.0

#: Parameters of the full-size model (both lingbot presets share it): 40 blocks × 456,272,384
#: (12·dim² attention + camera GEMMs, 2·dim·ffn FFN, biases, norms, modulation) + 293,099,520 in the
#: embeddings (time_projection alone is 6·dim²) + 337,984 in the head. Checked by the tests.
FULL_SIZE_PARAMETERS = 18_544_332_864


# ---- token layout, RoPE, timestep embedding ------------------------------------------------------
class TokenLayout:
    """Which tokens of a chunk (frame-major, then h, w) this rank holds, and how they split by frame.

    Modulation is one vector per latent frame; a rank's contiguous token slice may start or end
    mid-frame (e.g. 1170 of 1560 tokens at SP4, 480×832), so broadcasting goes per frame segment,
    or as one reshaped op when the slice is made of whole frames.
    """

    def __init__(self, frames: int, tokens_per_frame: int, start: int, end: int):
        self.frames, self.tpf, self.start, self.end = frames, tokens_per_frame, start, end
        self.n = end - start
        self.aligned = start % tokens_per_frame == 0 and self.n % tokens_per_frame == 0
        segs, a = [], start
        while a < end:
            f = a // tokens_per_frame
            b = min(end, (f + 1) * tokens_per_frame)
            segs.append((f, a - start, b - start))
            a = b
        self.segments = tuple(segs)

    def modulate(self, x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
        """x·(1 + scale[f]) + shift[f] for each token's frame f; shift/scale (frames, dim), in
        their common dtype (fp32 in the blocks)."""
        if self.aligned:
            f0, k = self.start // self.tpf, self.n // self.tpf
            out = torch.addcmul(shift[f0 : f0 + k, None], x.view(k, self.tpf, -1), 1 + scale[f0 : f0 + k, None])
            return out.view(self.n, -1)
        out = torch.empty_like(x)
        for f, a, b in self.segments:
            torch.addcmul(shift[f], x[a:b], 1 + scale[f], out=out[a:b])
        return out

    def gated_add(self, x: Tensor, y: Tensor, gate: Tensor) -> Tensor:
        """x + y·gate[f], computed in fp32 (the gate is; y may be bf16): x's dtype for the fp32
        residual stream, the caller rounds any other (H2b). A new tensor, not an in-place add: a
        CUDA graph must not mutate its inputs, and x is one."""
        if self.aligned:
            f0, k = self.start // self.tpf, self.n // self.tpf
            out = torch.addcmul(x.view(k, self.tpf, -1), y.view(k, self.tpf, -1), gate[f0 : f0 + k, None])
            return out.view(self.n, -1)
        out = torch.empty_like(x)  # the segments tile the slice: every row is written once
        for f, a, b in self.segments:
            torch.addcmul(x[a:b], y[a:b], gate[f], out=out[a:b])
        return out


def rope_dims(head_dim: int) -> tuple[int, int, int]:
    """Channels of each head given to the (frame, h, w) axes: Wan's d − 4⌊d/6⌋, 2⌊d/6⌋, 2⌊d/6⌋."""
    d = head_dim // 6
    return head_dim - 4 * d, 2 * d, 2 * d


class RopeTables:
    """The 3-D RoPE rotation of this rank's tokens as complex numbers, precomputed on the device.

    Angles are built in float64 on the host once (positions up to 1024 would lose ~1e-4 rad in
    fp32 angle arithmetic) and stored as fp32 cos/sin; a chunk only slices the frame table at its
    absolute first frame and gathers rows, so no host value crosses to the device per step.
    """

    def __init__(self, head_dim: int, grid: tuple[int, int, int], layout: TokenLayout, device: torch.device,
                 max_frames: int = ROPE_MAX_FRAMES):
        df, dh, dw = rope_dims(head_dim)
        frames, h, w = grid
        self.frames, self.max_frames = frames, max_frames

        def table(n: int, d: int) -> tuple[Tensor, Tensor]:
            inv = ROPE_THETA ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
            ang = torch.outer(torch.arange(n, dtype=torch.float64), inv)
            return ang.cos().float(), ang.sin().float()

        tok = torch.arange(layout.start, layout.end)
        fi, hi, wi = tok // (h * w), tok // w % h, tok % w
        cf, sf = table(max_frames, df)
        ch, sh = table(h, dh)
        cw, sw = table(w, dw)
        self.cos_f, self.sin_f = cf.to(device), sf.to(device)
        self.fi = fi.to(device)
        self.cos_hw = torch.cat([ch[hi], cw[wi]], dim=-1).to(device)
        self.sin_hw = torch.cat([sh[hi], sw[wi]], dim=-1).to(device)

    def for_chunk(self, first_frame: int) -> Tensor:
        """fp32 (n_local, 1, head_dim/2, 2), (cos, sin) pairs: the rotation at absolute frames
        first_frame + 0..F−1 (a complex64 tensor by ``view_as_complex``, without a copy)."""
        last = first_frame + self.frames
        if last > self.max_frames:
            raise HarnessError(f"session exceeds {self.max_frames} latent frames (RoPE table); start a new session")
        cos = torch.cat([self.cos_f[first_frame:last].index_select(0, self.fi), self.cos_hw], dim=-1)
        sin = torch.cat([self.sin_f[first_frame:last].index_select(0, self.fi), self.sin_hw], dim=-1)
        return torch.stack([cos, sin], dim=-1).unsqueeze(1)


def apply_rope(x: Tensor, rot: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Rotate consecutive channel pairs (Wan's complex layout) of x (n, H, D) in fp32 by ``rot``
    (``RopeTables.for_chunk``); returns ``dtype`` (default: x's).

    Eager runs one complex multiply rather than 6 real ops and a stack (RoPE was ~8 % of a 480×832
    chunk that way). Inductor has no complex code generation (it calls the unfused aten kernel),
    so traced code writes the same rotation in real arithmetic, which fuses with the norm before
    it and the cast after it."""
    n, h, d = x.shape
    xr = x.float().reshape(n, h, d // 2, 2)
    if torch.compiler.is_compiling():
        x0, x1, c, s = xr[..., 0], xr[..., 1], rot[..., 0], rot[..., 1]
        out = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)
    else:
        out = torch.view_as_real(torch.view_as_complex(xr) * torch.view_as_complex(rot))
    return out.flatten(2).to(dtype or x.dtype)


def sinusoidal(timesteps: list[float] | Tensor, dim: int) -> Tensor:
    """Wan's timestep embedding: [cos, sin] of t·10000^(−i/half), computed in float64, returned fp32."""
    t = torch.as_tensor(timesteps, dtype=torch.float64)
    half = dim // 2
    ang = torch.outer(t, torch.pow(10000.0, -torch.arange(half, dtype=torch.float64) / half))
    return torch.cat([ang.cos(), ang.sin()], dim=1).float()


# ---- per-chunk state the blocks read -------------------------------------------------------------
class CameraModulation:
    """The engine's seam for the per-block camera injection: ``block`` returns block i's
    (scale, shift) in each of a chunk's forwards. This default recomputes them every forward; a
    candidate (H2a) installs a subclass that keeps them for the chunk. ``needs_tokens`` says
    whether a forward must compute the model-level camera MLP (an input of ``block``)."""

    def needs_tokens(self, blocks: int) -> bool:
        return True

    def block(self, i: int, camera, c: Tensor | None) -> tuple[Tensor, Tensor]:
        return camera(c)

    def end_chunk(self) -> None:
        """The chunk's last forward ran: drop whatever was kept for it."""


#: (QKV output, the SelfAttention, rope, kv_dest) → (q, k, v): ``ForwardContext.qk``
QkFn = Callable[[Tensor, "SelfAttention", Tensor, "tuple[Tensor, Tensor, Tensor] | None"],
                "tuple[Tensor, Tensor | None, Tensor | None]"]
#: (the block's FFN, stream, cross-attention output, shift, scale, eps, layout, dtype) → (the stream
#: after the cross-attention's add, FFN output, bias still to add): ``ForwardContext.ffn_in``
FfnInFn = Callable[[nn.Module, Tensor, Tensor, Tensor, Tensor, float, "TokenLayout", torch.dtype],
                   "tuple[Tensor, Tensor, Tensor | None]"]
#: (stream, carried or None, shift, scale, eps, layout, dtype, residual) → (stream, attention input): ``ForwardContext.attn_in``
AttnInFn = Callable[[Tensor, "tuple[Tensor, Tensor | None, Tensor] | None", Tensor, Tensor, float, "TokenLayout",
                     torch.dtype, torch.dtype], "tuple[Tensor, Tensor]"]


@dataclass
class ForwardContext:
    group: RankGroup
    layout: TokenLayout
    grid: tuple[int, int, int]  # (frames, h, w) in patches
    rope: Tensor  # (n_local, 1, head_dim/2, 2) cos/sin pairs
    cache: PagedKVCache
    kv: SessionKV
    text_kv: list[tuple[Tensor, Tensor]]  # per layer, (1, H, L, D): every head on every rank
    group_blocks: int  # blocks per step of the paged KV path
    kv_fn: KvPathFn | None = None  # resolved from the model's AttentionChoice at each forward
    attend: DenseFn | None = None
    attend_writes_into: bool = False  # ``attend`` takes out= (attention.WRITES_INTO)
    #: the dense kernel's appending form when the chunk's K/V are to be written by it (H1e), else None
    append: AppendFn | None = None
    #: "append": the attention kernel writes the chunk's K/V where it can (H1e); "graph": the
    #: block's traced code writes them where it makes them (H1f, ``kv_destination``); "copy"
    kv_write: str = "copy"
    #: where the attention cores leave their results (H1d); None: a new tensor every call
    outputs: OutputBuffers | None = None
    #: the residual stream's dtype: fp32, or the runtime dtype as vLLM-Omni keeps it (H2b)
    residual: torch.dtype = torch.float32
    #: where a block's last residual add (the gated FFN output) runs: "own" (the block's end) or
    #: "next" (the next block's start, fused with its first norm; the head's for the last: H2c)
    ffn_residual: str = "own"
    #: the self-attention's q/k norms + RoPE (and, with ``kv_dest``, the K/V store) as one op:
    #: (QKV output, the SelfAttention, rope, kv_dest) → (q, k, v), k and v None where stored (H2d,
    #: ``qk_norm_rope.fused_qk``); None: the module's own ops
    qk: QkFn | None = None
    #: the FFN from the stream, its input (the cross-attention's residual add, norm, modulation,
    #: rounding, FP8 quantisation) made by one op: (ffn, x, cross-attention output, shift, scale,
    #: eps, layout, dtype) → (the new stream, output, bias still to add) (H2f,
    #: ``ffn_norm.fused_ffn``); None: the module's own ops
    ffn_in: FfnInFn | None = None
    #: the self-attention's input with the carried FFN add (H2c) in front, made by one op: (x,
    #: carried, shift, scale, eps, layout, dtype, residual) → (the new stream, the input) (H2g,
    #: ``attn_norm.fused_attn_in``); None: the module's own ops
    attn_in: AttnInFn | None = None
    #: where the host-made values the blocks read (modulation, camera tokens) are handed on: None,
    #: fresh tensors; or persistent static-address buffers, read in place by CUDA graphs (H1g)
    inputs: StaticInputs | None = None
    #: Where each block's camera (scale, shift) comes from in this chunk's forwards (one object
    #: per chunk, made by ``DitEngine.camera_modulation``).
    camera: CameraModulation = field(default_factory=CameraModulation)

    def kv_destination(self, layer: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """Where block ``layer``'s own code writes the chunk's K/V (H1f: ``store_kv``), or None:
        the attention core copies them ("copy"), the kernel appends them ("append"), the cache
        stores something else than K/V (FP8), or under SP, where the chunk's K/V reach their
        heads' ranks only in the core's all-to-all. Read outside traced code (the layer index)."""
        if self.kv_write != "graph" or self.group.active:
            return None
        return self.cache.graph_destination(layer, self.kv)


# ---- modules -------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Returns fp32: its callers rotate (RoPE) or round it themselves."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm32(x, self.weight, self.eps)


def rms_norm32(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim in fp32: x · rsqrt(mean(x²) + eps) · weight."""
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps)


def layer_norm32(x: Tensor, eps: float, norm: nn.LayerNorm | None = None) -> Tensor:
    """LayerNorm of the residual stream in fp32, with ``norm``'s affine parameters if given."""
    w, b = (None, None) if norm is None else (norm.weight.float(), norm.bias.float())
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps)


def camera_update(x: Tensor, scale: Tensor, shift: Tensor) -> Tensor:
    """x·(1 + scale) + shift: in fp32 on the fp32 residual stream, and in the stream's own dtype
    otherwise, as vLLM-Omni's block computes it (scale and shift are the GEMMs' bf16 outputs)."""
    if x.dtype == torch.float32:
        return torch.addcmul(shift.float(), x, scale.float() + 1)
    return ((1 + scale) * x + shift).to(x.dtype)


class _Attention(nn.Module):
    """The projections both attentions share, under the checkpoint's names (q, k, v, o, norm_q,
    norm_k). ``layer`` picks the KV pool / text K/V; it is read only outside compiled code."""

    def __init__(self, dim: int, heads: int, eps: float, dtype: torch.dtype, layer: int = 0):
        super().__init__()
        self.layer = layer
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.q = nn.Linear(dim, dim, dtype=dtype)
        self.k = nn.Linear(dim, dim, dtype=dtype)
        self.v = nn.Linear(dim, dim, dtype=dtype)
        self.o = nn.Linear(dim, dim, dtype=dtype)
        self.norm_q = RMSNorm(dim, eps, dtype)
        self.norm_k = RMSNorm(dim, eps, dtype)


class SelfAttention(_Attention):
    """q/k/v keep their checkpoint names, but after ``fuse_qkv_`` they are views into one
    (3·dim, dim) weight, so the forward is a single GEMM and no memory is duplicated."""

    def __init__(self, dim: int, heads: int, eps: float, dtype: torch.dtype, layer: int = 0):
        super().__init__(dim, heads, eps, dtype, layer)
        self._qkv_w: Tensor | None = None  # deliberately unregistered: module moves must not split it
        self._qkv_b: Tensor | None = None

    def fuse_qkv_(self) -> None:
        """(Re)bind q, k, v parameters as views of one fused weight; needed after any device/dtype move."""
        w = torch.cat([self.q.weight, self.k.weight, self.v.weight]).detach()
        b = torch.cat([self.q.bias, self.k.bias, self.v.bias]).detach()
        for i, lin in enumerate((self.q, self.k, self.v)):
            lin.weight = nn.Parameter(w[i * self.dim : (i + 1) * self.dim], requires_grad=False)
            lin.bias = nn.Parameter(b[i * self.dim : (i + 1) * self.dim], requires_grad=False)
        self._qkv_w, self._qkv_b = w, b

    def forward(self, x: Tensor, ctx: ForwardContext, kv_dest: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
        """``kv_dest`` (``ForwardContext.kv_destination``): the chunk's K/V go into the cache here,
        where they are made, and the attention core reads them from there (H1f)."""
        w = self._qkv_w
        if w is None or w.device != self.q.weight.device or w.dtype != self.q.weight.dtype:
            raise HarnessError("fused QKV is stale: call model.fuse_qkv_() after moving or casting the model")
        n, h, d = x.shape[0], self.heads, self.head_dim
        qkv = F.linear(x, w, self._qkv_b)
        if ctx.qk is not None:  # H2d: the norms, RoPE and the K/V store in one op
            q, k, v = ctx.qk(qkv, self, ctx.rope, kv_dest)
        else:
            q, k, v = qkv.split(self.dim, dim=-1)
            q = apply_rope(self.norm_q(q).view(n, h, d), ctx.rope, x.dtype)
            k = apply_rope(self.norm_k(k).view(n, h, d), ctx.rope, x.dtype)
            v = v.view(n, h, d)
            if kv_dest is not None:
                store_kv(kv_dest, k, v)
                k = v = None
        return self.o(attend_cache(self, q, k, v, ctx).reshape(n, self.dim))


class CrossAttention(_Attention):
    def text_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """K/V of the embedded text (L, dim), all heads: (1, H, L, D) each, once per session."""
        n, h, d = context.shape[0], self.heads, self.head_dim
        k = self.norm_k(self.k(context)).to(context.dtype).view(n, h, d)
        v = self.v(context).view(n, h, d)
        return k.transpose(0, 1).unsqueeze(0).contiguous(), v.transpose(0, 1).unsqueeze(0).contiguous()

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        n = x.shape[0]
        q = self.norm_q(self.q(x)).to(x.dtype).view(n, self.heads, self.head_dim)
        return self.o(attend_text(self, q, ctx).reshape(n, self.dim))


def store_kv(dest: tuple[Tensor, Tensor, Tensor], k: Tensor, v: Tensor) -> None:
    """The chunk's k, v (n, H, D) into their blocks of the pools ``dest`` (K pool, V pool, block
    ids), from the block's own code (H1f). Compiled, the store is part of the graph, so inductor
    fuses it into the kernels that make K (the norm + RoPE kernel stores straight into the pool)
    and V, and no copy kernel runs between the graph and the attention core; in eager it is the
    same ``index_copy_`` the paged cache's write runs, so the values are the same either way."""
    k_pool, v_pool, ids = dest
    shape = (-1, k_pool.shape[1], *k.shape[1:])
    k_pool.index_copy_(0, ids, k.reshape(shape))
    v_pool.index_copy_(0, ids, v.reshape(shape))


# The attention cores run outside compiled graphs (``torch.compiler.disable``: a graph break in
# compiled mode, a plain call in eager). They hold everything a compiled block must not see: the
# self-attention K length grows chunk by chunk until the window saturates, the KV pool write and
# the SP all-to-alls are side effects, and the kernel is picked by runtime switches (H1a/H1b).
# So a compiled block has the same shapes in every chunk (nothing recompiles after the first
# forward) and runs exactly the attention kernels eager runs. The layer index is read here, never
# in traced code: dynamo would specialise on the int and compile every layer separately.
@torch.compiler.disable
def attend_cache(attn: SelfAttention, q: Tensor, k: Tensor, v: Tensor, ctx: ForwardContext) -> Tensor:
    """Chunk q/k/v (n_local, H, D) → attention output (n_local, H, D) over cache + chunk (with
    output buffers, H1d: the role's persistent (n_local, H·D) view holding it). k, v None: the
    block wrote them into the cache already (H1f)."""
    layer = attn.layer
    out = None if ctx.outputs is None else ctx.outputs.take("self_attention", q)
    if ctx.group.active:
        q, k, v = seq_to_heads((q, k, v), ctx.group)
    into = out is not None and not ctx.group.active  # SP: the all-to-all allocates the result
    if ctx.append is not None and ctx.cache.can_append(ctx.kv):
        append = functools.partial(ctx.append, out=out.rows) if into and ctx.attend_writes_into else ctx.append
        with hctx.phase(role="self_attention"):
            o = ctx.cache.attend_appending(layer, ctx.kv, q, k, v, append=append)
    else:
        if k is not None:
            ctx.cache.write(layer, ctx.kv, k, v)
        attend = writing_into(ctx.attend, out) if into and ctx.attend_writes_into else ctx.attend
        with hctx.phase(role="self_attention"):
            o = ctx.cache.attend(layer, ctx.kv, q, ctx.kv_fn, attend=attend, group_blocks=ctx.group_blocks)
    o = heads_to_seq(o, ctx.group)
    return o if out is None else settle(o, out)


@torch.compiler.disable
def attend_text(attn: CrossAttention, q: Tensor, ctx: ForwardContext) -> Tensor:
    """The rank's own queries (n_local, H, D), every head, over the session's cached text K/V:
    sequence-local, so no collective (see the module docstring). Returns what ``attend_cache``
    returns."""
    k, v = ctx.text_kv[attn.layer]
    out = None if ctx.outputs is None else ctx.outputs.take("cross_attention", q)
    attend = writing_into(ctx.attend, out) if out is not None and ctx.attend_writes_into else ctx.attend
    with hctx.phase(role="cross_attention"):
        o = cross_attention(q, k, v, attend=attend)
    return o if out is None else settle(o, out)


class Block(nn.Module):
    def __init__(self, m: ModelConfig, dtype: torch.dtype, layer: int = 0):
        super().__init__()
        dim, self.eps = m.dim, m.eps
        self.self_attn = SelfAttention(dim, m.num_heads, m.eps, dtype, layer)
        self.norm3 = nn.LayerNorm(dim, eps=m.eps, elementwise_affine=True, dtype=dtype)
        self.cross_attn = CrossAttention(dim, m.num_heads, m.eps, dtype, layer)
        self.ffn = nn.Sequential(nn.Linear(dim, m.ffn_dim, dtype=dtype), nn.GELU(approximate="tanh"),
                                 nn.Linear(m.ffn_dim, dim, dtype=dtype))
        self.modulation = nn.Parameter(torch.zeros(1, 6, dim, dtype=dtype))
        self.cam_injector_layer1 = nn.Linear(dim, dim, dtype=dtype)
        self.cam_injector_layer2 = nn.Linear(dim, dim, dtype=dtype)
        self.cam_scale_layer = nn.Linear(dim, dim, dtype=dtype)
        self.cam_shift_layer = nn.Linear(dim, dim, dtype=dtype)


    def camera(self, c: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token (scale, shift) from the camera state. Its input is the same in all 5 forwards
        of a chunk (the camera chunk cache, H2a, evaluates it once). A separate call rather than part
        of ``forward`` so that, compiled, the block graph is the same with and without that cache."""
        h = self.cam_injector_layer2(F.silu(self.cam_injector_layer1(c))) + c
        return self.cam_scale_layer(h), self.cam_shift_layer(h)

    def forward(self, x: Tensor, e0: Tensor, cam: tuple[Tensor, Tensor], ctx: ForwardContext,
                kv_dest: tuple[Tensor, Tensor, Tensor] | None = None,
                carried: tuple[Tensor, Tensor | None, Tensor] | None = None) -> Tensor | tuple[Tensor, ...]:
        """x: the residual stream (n_local, dim), fp32 or ``ctx.residual``; e0 (frames, 6, dim)
        fp32; ``cam``: this block's ``camera(c)``; ``kv_dest``: see ``SelfAttention.forward``.
        norm1/norm2 are LayerNorms without affine parameters. With ``ctx.ffn_residual == "next"``
        (H2c) the block starts with the previous block's last residual add (``carried``: its FFN
        output, the bias still to add to it or None, and its gate), so that compiled it fuses with
        this block's first norm instead of writing the stream and reading it back across a graph
        boundary, and returns (x, its FFN output, bias, gate) unadded."""
        lay, dt = ctx.layout, self.modulation.dtype
        mod = (self.modulation.float() + e0).unbind(1)
        shift_msa, scale_msa, gate_msa, shift_ffn, scale_ffn, gate_ffn = mod
        if ctx.attn_in is not None:  # the carried add goes into the op (H2g)
            x, h = ctx.attn_in(x, carried, shift_msa, scale_msa, self.eps, lay, dt, ctx.residual)
        else:
            if carried is not None:
                x = carried_add(lay, x, carried, ctx.residual)
            h = lay.modulate(layer_norm32(x, self.eps), shift_msa, scale_msa).to(dt)
        y = self.self_attn(h, ctx, kv_dest)
        x = lay.gated_add(x, y, gate_msa).to(ctx.residual)
        x = camera_update(x, *cam)
        c = self.cross_attn(layer_norm32(x, self.eps, self.norm3).to(dt), ctx)
        if ctx.ffn_in is not None:  # the cross-attention's add goes into the op (H2f)
            x, y, bias = ctx.ffn_in(self.ffn, x, c, shift_ffn, scale_ffn, self.eps, lay, dt)
        else:
            x = x + c
            y, bias = ffn_unbiased(self.ffn, lay.modulate(layer_norm32(x, self.eps), shift_ffn, scale_ffn).to(dt))
        if ctx.ffn_residual == "next":
            return x, y, bias, gate_ffn
        return carried_add(lay, x, (y, bias, gate_ffn), ctx.residual)


def ffn_unbiased(ffn: nn.Module, h: Tensor) -> tuple[Tensor, Tensor | None]:
    """The FFN's output and the bias still to add to it: an FFN whose last bias add runs outside
    its GEMM (the FP8 FFN's, ``fp8_ffn.Fp8Ffn``) leaves it to the carried add (H2c), which fuses it
    into the next block's norm kernel; any other FFN adds its own (bf16: in the GEMM's epilogue)."""
    unbiased = getattr(ffn, "unbiased", None)
    return unbiased(h) if unbiased is not None else (ffn(h), None)


def carried_add(layout: TokenLayout, x: Tensor, carried: tuple[Tensor, Tensor | None, Tensor],
                residual: torch.dtype) -> Tensor:
    """A block's last residual add, carried out of it (H2c): x + (FFN output + the bias it still
    lacks, in its dtype, as the FFN adds it) · gate, rounded to the stream."""
    y, bias, gate = carried
    if bias is not None:
        y = y + bias
    return layout.gated_add(x, y, gate).to(residual)


class Head(nn.Module):
    def __init__(self, m: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.eps = m.eps
        self.head = nn.Linear(m.dim, m.out_channels * math.prod(m.patch_size), dtype=dtype)
        self.modulation = nn.Parameter(torch.zeros(1, 2, m.dim, dtype=dtype))

    def forward(self, x: Tensor, e: Tensor, layout: TokenLayout) -> Tensor:
        """x the residual stream, e (frames, dim) fp32."""
        shift, scale = (self.modulation.float() + e[:, None]).unbind(1)
        x = layout.modulate(layer_norm32(x, self.eps), shift, scale)
        return self.head(x.to(self.head.weight.dtype))


class WanDiT(nn.Module):
    def __init__(self, m: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = m
        dim, patch = m.dim, m.patch_size
        self.patch_embedding = nn.Conv3d(m.in_channels, dim, kernel_size=patch, stride=patch, dtype=dtype)
        self.patch_embedding_wancamctrl = nn.Linear(m.cam_channels * math.prod(patch), dim, dtype=dtype)
        self.c2ws_hidden_states_layer1 = nn.Linear(dim, dim, dtype=dtype)
        self.c2ws_hidden_states_layer2 = nn.Linear(dim, dim, dtype=dtype)
        self.text_embedding = nn.Sequential(nn.Linear(m.text_dim, dim, dtype=dtype), nn.GELU(approximate="tanh"),
                                            nn.Linear(dim, dim, dtype=dtype))
        self.time_embedding = nn.Sequential(nn.Linear(m.freq_dim, dim, dtype=dtype), nn.SiLU(),
                                            nn.Linear(dim, dim, dtype=dtype))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim, dtype=dtype))
        self.blocks = nn.ModuleList([Block(m, dtype, i) for i in range(m.num_layers)])
        self.head = Head(m, dtype)
        #: The attention kernels every forward runs; replaced whole between forwards.
        self.attention_choice = AttentionChoice()
        #: Per block, the compiled (forward, camera) pair; None runs the blocks eagerly.
        self.compiled_blocks: tuple[tuple, ...] | None = None
        #: The last block's carried residual add (H2c); compiled with the blocks, so that it is the
        #: same generated code as the add it replaces at the end of a compiled block
        self.last_add = carried_add

    def fuse_qkv_(self) -> "WanDiT":
        for b in self.blocks:
            b.self_attn.fuse_qkv_()
        return self

    # -- once per session / chunk --
    def text_kv(self, text: Tensor) -> list[tuple[Tensor, Tensor]]:
        context = self.text_embedding(text)
        return [b.cross_attn.text_kv(context) for b in self.blocks]

    def camera_tokens(self, rays: Tensor, layout: TokenLayout) -> Tensor:
        """(384, F, H, W) ray map → this rank's (n_local, 384·prod(patch)) patch vectors, ordered
        (channel, pt, ph, pw) as the checkpoint's patch_embedding_wancamctrl expects."""
        c, f, hh, ww = rays.shape
        pt, ph, pw = self.cfg.patch_size
        x = rays.view(c, f // pt, pt, hh // ph, ph, ww // pw, pw).permute(1, 3, 5, 0, 2, 4, 6)
        return x.reshape(-1, c * pt * ph * pw)[layout.start : layout.end]

    # -- one forward over a chunk --
    def forward(self, x_in: Tensor, t_freq: Tensor, cam: Tensor, ctx: ForwardContext) -> Tensor:
        """x_in (36, F, H, W) full chunk on every rank; t_freq (F, freq_dim) sinusoids per frame;
        cam (n_local, 384·4). Returns the velocity (16, F, H, W) in fp32, identical on every rank."""
        ctx.kv_fn, ctx.attend = self.attention_choice.kernels()
        ctx.attend_writes_into = self.attention_choice.writes_into
        ctx.append = self.attention_choice.appender(ctx.kv_fn) if ctx.kv_write == "append" else None
        lay, dtype = ctx.layout, self.patch_embedding.weight.dtype
        x = self.patch_embedding(x_in.to(dtype).unsqueeze(0)).flatten(2)[0]  # (dim, N)
        x = x[:, lay.start : lay.end].t().to(ctx.residual).contiguous()  # fp32 unless H2b (see the top)
        e = self.time_embedding(t_freq.to(dtype))  # (F, dim)
        e0 = self.time_projection(e).float().unflatten(1, (6, self.cfg.dim))
        e = e.float()
        c = None
        if ctx.camera.needs_tokens(len(self.blocks)):
            c = self.patch_embedding_wancamctrl(cam)
            c = c + self.c2ws_hidden_states_layer2(F.silu(self.c2ws_hidden_states_layer1(c)))
        if ctx.inputs is not None:  # H1g: one copy here instead of one into every graph reading them
            e0 = ctx.inputs.hold("modulation", e0)
            c = None if c is None else ctx.inputs.hold("camera_tokens", c)
        x = self._blocks(x, e0, c, ctx)
        out = gather_tokens(self.head(x, e, lay).float(), ctx.group)
        return unpatchify(out, ctx.grid, self.cfg.patch_size, self.cfg.out_channels)

    def _blocks(self, x: Tensor, e0: Tensor, c: Tensor | None, ctx: ForwardContext) -> Tensor:
        """The blocks in turn; with H2c each hands its last residual add to the next (the last one's
        runs here). Under a hook, per-layer phases (a carried add counts in the next layer's)."""
        carried = None
        for i in range(len(self.blocks)):
            if hctx.ACTIVE:  # per-layer phases only when a hook consumes them
                with hctx.phase(layer=i):
                    out = self._block(i, x, e0, c, ctx, carried)
            else:
                out = self._block(i, x, e0, c, ctx, carried)
            x, carried = (out[0], out[1:]) if ctx.ffn_residual == "next" else (out, None)
        if carried is not None:
            x = self.last_add(ctx.layout, x, carried, ctx.residual)
        return x

    def _block(self, i: int, x: Tensor, e0: Tensor, c: Tensor | None, ctx: ForwardContext,
               carried: tuple[Tensor, Tensor | None, Tensor] | None) -> Tensor | tuple[Tensor, ...]:
        block = self.blocks[i]
        fwd, camera = (block, block.camera) if self.compiled_blocks is None else self.compiled_blocks[i]
        return fwd(x, e0, ctx.camera.block(i, camera, c), ctx, ctx.kv_destination(i), carried)

    # -- compiled mode --
    def compile_blocks(self, **options) -> None:
        """Compile every block (and its camera injector) with ``torch.compile(**options)``; the
        blocks share one code object, so the graph is traced once and reused by every layer."""
        self.compiled_blocks = tuple((torch.compile(b, **options), torch.compile(b.camera, **options))
                                     for b in self.blocks)
        self.last_add = torch.compile(carried_add, **options)

    def uncompile_blocks(self) -> None:
        self.compiled_blocks = None
        self.last_add = carried_add


def unpatchify(x: Tensor, grid: tuple[int, int, int], patch: tuple[int, int, int], channels: int) -> Tensor:
    """(N, pt·ph·pw·C) in Wan's (pt, ph, pw, C) channel order → (C, F·pt, h·ph, w·pw)."""
    f, h, w = grid
    pt, ph, pw = patch
    x = x.view(f, h, w, pt, ph, pw, channels).permute(6, 0, 3, 1, 4, 2, 5)
    return x.reshape(channels, f * pt, h * ph, w * pw)


def build_model(m: ModelConfig, *, device: torch.device, dtype: torch.dtype) -> WanDiT:
    """Structure on ``device`` with uninitialised weights (none at all on the meta device);
    fill with ``weights.init_weights`` or ``weights.load_weights``."""
    with torch.device("meta"):
        model = WanDiT(m, dtype)
    if device.type != "meta":
        model.to_empty(device=device)
    model.requires_grad_(False).eval()
    return model.fuse_qkv_()


def parameter_count(model: nn.Module) -> int:
    """Checkpoint parameters (the fused QKV buffer is storage behind q/k/v, not extra parameters)."""
    return sum(p.numel() for p in model.parameters())
