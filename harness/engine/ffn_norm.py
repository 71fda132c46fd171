"""The FFN's input — the cross-attention's residual add, the block's FFN LayerNorm, its
modulation, the rounding to the runtime dtype and, for an FP8 FFN, FFN-up's per-row quantisation —
as one op over the residual stream (H2f).

``fused_ffn`` is what ``ForwardContext.ffn_in`` holds: it gives ``Block.forward`` the new stream,
the FFN output and the bias still to add that its own ops give. The add is in the op because
Inductor had fused it into its norm kernel: an op that took the summed stream left it as a kernel
of its own (14.8 ms a chunk on an H100, gpu-batch25), more than the one pass saved. The ops are ``torch.library`` custom ops, so
``torch.compile`` keeps each whole (a fake kernel for tracing): on CUDA ``fused_norm``'s
one-pass Triton kernel, where Inductor generates a looped reduction that reads each 5 120-wide row
three times; elsewhere their defaults run the block's own ops in their order
(``norm_modulate_reference``), bit for bit what the block computes in eager, which is what the
kernel is tested against. An FP8 FFN (``fp8_ffn.Fp8Ffn``, H6e) takes the codes and scales the op
makes; any other FFN takes the rounded input.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from harness.engine.dit import TokenLayout, ffn_unbiased, layer_norm32
from harness.engine.fa3 import FP8
from harness.engine.fp8_linear import rowwise_quantize


def norm_modulate_reference(x: Tensor, shift: Tensor, scale: Tensor, eps: float, start: int, tpf: int,
                            dtype: torch.dtype) -> Tensor:
    """``Block.forward``'s own ops: the stream's rows ``start``.. (``tpf`` tokens a latent frame)
    LayerNorm-ed in fp32, modulated by their frame's (shift, scale), in ``dtype``."""
    layout = TokenLayout(shift.shape[0], tpf, start, start + x.shape[0])
    return layout.modulate(layer_norm32(x, eps), shift, scale).to(dtype)


@torch.library.custom_op("harness::ffn_norm", mutates_args=())
def norm_modulate(x: Tensor, shift: Tensor, scale: Tensor, eps: float, start: int, tpf: int,
                  dtype: torch.dtype) -> Tensor:
    """(n, dim) stream → the FFN's (n, dim) input in ``dtype``."""
    return norm_modulate_reference(x, shift, scale, eps, start, tpf, dtype)


@norm_modulate.register_kernel("cuda")
def _norm_modulate_cuda(x: Tensor, shift: Tensor, scale: Tensor, eps: float, start: int, tpf: int,
                        dtype: torch.dtype) -> Tensor:
    from harness.engine import fused_norm as fused  # Triton: imported only on the GPU

    return fused.norm_modulate(x, shift, scale, eps, start, tpf, dtype)


@norm_modulate.register_fake
def _norm_modulate_fake(x: Tensor, shift: Tensor, scale: Tensor, eps: float, start: int, tpf: int,
                        dtype: torch.dtype) -> Tensor:
    return x.new_empty(x.shape, dtype=dtype)


def add_norm_modulate_reference(x: Tensor, c: Tensor, shift: Tensor, scale: Tensor, eps: float, start: int, tpf: int,
                                dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``Block.forward``'s own ops: the cross-attention's residual add ``x + c`` (in the dtype
    PyTorch promotes the pair to: the stream's), then ``norm_modulate_reference`` of the sum."""
    x = x + c
    return x, norm_modulate_reference(x, shift, scale, eps, start, tpf, dtype)


@torch.library.custom_op("harness::ffn_add_norm", mutates_args=())
def add_norm_modulate(x: Tensor, c: Tensor, shift: Tensor, scale: Tensor, eps: float, start: int, tpf: int,
                      dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(n, dim) stream and cross-attention output → the new stream and the FFN's (n, dim) input in ``dtype``."""
    return add_norm_modulate_reference(x, c, shift, scale, eps, start, tpf, dtype)


@add_norm_modulate.register_kernel("cuda")
def _add_norm_modulate_cuda(x: Tensor, c: Tensor, shift: Tensor, scale: Tensor, eps: float, start: int, tpf: int,
                            dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    from harness.engine import fused_norm as fused  # Triton: imported only on the GPU

    return fused.ffn_input(x, c, shift, scale, eps, start, tpf, dtype)


@add_norm_modulate.register_fake
def _add_norm_modulate_fake(x: Tensor, c: Tensor, shift: Tensor, scale: Tensor, eps: float, start: int, tpf: int,
                            dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, c.dtype)), x.new_empty(x.shape, dtype=dtype)


@torch.library.custom_op("harness::ffn_add_norm_quantize", mutates_args=())
def add_norm_modulate_quantize(x: Tensor, c: Tensor, shift: Tensor, scale: Tensor, eps: float, start: int,
                               tpf: int) -> tuple[Tensor, Tensor, Tensor]:
    """(n, dim) stream and cross-attention output → the new stream and the FFN's input in bf16 as
    e4m3 codes (n, dim) and per-row scales (n, 1)."""
    x, h = add_norm_modulate_reference(x, c, shift, scale, eps, start, tpf, torch.bfloat16)
    return (x, *rowwise_quantize(h))


@add_norm_modulate_quantize.register_kernel("cuda")
def _add_norm_modulate_quantize_cuda(x: Tensor, c: Tensor, shift: Tensor, scale: Tensor, eps: float, start: int,
                                     tpf: int) -> tuple[Tensor, Tensor, Tensor]:
    from harness.engine import fused_norm as fused  # Triton: imported only on the GPU

    return fused.ffn_input_quantize(x, c, shift, scale, eps, start, tpf)


@add_norm_modulate_quantize.register_fake
def _add_norm_modulate_quantize_fake(x: Tensor, c: Tensor, shift: Tensor, scale: Tensor, eps: float, start: int,
                                     tpf: int) -> tuple[Tensor, Tensor, Tensor]:
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, c.dtype)), x.new_empty(x.shape, dtype=FP8),
            x.new_empty((x.shape[0], 1), dtype=torch.float32))


def fused_ffn(ffn: nn.Module, x: Tensor, c: Tensor, shift: Tensor, scale: Tensor, eps: float, layout: TokenLayout,
              dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
    """``ForwardContext.ffn_in``: the stream ``x`` after the cross-attention's add of ``c``, and the
    block's FFN output from it with the bias still to add (``dit.ffn_unbiased``), the add and the
    FFN's input made by one op. ``dtype``: the block's runtime dtype."""
    quantized = getattr(ffn, "unbiased_quantized", None)
    if quantized is not None and dtype == torch.bfloat16:  # the FP8 FFN quantises a bf16 input
        x, q, s = add_norm_modulate_quantize(x, c, shift, scale, eps, layout.start, layout.tpf)
        return (x, *quantized(q, s))
    x, h = add_norm_modulate(x, c, shift, scale, eps, layout.start, layout.tpf, dtype)
    return (x, *ffn_unbiased(ffn, h))


def tune(rows: int, dim: int, frames: int, device: torch.device) -> str:
    """The kernel's autotuning, before any graph is compiled or captured (``fused_norm.tune``);
    "" off the GPU, where nothing is tuned."""
    if device.type != "cuda":
        return ""
    from harness.engine import fused_norm as fused  # Triton: imported only on the GPU

    return fused.tune(rows, dim, frames, device)
