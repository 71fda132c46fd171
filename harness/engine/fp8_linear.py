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
    """y = x Wᵀ + b with x and W in e4m3 (per-token × per-channel scales), y in the layer's dtype.

    ``smooth`` (K,), powers of two (``smooth_factors``): SmoothQuant's migration, x·diag(1/s) and
    diag(s)·W quantised instead of x and W — the same product, exactly, since scaling by a power
    of two only moves exponents — so an input channel with outliers in x is narrowed before the
    per-token scale is taken, and its weight column widened, where per-channel weight scales
    absorb it."""

    def __init__(self, linear: nn.Linear, smooth: Tensor | None = None):
        super().__init__()
        n, k = linear.weight.shape
        if n % 16 or k % 16:
            raise HarnessError(f"FP8 GEMMs need both weight dims divisible by 16, got {n}×{k}")
        w = linear.weight.detach()
        if smooth is not None:
            w = w * smooth.to(w.dtype)
            self.register_buffer("inv_smooth", (1.0 / smooth).to(w.dtype), persistent=False)
        else:
            self.inv_smooth = None
        w8, ws = rowwise_quantize(w)
        # (N, K) row-major is the column-major (K, N) operand _scaled_mm wants as its second input
        self.register_buffer("w8", w8, persistent=False)
        self.register_buffer("w_scale", ws.t().contiguous(), persistent=False)  # (1, N)
        self.bias = linear.bias
        self.out_dtype = linear.weight.dtype
        self.in_features, self.out_features = k, n

    def product(self, x8: Tensor, xs: Tensor) -> Tensor:
        """(M, K) e4m3 with its per-row scale (M, 1) → x Wᵀ (M, N) in the layer's dtype, no bias."""
        return torch._scaled_mm(x8, self.w8.t(), scale_a=xs, scale_b=self.w_scale, out_dtype=self.out_dtype)

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        if self.inv_smooth is not None:
            x = x * self.inv_smooth  # exact (powers of two); fuses with the quantisation when compiled
        y = self.product(*rowwise_quantize(x.reshape(-1, self.in_features)))
        if self.bias is not None:
            y = y + self.bias  # outside the GEMM: fuses with what follows under torch.compile
        return y.reshape(*lead, self.out_features)


def _resolve(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, name = path.rpartition(".")
    return (root.get_submodule(parent) if parent else root), name


def swap_linears(root: nn.Module, paths: list[str], cache: dict[str, Fp8Linear],
                 smooth: dict[str, Tensor] | None = None) -> Callable[[], None]:
    """Replace each ``nn.Linear`` at ``paths`` by its ``Fp8Linear`` (quantised once, kept in
    ``cache`` across swaps; with its ``smooth`` factors where given); returns the revert."""
    smooth = smooth or {}
    originals = []
    for path in paths:
        parent, name = _resolve(root, path)
        lin = getattr(parent, name)
        if not isinstance(lin, nn.Linear):
            raise HarnessError(f"{path} is {type(lin).__name__}, not nn.Linear: already swapped?")
        if path not in cache:
            cache[path] = Fp8Linear(lin, smooth.get(path))
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
    # the FFN, but the first and last EDGE_BF16["ffn-mid"] blocks stay bf16
    "ffn-mid": ("ffn.0", "ffn.2"),
    # ffn+o with SmoothQuant-smoothed attention projections (SMOOTHED)
    "ffn+attn-smooth": ("ffn.0", "ffn.2", "self_attn.o", "cross_attn.q", "cross_attn.o"),
}
#: layer set → blocks kept bf16 at each end of the stack (where the input and output are made)
EDGE_BF16 = {"ffn-mid": 2}
#: layer set → the linears (relative to a block) smoothed with factors from a calibration forward
SMOOTHED = {"ffn+attn-smooth": ("self_attn.o", "cross_attn.q", "cross_attn.o")}
#: SmoothQuant's migration strength: s_j = amax(x_j)^α / amax(W_:,j)^(1−α)
SMOOTH_ALPHA = 0.5


def block_paths(num_blocks: int, layer_set: str, only: tuple[str, ...] | None = None) -> list[str]:
    """The linears of ``layer_set`` (or the subset ``only``) over the blocks it covers."""
    names = [p for p in LAYER_SETS[layer_set] if only is None or p in only]
    return [f"blocks.{i}.{p}" for i in fp8_blocks(num_blocks, layer_set) for p in names]


def fp8_blocks(num_blocks: int, layer_set: str) -> range:
    """The blocks a layer set puts in FP8: all but ``EDGE_BF16``'s at each end."""
    k = EDGE_BF16.get(layer_set, 0)
    return range(k, num_blocks - k)


def smooth_factors(x_amax: Tensor, weight: Tensor, alpha: float = SMOOTH_ALPHA) -> Tensor:
    """Per-input-channel SmoothQuant factors (K,) fp32 from the activation's per-channel amax (K,)
    and the weight (N, K), rounded to powers of two so that the migration is exact."""
    w_amax = weight.detach().abs().amax(dim=0).float().clamp_min(MIN_AMAX)
    s = x_amax.float().clamp_min(MIN_AMAX) ** alpha / w_amax ** (1.0 - alpha)
    return torch.exp2(torch.round(torch.log2(s)))


def input_amax(root: nn.Module, paths: list[str], run: Callable[[], None],
               reduce: Callable[[Tensor], None] | None = None) -> dict[str, Tensor]:
    """Per-input-channel amax (K,) of each linear at ``paths`` over what ``run()`` feeds them (a
    calibration forward); ``reduce`` combines them across ranks in place (SP: every rank must
    smooth alike)."""
    amax: dict[str, Tensor] = {}

    def hook(path: str):
        def record(_module, args) -> None:
            a = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(dim=0).float()
            amax[path] = a if path not in amax else torch.maximum(amax[path], a)
        return record

    handles = [root.get_submodule(p).register_forward_pre_hook(hook(p)) for p in paths]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    missing = [p for p in paths if p not in amax]
    if missing:
        raise HarnessError(f"calibration forward never reached {missing[0]} (and {len(missing) - 1} more)")
    # clones: a forward under inference_mode records inference tensors, which no later in-place
    # op (the reduction) may touch
    amax = {p: a.clone() for p, a in amax.items()}
    for a in amax.values():
        if reduce is not None:
            reduce(a)
    return amax
