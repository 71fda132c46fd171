"""FA3 / FP8 attention on the CPU: the refusals where the wheel or a Hopper GPU is missing, and
the arithmetic the kernels rely on — per-head e4m3 scales, the exactness of the K/V mean shifts
and what each rounding costs, checked on an fp32 emulation against float64 attention."""

from __future__ import annotations

import pytest
import torch

from harness import candidates as C
from harness.config import load_preset, override
from harness.engine import attention as A
from harness.engine import fa3
from harness.errors import HarnessError
from harness.experiments.replay.op_backends_fa3 import emulate_fp8_attention

needs_no_fa3 = pytest.mark.skipif(fa3.unavailable_reason("cuda") is None, reason="FA3 runs here: nothing to refuse")


def _qkv(sq=48, sk=160, h=4, d=32, seed=0, k_offset=0.0, v_offset=0.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, s, d, generator=g) for s in (sq, sk, sk))
    return q, k + k_offset, v + v_offset


def _ref(q, k, v):
    q, k, v = q.double(), k.double(), v.double()
    p = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
    return p @ v


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def test_fa3_backends_registered_and_refuse_on_cpu_with_one_line():
    for name in ("fa3", "fa3-fp8", "fa3-fp8-smooth"):
        fn = A.dense(name)
        q, k, v = _qkv()
        with pytest.raises(HarnessError) as e:
            fn(q, k, v)
        assert "\n" not in str(e.value) and "FlashAttention-3" in str(e.value)
    assert "fa3" in A.PARTIALS


@needs_no_fa3
@pytest.mark.parametrize("spec", ["H1b:fa3", "H6b", "H6b:head", "H6c"])
def test_fa3_candidates_refused_before_launch(spec):
    cfg = load_preset("tiny")
    for device in ("cpu", "cuda"):
        with pytest.raises(HarnessError, match="needs"):
            C.resolve([spec], override(cfg, runtime={"device": device}))


def test_fp8_candidates_conflicts_and_configuration(monkeypatch):
    cfg = load_preset("tiny")
    monkeypatch.setattr(C, "_available", lambda need, device: True)  # as on a Hopper GPU with the wheel
    for pair in (["H6c", "H6a"], ["H6b", "H1b:fa3"], ["H6c", "H6b"]):
        with pytest.raises(HarnessError, match="conflict"):
            C.resolve(pair, cfg)
    assert [c.id for c, _ in C.resolve(["H1b:fa3", "H6a"], cfg)] == ["H1b", "H6a"]  # FA3 bf16 + FP8 FFN compose
    monkeypatch.undo()
    # configure() sets the attention backend without checking availability (resolve does that)
    assert C.get("H6b").configure(cfg, "smooth").runtime.attention == "fa3-fp8-smooth"
    assert C.get("H6c").configure(cfg, "head").runtime.attention == "fa3-fp8"
    with pytest.raises(HarnessError, match="needs cuda"):
        C.resolve(["H6a"], cfg)  # a GPU candidate, though its patch runs on the CPU (its own tests)


def test_head_scale_maps_each_heads_amax_to_e4m3_max():
    x = torch.randn(64, 3, 16)
    x[:, 1] *= 1000.0
    x8, s, m = fa3.quantize_heads(x)
    assert x8.dtype == torch.float8_e4m3fn and s.shape == (3,) and m is None
    amax8 = x8.float().abs().amax(dim=(0, 2))
    torch.testing.assert_close(amax8, torch.full((3,), fa3.FP8_MAX))
    back = x8.float() * s[None, :, None]
    rel = ((back - x).abs() / x.abs().clamp_min(1e-3 * x.abs().amax())).amax()
    assert rel <= 2.0 ** -4 + 1e-6  # e4m3: 3 mantissa bits, half an ulp of relative error at most
    assert torch.isfinite(fa3.quantize_heads(torch.zeros(4, 2, 16))[1]).all()


def test_smoothed_quantisation_scales_the_shifted_range():
    x = torch.randn(200, 2, 16) * 0.1 + torch.linspace(-5, 5, 16)  # channel offsets dwarf the spread
    x8, s, m = fa3.quantize_heads(x, smoothed=True)
    torch.testing.assert_close(m, x.mean(0))
    shifted = x - m
    torch.testing.assert_close(x8.float().abs().amax(dim=(0, 2)), torch.full((2,), fa3.FP8_MAX))
    assert float(((x8.float() * s[None, :, None] - shifted).norm() / shifted.norm())) < 0.05
    plain8, ps, _ = fa3.quantize_heads(x)
    # unshifted, the offsets set the scale: the spread around them is rounded far more coarsely
    err_plain = float((plain8.float() * ps[None, :, None] - x).norm())
    assert err_plain > 3 * float((x8.float() * s[None, :, None] - shifted).norm())


def test_mean_shifts_are_exact_in_exact_arithmetic():
    q, k, v = (x.double() for x in _qkv(k_offset=3.0, v_offset=-2.0))
    km, vm = k.mean(dim=2, keepdim=True), v.mean(dim=2, keepdim=True)  # per (head, channel) over tokens
    out = _ref(q, k - km, v - vm) + vm
    torch.testing.assert_close(out, _ref(q, k, v), rtol=1e-10, atol=1e-10)


def test_emulation_without_rounding_matches_float64():
    q, k, v = _qkv()
    assert _rel(emulate_fp8_attention(q, k, v, parts=""), _ref(q, k, v)) < 1e-5


def test_each_rounding_costs_about_e4m3_precision_and_the_shift_removes_offsets():
    q, k, v = _qkv(sk=512, v_offset=4.0)  # V with a large common offset, as biased projections give
    ref = _ref(q, k, v)
    errs = {parts: _rel(emulate_fp8_attention(q, k, v, parts), ref) for parts in ("v", "qk", "p", "qkvp")}
    for parts, e in errs.items():
        assert 1e-4 < e < 0.1, (parts, e)
    # the offset dominates V's range: shifting it out leaves only the varying part to round,
    # and the output error (relative to an output that now carries the offset) shrinks
    smooth = _rel(emulate_fp8_attention(q, k, v, "v", smoothed=True), ref)
    assert smooth < errs["v"] / 2, (smooth, errs["v"])


def test_smooth_early_switches_fp8_per_forward_and_reverts():
    from harness.candidates.h6b_fp8_attention import FP8_STEPS, patch_steps
    from harness.engine.dit_engine import DitEngine
    from harness.engine.groups import RankGroup

    eng = DitEngine(override(load_preset("tiny"), parallel={"sp": 1}), group=RankGroup.single(),
                    device=torch.device("cpu"), seed=0)
    assert patch_steps(eng, "smooth")() is None and eng.hooks == []  # other arguments add nothing
    revert = patch_steps(eng, "smooth-early")
    seen = []
    for step in range(5):
        eng._emit("step_start", step=step)
        seen.append(eng.attention)
    assert seen == ["fa3-fp8-smooth"] * FP8_STEPS + ["fa3"] * (5 - FP8_STEPS)
    revert()
    assert eng.hooks == []
