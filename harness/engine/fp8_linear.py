"""FP8 (e4m3) linear layers: per-output-channel weight scales computed once, per-token activation
scales computed on the fly, one ``torch._scaled_mm`` with both scales applied in its epilogue.

``Fp8Linear`` wraps an ``nn.Linear`` without touching it (the bf16 weight stays, so the swap is
reversible); ``swap_linears`` puts wrappers in place of named sub-modules and returns the function
that puts the originals back. Under ``torch.compile`` the activation's amax, scale and cast fuse
with the elementwise code before the GEMM (the modulated LayerNorm before FFN-up, the GELU before
FFN-down), so the activation is read once more, not written twice.

Row-wise scaling is what keeps the error near e4m3's own rounding (≈ 2⁻⁴ relative per element,
averaged down by the K-long dot products): one outlier token or output channel only coarsens its
own row or column, never the whole tensor.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch import Tensor

from harness.engine.fa3 import FP8, FP8_MAX, MIN_AMAX
from harness.errors import HarnessError


def rowwise_quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """(M, K) → e4m3 (M, K) and its per-row scale (M, 1) fp32: x ≈ x8 · scale."""
    s = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(MIN_AMAX) / FP8_MAX
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


class Fp8Linear(nn.Module):
    """y = x Wᵀ + b with x and W in e4m3 (per-token × per-channel scales), y in the layer's dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        n, k = linear.weight.shape
        if n % 16 or k % 16:
            raise HarnessError(f"FP8 GEMMs need both weight dims divisible by 16, got {n}×{k}")
        w8, ws = rowwise_quantize(linear.weight.detach())
        # (N, K) row-major is the column-major (K, N) operand _scaled_mm wants as its second input
        self.register_buffer("w8", w8, persistent=False)
        self.register_buffer("w_scale", ws.t().contiguous(), persistent=False)  # (1, N)
        self.bias = linear.bias
        self.out_dtype = linear.weight.dtype
        self.in_features, self.out_features = k, n

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x8, xs = rowwise_quantize(x.reshape(-1, self.in_features))
        y = torch._scaled_mm(x8, self.w8.t(), scale_a=xs, scale_b=self.w_scale, out_dtype=self.out_dtype)
        if self.bias is not None:
            y = y + self.bias  # outside the GEMM: fuses with what follows under torch.compile
        return y.reshape(*lead, self.out_features)


def _resolve(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, name = path.rpartition(".")
    return (root.get_submodule(parent) if parent else root), name


def swap_linears(root: nn.Module, paths: list[str], cache: dict[str, Fp8Linear]) -> Callable[[], None]:
    """Replace each ``nn.Linear`` at ``paths`` by its ``Fp8Linear`` (quantised once, kept in
    ``cache`` across swaps); returns the revert."""
    originals = []
    for path in paths:
        parent, name = _resolve(root, path)
        lin = getattr(parent, name)
        if not isinstance(lin, nn.Linear):
            raise HarnessError(f"{path} is {type(lin).__name__}, not nn.Linear: already swapped?")
        if path not in cache:
            cache[path] = Fp8Linear(lin)
        originals.append((parent, name, lin))
        setattr(parent, name, cache[path])

    def revert() -> None:
        for parent, name, lin in originals:
            setattr(parent, name, lin)

    return revert


#: Which linears of a block each H6a argument puts in FP8, relative to ``blocks.<i>``.
LAYER_SETS = {
    "ffn": ("ffn.0", "ffn.2"),
    # the attention output projections too (the fused QKV GEMM is not a module and stays bf16)
    "ffn+o": ("ffn.0", "ffn.2", "self_attn.o", "cross_attn.q", "cross_attn.o"),
}


def block_paths(num_blocks: int, layer_set: str) -> list[str]:
    return [f"blocks.{i}.{p}" for i in range(num_blocks) for p in LAYER_SETS[layer_set]]
