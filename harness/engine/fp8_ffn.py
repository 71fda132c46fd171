"""The FFN (Linear → tanh-GELU → Linear) with both GEMMs in FP8 and FFN-up's epilogue — bias,
GELU and the per-row quantisation FFN-down reads — as one op.

``Fp8Ffn`` computes what H6a's two ``Fp8Linear`` with the GELU between them compute, in the same
order: on the CPU (and wherever the op's default runs) bit for bit the same ops; on CUDA the op is
``fused_gelu_quant``'s one-pass Triton kernel, which Inductor calls as it calls the GEMMs, instead
of the looped two-pass reduction it generates for a 13 824-long row. The op is a
``torch.library.custom_op`` so that ``torch.compile`` keeps it whole (with a fake kernel for
tracing) and the CPU keeps a reference to test against.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from harness.engine.fa3 import FP8
from harness.engine.fp8_linear import Fp8Linear, rowwise_quantize
from harness.errors import HarnessError


def bias_gelu_quantize_reference(u: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """H6a's eager order: bias added in u's dtype, tanh-GELU, per-row e4m3 (``rowwise_quantize``)."""
    return rowwise_quantize(F.gelu(u + bias, approximate="tanh"))


@torch.library.custom_op("harness::bias_gelu_quantize", mutates_args=())
def bias_gelu_quantize(u: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """(M, N) FFN-up output, (N,) bias → e4m3 (M, N) and its per-row fp32 scale (M, 1)."""
    return bias_gelu_quantize_reference(u, bias)


@bias_gelu_quantize.register_kernel("cuda")
def _bias_gelu_quantize_cuda(u: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    from harness.engine.fused_gelu_quant import bias_gelu_quantize as fused  # Triton: imported only here

    return fused(u, bias)


@bias_gelu_quantize.register_fake
def _bias_gelu_quantize_fake(u: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    return u.new_empty(u.shape, dtype=FP8), u.new_empty((u.shape[0], 1), dtype=torch.float32)


def _check_ffn(ffn: nn.Module) -> tuple[nn.Linear, nn.Linear]:
    parts = list(ffn.children()) if isinstance(ffn, nn.Sequential) else []
    if not (len(parts) == 3 and isinstance(parts[0], nn.Linear) and isinstance(parts[2], nn.Linear)
            and isinstance(parts[1], nn.GELU) and parts[1].approximate == "tanh"):
        raise HarnessError(f"expected an FFN Sequential(Linear, GELU(tanh), Linear), got {type(ffn).__name__}: "
                           "already swapped, or another model?")
    if parts[0].bias is None:
        raise HarnessError("the fused FFN epilogue adds FFN-up's bias: this FFN has none")
    return parts[0], parts[2]


class Fp8Ffn(nn.Module):
    """down(gelu(up(x))) with x, the hidden activation and both weights in e4m3 (per-token ×
    per-channel scales, as ``Fp8Linear``); wraps the FFN's linears without touching them."""

    def __init__(self, ffn: nn.Module):
        super().__init__()
        up, down = _check_ffn(ffn)
        self.up, self.down = Fp8Linear(up), Fp8Linear(down)

    def forward(self, x: Tensor) -> Tensor:
        y, bias = self.unbiased(x)
        if bias is not None:
            y = y + bias  # fuses with the gated residual add under torch.compile
        return y

    def unbiased(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """``forward`` without FFN-down's bias add: (FFN output less the bias, the bias). Where the
        block hands its last residual add on (H2c), the add travels with it, into the next
        block's norm kernel, instead of being a kernel of its own at the graph's end."""
        lead = x.shape[:-1]
        y, bias = self.unbiased_quantized(*rowwise_quantize(x.reshape(-1, self.up.in_features)))
        return y.reshape(*lead, self.down.out_features), bias

    def unbiased_quantized(self, x8: Tensor, xs: Tensor) -> tuple[Tensor, Tensor | None]:
        """``unbiased`` from the input already quantised: (M, K) e4m3 codes and their per-row
        scales (M, 1), as ``rowwise_quantize`` makes them — or the FFN norm's op (H2f), which
        makes them in the pass that norms and modulates the stream."""
        u = self.up.product(x8, xs)
        return self.down.product(*bias_gelu_quantize(u, self.up.bias)), self.down.bias
