"""H3b at the engine, tiny preset on CPU: the reduced-precision decodes against the fp32 decode
of the same latents under the pixel gate (DESIGN §5: RMSE ≤ 0.01, i.e. PSNR ≥ 46 dB on [−1, 1],
and max|Δ| ≤ 0.03), a seeded bad variant that the gate must fail, and the revert's bit-exact
return to fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.candidates import get
from harness.config import load_preset
from harness.engine.groups import RankGroup
from harness.engine.vae_engine import VaeEngine
from harness.measure.gates import DEFAULT_THRESHOLDS, frame_metrics, pixel_passes, psnr_db

CHUNKS = 2


def _decode(eng: VaeEngine) -> list[np.ndarray]:
    g = torch.Generator().manual_seed(0)
    s = eng.start_session()
    out = [eng.decode_chunk(s, torch.randn(16, 3, eng.latent_h, eng.latent_w, generator=g)) for _ in range(CHUNKS)]
    eng.end_session(s)
    return [x.numpy().copy() for x in out]


def _patched(eng: VaeEngine, arg: str) -> tuple[list[np.ndarray], torch.dtype]:
    revert = get("H3b").patch_vae(eng, arg)
    try:
        return _decode(eng), eng.dtype
    finally:
        revert()


@pytest.fixture(scope="module")
def runs():
    torch.set_num_threads(1)
    eng = VaeEngine(load_preset("tiny"), group=RankGroup.single(), device=torch.device("cpu"), seed=0)
    ref = _decode(eng)
    out = {"eng": eng, "fp32": ref}
    for arg in ("bf16", "fp16", "tf32-off"):
        out[arg], out[f"{arg}.dtype"] = _patched(eng, arg)
    steps: list[int] = []  # latent frames per decoder forward under fp16-chunk
    hook = eng.model.decoder.register_forward_pre_hook(lambda _m, args: steps.append(args[0].shape[2]))
    try:
        out["fp16-chunk"], out["fp16-chunk.dtype"] = _patched(eng, "fp16-chunk")
    finally:
        hook.remove()
    out["fp16-chunk.steps"] = steps
    out["after"] = _decode(eng)
    return out


def _metrics(ref, other) -> list[dict]:
    return [frame_metrics(a, b) for a, b in zip(ref, other)]


def test_bf16_decode_runs_in_bf16_and_returns_fp32_frames_within_the_rmse_gate(runs):
    assert runs["bf16.dtype"] == torch.bfloat16
    assert all(x.dtype == np.float32 and x.shape == y.shape for x, y in zip(runs["bf16"], runs["fp32"]))
    for m in _metrics(runs["fp32"], runs["bf16"]):
        assert m["nonfinite"] == 0 and 0 < m["rmse"] <= DEFAULT_THRESHOLDS.pixel_rmse, m
        assert psnr_db(m["rmse"]) >= 46.0, m
        # bf16's 8-bit mantissa: the worst pixel is a few uint8 steps off, not a broken cast
        assert m["max_abs"] < 0.25, m


def test_fp16_decode_passes_the_whole_pixel_gate(runs):
    assert runs["fp16.dtype"] == torch.float16
    for m in _metrics(runs["fp32"], runs["fp16"]):
        assert not pixel_passes(m), m
        assert m["rmse"] > 0  # it did run in fp16


def test_fp16_in_whole_chunk_steps_passes_the_pixel_gate_against_the_one_frame_fp32_decode(runs):
    # chunk 0: its first latent frame alone, then the other two at once; chunk 1: all three at once
    assert runs["fp16-chunk.steps"] == [1, 2, 3]
    assert runs["fp16-chunk.dtype"] == torch.float16
    for m in _metrics(runs["fp32"], runs["fp16-chunk"]):
        assert not pixel_passes(m), m
        assert m["rmse"] > 0
    # Not asserted: that the whole-chunk sums differ bitwise from the one-frame ones. Whether they do is
    # the CPU convolution algorithm's choice (equal on some 2-core machines, different on others); the
    # schedule itself is what the steps above assert.


def test_tf32_off_is_fp32_and_bit_identical_where_there_is_no_tf32(runs):
    assert runs["tf32-off.dtype"] == torch.float32
    assert all(np.array_equal(a, b) for a, b in zip(runs["fp32"], runs["tf32-off"]))


def test_revert_restores_the_bit_exact_fp32_decode(runs):
    eng = runs["eng"]
    assert eng.dtype == torch.float32 and eng.decode_tf32 is None
    assert eng.frames_per_step == 1 and eng.decode_autotune is None and torch.backends.cudnn.benchmark is False
    assert all(p.dtype == torch.float32 for p in eng.model.parameters())
    assert all(np.array_equal(a, b) for a, b in zip(runs["fp32"], runs["after"]))


def test_the_gate_fails_an_fp16_decode_that_overflows(runs):
    """A seeded bad variant: fp16 with no scaling on a decoder whose activations leave fp16's
    range (the first convolution's weights ×1e4). fp32 stays finite; fp16 must be refused."""
    eng = runs["eng"]
    w = eng.model.decoder.conv_in.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.mul_(1e4)
        ref = _decode(eng)
        assert all(np.isfinite(x).all() for x in ref)
        bad, _ = _patched(eng, "fp16")
    finally:
        with torch.no_grad():
            w.copy_(saved)
    assert any(pixel_passes(m) for m in _metrics(ref, bad))


def test_the_image_encoder_keeps_the_configured_dtype(runs):
    """H3b changes the decode only: an image encoded while it is applied is the fp32 encoding."""
    eng = runs["eng"]
    img = torch.randint(0, 256, (eng.latent_h * 8, eng.latent_w * 8, 3), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(4))
    ref = eng.encode_image(img)
    revert = get("H3b").patch_vae(eng, "bf16")
    try:
        assert eng.dtype == torch.bfloat16 and torch.equal(eng.encode_image(img), ref)
    finally:
        revert()
