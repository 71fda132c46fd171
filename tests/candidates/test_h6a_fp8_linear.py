"""H6a: ``Fp8Linear`` against a float64 reference (per-token × per-channel e4m3, so the error is
e4m3's own rounding even with an outlier token and an outlier channel), the refusal of shapes
``_scaled_mm`` cannot take, and the engine patch: FFN layers swapped, quantised once, reverted to
the very same modules with byte-identical latents after revert."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.candidates import get
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
