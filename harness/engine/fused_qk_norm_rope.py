"""Self-attention's q/k RMSNorm and RoPE in one Triton pass over the fused QKV output, with the
chunk's K/V stored into their blocks of the KV pools where they are made (H1f's store).

Compiled, Inductor turns the same steps into five kernels a block (gpu-batch22, 480×832, with
H1f): two row reductions for the norms' scales, one pointwise kernel that normalises and rotates
q and k into an fp32 buffer, and two that round it to bf16 — K's storing K and V into the pools —
40.5 ms a steady chunk over 200 calls, where one read of q, k, v and one write of q, K, V is
≈ 290 MB a call at 480×832 (≈ 14 ms a chunk at the copy bandwidth). Here one program holds one
row of q (or of k, with v) in registers: one read, the row's mean square, the norm, the rotation,
one rounding, one write.

Per element it does what ``qk_norm_rope.norm_rope_reference`` does: ``F.rms_norm`` in float32
(``x · rsqrt(mean(x²) + eps) · w``), then the rotation of each channel pair by the token's
(cos, sin) (``(a·c − b·s, a·s + b·c)``), rounded once to the output's dtype. Two things differ,
both below that rounding: the mean square is summed in another order, and the GPU may contract a
product and a sum into one FMA where the reference's complex multiply rounds between them; a
value within float32 rounding of a bf16 rounding boundary can so land one bf16 step away (the
tests count them). Hence H2d's threshold gate.

Needs Triton (and a CUDA device, or the interpreter on CPU tensors); only ``qk_norm_rope``'s CUDA
kernel and the tests import this module.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.engine.triton_round import to_bf16


@triton.jit
def _norm_rope(src, w_ptr, offs, m, c, s, eps, DIM: tl.constexpr, ROUND: tl.constexpr, EMULATE: tl.constexpr):
    """One row's [pairs, 2] channels at ``src + offs``: RMS-normalised (weight ``w_ptr``), rotated
    by (c, s), rounded to bf16 where ``ROUND``; float32."""
    x = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / DIM + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
    a, b = tl.split(x * r * w)
    y = tl.join(a * c - b * s, a * s + b * c)
    if ROUND:
        y = to_bf16(y, EMULATE)
    return y


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, wq_ptr, wk_ptr, rot_ptr, q_ptr, k_ptr, v_ptr, ids_ptr,
                         qkv_stride, rot_stride, q_stride, kv_block_stride, kv_row_stride, eps,
                         DIM: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, TOKENS: tl.constexpr,
                         STORE: tl.constexpr, ROUND: tl.constexpr, EMULATE: tl.constexpr):
    # program (row, 0) makes the row's q; (row, 1) its k and, with STORE, copies its v beside it
    row = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    pair = tl.arange(0, BLOCK)  # the row's channel pairs: head pair // HALF, its pair pair % HALF
    two = tl.arange(0, 2)
    m = (pair[:, None] < DIM // 2) & (two[None, :] < 2)
    offs = pair[:, None] * 2 + two[None, :]
    rot = tl.load(rot_ptr + row * rot_stride + (pair % HALF)[:, None] * 2 + two[None, :], mask=m, other=0.0)
    c, s = tl.split(rot)
    src = qkv_ptr + row * qkv_stride
    if which == 0:
        y = _norm_rope(src, wq_ptr, offs, m, c, s, eps, DIM, ROUND, EMULATE)
        tl.store(q_ptr + row * q_stride + offs, y.to(q_ptr.dtype.element_ty), mask=m)
    else:
        y = _norm_rope(src + DIM, wk_ptr, offs, m, c, s, eps, DIM, ROUND, EMULATE)
        if STORE:  # the chunk's token row → its block of the pools, at its place in the block
            block = tl.load(ids_ptr + row // TOKENS)
            at = block * kv_block_stride + (row % TOKENS) * kv_row_stride
            tl.store(k_ptr + at + offs, y.to(k_ptr.dtype.element_ty), mask=m)
            v = tl.load(src + 2 * DIM + offs, mask=m)
            tl.store(v_ptr + at + offs, v, mask=m)
        else:
            tl.store(k_ptr + row * q_stride + offs, y.to(k_ptr.dtype.element_ty), mask=m)


#: on the GPU, the number of warps timed per row width at the first call (the interpreter has no timer)
_tuned_kernel = triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (4, 8, 16)],
                                key=["DIM", "STORE"])(_qk_norm_rope_kernel)


def _check(qkv: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, rot: torch.Tensor, heads: int) -> tuple[int, int]:
    if qkv.dim() != 2 or qkv.shape[1] % 3 or qkv.stride(1) != 1:
        raise ValueError(f"expected the (n, 3·dim) QKV output with unit column stride, got {tuple(qkv.shape)}")
    n, dim = qkv.shape[0], qkv.shape[1] // 3
    if dim % heads or (dim // heads) % 2:
        raise ValueError(f"dim {dim} does not split into {heads} heads of an even width")
    half = dim // heads // 2
    if wq.shape != (dim,) or wk.shape != (dim,):
        raise ValueError(f"expected ({dim},) norm weights, got {tuple(wq.shape)} and {tuple(wk.shape)}")
    if rot.dtype != torch.float32 or rot.shape != (n, 1, half, 2) or rot.stride()[1:] != (2 * half, 2, 1):
        raise ValueError(f"expected the ({n}, 1, {half}, 2) fp32 rotation table, got {tuple(rot.shape)} {rot.dtype}")
    return n, dim


def _launch(qkv, wq, wk, rot, eps: float, heads: int, q, k, v, ids, tokens: int, block_stride: int,
            row_stride: int) -> None:
    n, dim = _check(qkv, wq, wk, rot, heads)
    if not n:
        return
    kernel = _tuned_kernel if qkv.is_cuda else _qk_norm_rope_kernel
    store = ids is not None
    kernel[(n, 2)](qkv, wq.contiguous(), wk.contiguous(), rot, q, k, v if store else k, ids if store else qkv,
                   qkv.stride(0), rot.stride(0), q.stride(0), block_stride, row_stride, eps,
                   DIM=dim, HALF=dim // heads // 2, BLOCK=triton.next_power_of_2(dim // 2), TOKENS=tokens,
                   STORE=store, ROUND=qkv.dtype == torch.bfloat16, EMULATE=not qkv.is_cuda)


def qk_norm_rope(qkv: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, rot: torch.Tensor, eps: float,
                 heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 3·dim) QKV output → q, k (n, heads, head_dim), normalised and rotated, in its dtype."""
    if qkv.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"expected bf16 or fp32 QKV, got {qkv.dtype}")
    n, dim = qkv.shape[0], qkv.shape[1] // 3
    q = qkv.new_empty((n, heads, dim // heads))
    k = qkv.new_empty((n, heads, dim // heads))
    _launch(qkv, wq, wk, rot, eps, heads, q, k, None, None, 1, 0, 0)
    return q, k


def qk_norm_rope_store(qkv: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, rot: torch.Tensor, eps: float,
                       heads: int, k_pool: torch.Tensor, v_pool: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``qk_norm_rope``'s q; its k and the chunk's v go into their blocks of the pools
    (``kvcache.store_kv``'s layout: token t of the chunk at row t % B of block ids[t // B])."""
    n, dim = qkv.shape[0], qkv.shape[1] // 3
    blocks, tokens = k_pool.shape[:2]
    if k_pool.shape != v_pool.shape or k_pool.shape[2:] != (heads, dim // heads) or not k_pool.is_contiguous() \
            or not v_pool.is_contiguous() or k_pool.dtype != qkv.dtype or v_pool.dtype != qkv.dtype:
        raise ValueError(f"expected two contiguous (blocks, B, {heads}, {dim // heads}) {qkv.dtype} pools, "
                         f"got {tuple(k_pool.shape)} {k_pool.dtype} and {tuple(v_pool.shape)} {v_pool.dtype}")
    if ids.dim() != 1 or ids.numel() * tokens != n:
        raise ValueError(f"{n} tokens do not fill {ids.numel()} blocks of {tokens}")
    q = qkv.new_empty((n, heads, dim // heads))
    _launch(qkv, wq, wk, rot, eps, heads, q, k_pool, v_pool, ids, tokens, k_pool.stride(0), k_pool.stride(1))
    return q


def tune(rows: int, dim: int, heads: int, tokens: int, device: torch.device) -> str:
    """Run the autotuning of both forms now, on (rows, 3·dim) zeros, so that it happens outside a
    compiled graph's capture; returns the chosen configurations (or "" off the GPU)."""
    if device.type != "cuda":
        return ""
    z = lambda *shape, dtype=torch.bfloat16: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
    qkv, w, rot = z(rows, 3 * dim), z(dim), z(rows, 1, dim // heads // 2, 2, dtype=torch.float32)
    qk_norm_rope(qkv, w, w, rot, 1e-6, heads)
    blocks = -(-rows // tokens)
    pool = lambda: z(blocks, tokens, heads, dim // heads)  # noqa: E731
    ids = torch.arange(rows // tokens, device=device)
    qk_norm_rope_store(qkv[: ids.numel() * tokens], w, w, rot[: ids.numel() * tokens], 1e-6, heads, pool(), pool(), ids)
    return ", ".join(f"{k}: {v}" for k, v in _tuned_kernel.cache.items())
