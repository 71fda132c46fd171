"""The self-attention's input — the previous block's carried FFN add (H2c), the block's first
LayerNorm, its modulation and the rounding to the runtime dtype — as one op over the residual
stream (H2g).

``fused_attn_in`` is what ``ForwardContext.attn_in`` holds: it gives ``Block.forward`` the new
stream and the attention's input that its own ops give. The op is a ``torch.library`` custom op, so
``torch.compile`` keeps it whole (a fake kernel for tracing): on CUDA ``fused_norm``'s one-pass
Triton kernel, where Inductor generates a looped reduction that reads each 5 120-wide row three
times; elsewhere its default runs the block's own ops in their order (``add_norm_reference``), bit
for bit what the block computes in eager, which is what the kernel is tested against. A block with
nothing carried (the first, or any block with ``ffn_residual == "own"``) takes H2f's
``ffn_norm.norm_modulate``: the same norm and modulation with no add in front.
"""

from __future__ import annotations

import torch
from torch import Tensor

from harness.engine.dit import TokenLayout, carried_add, layer_norm32
from harness.engine.ffn_norm import norm_modulate


def add_norm_reference(x: Tensor, y: Tensor, bias: Tensor | None, gate: Tensor, shift: Tensor, scale: Tensor,
                       eps: float, start: int, tpf: int, residual: torch.dtype,
                       dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``Block.forward``'s own ops on the stream's rows ``start``.. (``tpf`` tokens a latent
    frame): the carried add ``x + (y + bias) · gate`` in ``residual``, then its LayerNorm in fp32
    modulated by each row's frame's (shift, scale), in ``dtype``."""
    layout = TokenLayout(shift.shape[0], tpf, start, start + x.shape[0])
    x = carried_add(layout, x, (y, bias, gate), residual)
    return x, layout.modulate(layer_norm32(x, eps), shift, scale).to(dtype)


@torch.library.custom_op("harness::add_norm", mutates_args=())
def add_norm_modulate(x: Tensor, y: Tensor, bias: Tensor | None, gate: Tensor, shift: Tensor, scale: Tensor,
                      eps: float, start: int, tpf: int, residual: torch.dtype,
                      dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(n, dim) stream and the carried (FFN output, bias, gate) → the new stream and the
    self-attention's (n, dim) input."""
    return add_norm_reference(x, y, bias, gate, shift, scale, eps, start, tpf, residual, dtype)


@add_norm_modulate.register_kernel("cuda")
def _add_norm_cuda(x: Tensor, y: Tensor, bias: Tensor | None, gate: Tensor, shift: Tensor, scale: Tensor,
                   eps: float, start: int, tpf: int, residual: torch.dtype,
                   dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    from harness.engine import fused_norm  # Triton: imported only on the GPU

    return fused_norm.add_norm_modulate(x, y, bias, gate, shift, scale, eps, start, tpf, residual, dtype)


@add_norm_modulate.register_fake
def _add_norm_fake(x: Tensor, y: Tensor, bias: Tensor | None, gate: Tensor, shift: Tensor, scale: Tensor,
                   eps: float, start: int, tpf: int, residual: torch.dtype,
                   dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=residual), x.new_empty(x.shape, dtype=dtype)


def fused_attn_in(x: Tensor, carried: tuple[Tensor, Tensor | None, Tensor] | None, shift: Tensor, scale: Tensor,
                  eps: float, layout: TokenLayout, dtype: torch.dtype, residual: torch.dtype) -> tuple[Tensor, Tensor]:
    """``ForwardContext.attn_in``: the stream after the carried add (if any) and the
    self-attention's input, made by one op. ``dtype``: the block's runtime dtype."""
    if carried is None:
        return x, norm_modulate(x, shift, scale, eps, layout.start, layout.tpf, dtype)
    y, bias, gate = carried
    return add_norm_modulate(x, y, bias, gate, shift, scale, eps, layout.start, layout.tpf, residual, dtype)
