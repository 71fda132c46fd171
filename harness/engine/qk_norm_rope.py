"""Self-attention's q/k RMSNorms and RoPE — and, where the block stores the chunk's K/V itself
(H1f), that store — as one op over the fused QKV output (H2d).

``fused_qk`` is what ``ForwardContext.qk`` holds: it gives ``SelfAttention.forward`` the q, k, v
its own ops give (k and v None where stored). The op is a ``torch.library.custom_op``, so
``torch.compile`` keeps it whole (a fake kernel for tracing): on CUDA it is
``fused_qk_norm_rope``'s one-pass Triton kernel, where Inductor generates five kernels a block;
elsewhere its default runs the module's own ops in their order (``norm_rope_reference``), bit for
bit what the block computes in eager, which is what the kernel is tested against. The stored form
declares the pools it writes (``mutates_args``): Inductor writes them in place, and the CUDA
graphs, whose pools are static addresses (H1f), replay the write.
"""

from __future__ import annotations

import torch
from torch import Tensor

from harness.engine.dit import SelfAttention, apply_rope, rms_norm32, store_kv


def norm_rope_reference(qkv: Tensor, wq: Tensor, wk: Tensor, rot: Tensor, eps: float,
                        heads: int) -> tuple[Tensor, Tensor]:
    """``SelfAttention.forward``'s own ops: q and k of the (n, 3·dim) QKV output RMS-normalised
    in fp32 over dim and rotated by ``rot``, (n, heads, head_dim) in the QKV output's dtype."""
    n, dim = qkv.shape[0], qkv.shape[1] // 3
    q, k, _ = qkv.split(dim, dim=-1)

    def one(x: Tensor, w: Tensor) -> Tensor:
        return apply_rope(rms_norm32(x, w, eps).view(n, heads, dim // heads), rot, qkv.dtype)

    return one(q, wq), one(k, wk)


def _v(qkv: Tensor, heads: int) -> Tensor:
    n, dim = qkv.shape[0], qkv.shape[1] // 3
    return qkv[:, 2 * dim :].view(n, heads, dim // heads)


@torch.library.custom_op("harness::qk_norm_rope", mutates_args=())
def qk_norm_rope(qkv: Tensor, wq: Tensor, wk: Tensor, rot: Tensor, eps: float, heads: int) -> tuple[Tensor, Tensor]:
    """(n, 3·dim) QKV output → q, k (n, heads, head_dim), normalised and rotated."""
    return norm_rope_reference(qkv, wq, wk, rot, eps, heads)


@qk_norm_rope.register_kernel("cuda")
def _qk_norm_rope_cuda(qkv: Tensor, wq: Tensor, wk: Tensor, rot: Tensor, eps: float, heads: int) -> tuple[Tensor, Tensor]:
    from harness.engine import fused_qk_norm_rope as fused  # Triton: imported only on the GPU

    return fused.qk_norm_rope(qkv, wq, wk, rot, eps, heads)


@qk_norm_rope.register_fake
def _qk_norm_rope_fake(qkv: Tensor, wq: Tensor, wk: Tensor, rot: Tensor, eps: float, heads: int) -> tuple[Tensor, Tensor]:
    n, dim = qkv.shape[0], qkv.shape[1] // 3
    return qkv.new_empty((n, heads, dim // heads)), qkv.new_empty((n, heads, dim // heads))


@torch.library.custom_op("harness::qk_norm_rope_store", mutates_args=("k_pool", "v_pool"))
def qk_norm_rope_store(qkv: Tensor, wq: Tensor, wk: Tensor, rot: Tensor, eps: float, heads: int,
                       k_pool: Tensor, v_pool: Tensor, ids: Tensor) -> Tensor:
    """``qk_norm_rope``'s q; its k and the chunk's v stored into blocks ``ids`` of the pools, as
    ``dit.store_kv`` stores them."""
    q, k = norm_rope_reference(qkv, wq, wk, rot, eps, heads)
    store_kv((k_pool, v_pool, ids), k, _v(qkv, heads))
    return q


@qk_norm_rope_store.register_kernel("cuda")
def _qk_norm_rope_store_cuda(qkv: Tensor, wq: Tensor, wk: Tensor, rot: Tensor, eps: float, heads: int,
                             k_pool: Tensor, v_pool: Tensor, ids: Tensor) -> Tensor:
    from harness.engine import fused_qk_norm_rope as fused  # Triton: imported only on the GPU

    return fused.qk_norm_rope_store(qkv, wq, wk, rot, eps, heads, k_pool, v_pool, ids)


@qk_norm_rope_store.register_fake
def _qk_norm_rope_store_fake(qkv: Tensor, wq: Tensor, wk: Tensor, rot: Tensor, eps: float, heads: int,
                             k_pool: Tensor, v_pool: Tensor, ids: Tensor) -> Tensor:
    n, dim = qkv.shape[0], qkv.shape[1] // 3
    return qkv.new_empty((n, heads, dim // heads))


def fused_qk(qkv: Tensor, attn: SelfAttention, rot: Tensor,
             dest: tuple[Tensor, Tensor, Tensor] | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``ForwardContext.qk``: ``attn``'s q, k, v from its QKV output through the op; with ``dest``
    (K pool, V pool, block ids: ``ForwardContext.kv_destination``) k and v are stored there and
    come back None. The block's two norms share one eps (``Block`` builds them so)."""
    wq, wk, eps, heads = attn.norm_q.weight, attn.norm_k.weight, attn.norm_q.eps, attn.heads
    if dest is None:
        q, k = qk_norm_rope(qkv, wq, wk, rot, eps, heads)
        return q, k, _v(qkv, heads)
    return qk_norm_rope_store(qkv, wq, wk, rot, eps, heads, *dest), None, None


def tune(rows: int, dim: int, heads: int, tokens: int, device: torch.device) -> str:
    """The kernel's autotuning, before any graph is compiled or captured (``fused_qk_norm_rope.tune``);
    "" off the GPU, where nothing is tuned."""
    if device.type != "cuda":
        return ""
    from harness.engine import fused_qk_norm_rope as fused  # Triton: imported only on the GPU

    return fused.tune(rows, dim, heads, tokens, device)
