"""H6a: ``Fp8Linear`` against a float64 reference (per-token × per-channel e4m3, so the error is
e4m3's own rounding even with an outlier token and an outlier channel), the refusal of shapes
``_scaled_mm`` cannot take, and the engine patch: FFN layers swapped, quantised once, reverted to
the very same modules with byte-identical latents after revert."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.candidates import get, h6a_fp8_linear
from harness.config import load_preset, override
from harness.engine.conditions import SessionConditions
from harness.engine.dit_engine import DitEngine
from harness.engine.fp8_linear import Fp8Linear, block_paths, rowwise_quantize
from harness.engine.groups import RankGroup
from harness.errors import HarnessError


def _linear(k=128, n=96, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight[3] *= 50.0  # an outlier output channel
    return lin.requires_grad_(False)


def test_fp8_linear_error_is_e4m3_rounding_per_row_and_column():
    lin = _linear()
    x = torch.randn(2, 40, 128)
    x[0, 5] *= 1e5  # an outlier token, past e4m3's normal range (2¹⁵) from the others
    ref = F.linear(x.double(), lin.weight.double(), lin.bias.double())
    y = Fp8Linear(lin)(x)
    assert y.shape == ref.shape and y.dtype == torch.float32
    rows = ((y.double() - ref).norm(dim=-1) / ref.norm(dim=-1)).flatten()
    # a random dot product's relative error is about one element's (≈ 2⁻⁴/√3 per operand): ~5 %
    assert 1e-3 < float(rows.median()) < 0.06 and float(rows[5]) < 0.1, rows
    # one tensor-wide activation scale instead: the outlier token pushes the ordinary ones into
    # e4m3's subnormals and their error grows several-fold
    s = x.abs().amax() / 448
    xt = (x / s).to(torch.float8_e4m3fn).double() * s
    w8, ws = rowwise_quantize(lin.weight)
    yt = F.linear(xt, w8.double() * ws.double(), lin.bias.double())
    tensor_rows = ((yt - ref).norm(dim=-1) / ref.norm(dim=-1)).flatten()
    assert float(tensor_rows.median()) > 3 * float(rows.median())


def test_rowwise_quantize_scales():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    x8, s = rowwise_quantize(x)
    assert s.shape == (2, 1) and float(x8.float().abs().max()) == 448.0
    assert torch.isfinite(s).all() and torch.equal(x8[1].float(), torch.zeros(3))


def test_fp8_linear_refuses_dims_not_multiple_of_16():
    with pytest.raises(HarnessError, match="divisible by 16"):
        Fp8Linear(nn.Linear(100, 64))


def _latents(eng, n=2):
    s = eng.start_session(SessionConditions(prompt="h6a", seed=5))
    out = [eng.generate_chunk(s, ["W", "", "D"]).clone() for _ in range(n)]
    eng.end_session(s)
    return out


def test_h6a_patch_swaps_ffn_quantises_once_and_reverts():
    eng = DitEngine(override(load_preset("tiny"), parallel={"sp": 1}), group=RankGroup.single(), device=torch.device("cpu"), seed=1)
    originals = {p: eng.model.get_submodule(p) for p in block_paths(len(eng.model.blocks), "ffn")}
    base = _latents(eng)
    cand = get("H6a")
    revert = cand.patch_dit(eng, "ffn")
    swapped = {p: eng.model.get_submodule(p) for p in originals}
    assert all(isinstance(m, Fp8Linear) for m in swapped.values())
    assert isinstance(eng.model.blocks[0].self_attn.o, nn.Linear)  # "ffn" leaves attention alone
    fp8 = _latents(eng)
    diff = max(float((a - b).norm() / b.norm()) for a, b in zip(fp8, base))
    assert 0 < diff < 0.1, diff  # it changes the numbers, by about FP8's rounding
    revert()
    assert all(eng.model.get_submodule(p) is m for p, m in originals.items())
    assert all(torch.equal(a, b) for a, b in zip(_latents(eng), base))
    revert = cand.patch_dit(eng, "ffn")  # the quantised weights are reused, not rebuilt
    assert all(eng.model.get_submodule(p) is m for p, m in swapped.items())
    revert()
    revert = cand.patch_dit(eng, "ffn+o")
    assert isinstance(eng.model.blocks[1].cross_attn.o, Fp8Linear)
    revert()
    assert isinstance(eng.model.blocks[1].cross_attn.o, nn.Linear)


# ---- the layer sets of H6a's later arguments: ffn-mid, ffn+attn-smooth -----------------------------
def _outlier_input(k=128, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, k, generator=g)
    x[:, [7, 40]] *= 60.0  # two outlier input channels, in every token (the SmoothQuant pattern)
    return x


def test_smoothing_identity_is_exact_in_fp32():
    from harness.engine.fp8_linear import smooth_factors

    lin, x = _linear(), _outlier_input()
    s = smooth_factors(x.abs().amax(dim=0), lin.weight)
    assert s.shape == (128,) and torch.equal(s, torch.exp2(torch.log2(s).round()))  # powers of two
    assert float(s[7]) > 4 and float(s[40]) > 4  # the outlier channels are narrowed
    # scaling by powers of two moves exponents only: the same fp32 products, summed alike
    assert torch.equal((x * (1.0 / s)) @ (lin.weight * s).t(), x @ lin.weight.t())


def test_smoothed_fp8_linear_scale_shapes_and_error():
    from harness.engine.fp8_linear import smooth_factors

    # e4m3 is floating point: outliers cost precision only once they push the ordinary values of
    # a token below its normal range (2¹⁵ under the amax) — here channels ×1e6 whose weight
    # columns are ×1e-6, so both sides of the product matter (the case smoothing is for)
    lin, x = _linear(), _outlier_input()
    x[:, [7, 40]] *= 1e6 / 60.0
    with torch.no_grad():
        lin.weight[:, [7, 40]] *= 1e-6
    s = smooth_factors(x.abs().amax(dim=0), lin.weight)
    plain, smoothed = Fp8Linear(lin), Fp8Linear(lin, s)
    assert smoothed.w8.shape == (96, 128) and smoothed.w8.dtype == torch.float8_e4m3fn
    assert smoothed.w_scale.shape == (1, 96) and smoothed.inv_smooth.shape == (128,) and plain.inv_smooth is None
    assert rowwise_quantize(x)[1].shape == (64, 1)  # per token (row) of the activation
    ref = F.linear(x.double(), lin.weight.double(), lin.bias.double())
    err = {name: float((m(x).double() - ref).norm() / ref.norm()) for name, m in (("plain", plain), ("smooth", smoothed))}
    # unsmoothed, the outliers set every token's scale and the ordinary values go subnormal;
    # smoothed, both operands stay in e4m3's normal range
    assert err["smooth"] < 0.5 * err["plain"] and err["smooth"] < 0.06, err


def test_ffn_mid_keeps_the_first_and_last_blocks_bf16():
    from harness.engine.fp8_linear import EDGE_BF16

    paths = block_paths(8, "ffn-mid")
    assert EDGE_BF16["ffn-mid"] == 2 and {p.split(".")[1] for p in paths} == {"2", "3", "4", "5"}
    assert len(paths) == 4 * 2 and block_paths(8, "ffn") == block_paths(8, "ffn")[:16]


def test_input_amax_records_each_linear_and_reduces():
    from harness.engine.fp8_linear import input_amax

    root = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)).requires_grad_(False)
    x = torch.randn(5, 16)
    reduced = []
    amax = input_amax(root, ["0", "2"], lambda: (root(x), root(2 * x)), reduce=reduced.append)
    assert torch.equal(amax["0"], (2 * x).abs().amax(dim=0))
    hidden = torch.cat([torch.relu(root[0](x)), torch.relu(root[0](2 * x))])
    assert torch.equal(amax["2"], hidden.abs().amax(dim=0))
    assert len(reduced) == 2
    with pytest.raises(HarnessError, match="never reached 2"):
        input_amax(root, ["0", "2"], lambda: root[0](x))


def test_h6a_smoothed_and_mid_sets_patch_calibrate_once_and_revert():
    eng = DitEngine(override(load_preset("tiny"), parallel={"sp": 1}), group=RankGroup.single(), device=torch.device("cpu"), seed=1)
    n = len(eng.model.blocks)
    base = _latents(eng)
    cand = get("H6a")
    revert = cand.patch_dit(eng, "ffn-mid")
    assert isinstance(eng.model.blocks[0].ffn[0], nn.Linear) and isinstance(eng.model.blocks[n - 1].ffn[2], nn.Linear)
    if n > 4:
        assert isinstance(eng.model.blocks[2].ffn[0], Fp8Linear)
    revert()
    revert = cand.patch_dit(eng, "ffn+attn-smooth")
    o = eng.model.blocks[0].self_attn.o
    assert isinstance(o, Fp8Linear) and o.inv_smooth is not None and isinstance(eng.model.blocks[0].ffn[0], Fp8Linear)
    assert eng.model.blocks[0].ffn[0].inv_smooth is None
    assert eng.kv_stats()["blocks_used"] == 0  # the calibration session is gone
    revert()
    assert isinstance(eng.model.blocks[0].self_attn.o, nn.Linear)
    assert all(torch.equal(a, b) for a, b in zip(_latents(eng), base))
    cand.patch_dit(eng, "ffn+attn-smooth")()  # cached: no second calibration, the same modules
    assert h6a_fp8_linear.QUANTISED[eng][f"smooth:ffn+attn-smooth"]["blocks.0.self_attn.o"] is o
    assert not any(k.startswith("_fp8") for k in vars(eng))  # the candidate's state is its own
