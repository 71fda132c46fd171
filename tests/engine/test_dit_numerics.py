"""Activation scale over many chunks, schedule values, camera actions/poses/rays, conditions, layout."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from harness.config import ScheduleConfig, load_preset, override
from harness.engine import camera, schedule
from harness.engine.conditions import (GivenLatent, SessionConditions, image_condition, load_text_embedding,
                                       session_text_embedding, synthetic_text_embedding)
from harness.engine.dit import RopeTables, TokenLayout, apply_rope, rope_dims, unpatchify
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup
from harness.errors import HarnessError

CPU = torch.device("cpu")


def _block_rms(cfg, chunks: int) -> tuple[np.ndarray, list[float]]:
    """RMS of every block's output for every forward (chunks × 5 × layers), and the latent RMS."""
    eng = DitEngine(cfg, group=RankGroup.single(), device=CPU, seed=0)
    rms: list[float] = []
    for b in eng.model.blocks:
        b.register_forward_hook(lambda m, a, out: rms.append(out.pow(2).mean().sqrt().item()))
    s = eng.start_session(SessionConditions(prompt="scale", seed=1))
    lat = []
    for c in range(chunks):
        x = eng.generate_chunk(s, ["W", "WJ", "I"])  # keep moving: ray origins grow every chunk
        assert torch.isfinite(x).all()
        lat.append(x.pow(2).mean().sqrt().item())
    eng.end_session(s)
    return np.array(rms).reshape(chunks, 5, cfg.model.num_layers), lat


def test_activations_stay_sane_over_ten_chunks():
    # measured: block outputs 0.64–1.02, latent 1.37–1.42 (weights.py explains the scaling)
    rms, lat = _block_rms(override(load_preset("tiny"), parallel={"sp": 1}), 10)
    assert np.isfinite(rms).all() and 0.3 < rms.min() and rms.max() < 3, (rms.min(), rms.max())
    assert all(1.0 < v < 2.0 for v in lat), lat


def test_activations_stay_sane_through_forty_layers():
    # full-size depth at tiny width: the residual stream grows to ≈ 2.6, not exponentially
    cfg = override(load_preset("tiny"), parallel={"sp": 1}, model={"num_layers": 40})
    rms, lat = _block_rms(cfg, 3)
    assert np.isfinite(rms).all() and 0.3 < rms.min() and rms.max() < 6, (rms.min(), rms.max())
    assert all(1.0 < v < 2.5 for v in lat), lat


# ---- schedule -------------------------------------------------------------------------------------
def test_schedule_values():
    sched = ScheduleConfig()
    assert schedule.sigmas(sched) == pytest.approx([1.0, 0.9375, 0.8333333333, 0.625])
    assert schedule.model_timesteps(sched) == pytest.approx([1000.0, 937.5, 833.3333333, 625.0, 0.0])
    assert schedule.phases(sched) == ["denoise0", "denoise1", "denoise2", "denoise3", "commit"]
    x, v, n = torch.full((2,), 3.0), torch.full((2,), 2.0), torch.full((2,), -1.0)
    x0 = schedule.predict_x0(x, v, 0.5)
    assert torch.equal(x0, torch.full((2,), 2.0))
    assert torch.equal(schedule.renoise(x0, n, 0.25), torch.full((2,), 1.25))


# ---- camera ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("actions,match", [
    (["W", "X", ""], "invalid key"),
    (["W", ""], "expected 3 actions"),
    (["W", 1, ""], "must be a string or a list"),
    ([["w", "jl"], [], []], "single keys"),
    ("WWW", "must be a list"),
])
def test_bad_actions_are_clear_errors(actions, match):
    with pytest.raises(HarnessError, match=match):
        camera.validate_actions(actions, 3)


def _poses(actions, state=None):
    return camera.integrate_actions(camera.validate_actions(actions, len(actions)), state or camera.CameraState.start())[0]


def test_actions_move_the_camera():
    step, eps = camera.TRANSLATE_STEP, camera.DIRECTION_EPS
    p = _poses(["w", "w", "d"])
    assert np.allclose(p[1][:3, 3], [0, 0, 2 * step / (1 + eps)])
    assert np.allclose(p[2][:3, 3], [step / (1 + eps), 0, 2 * step / (1 + eps)])
    yaw_left = _poses(["j"])[0]
    assert yaw_left[0, 2] < 0  # forward (+z) turns toward −x, the left
    pitch_up = _poses(["i"])[0]
    assert pitch_up[1, 2] < 0  # forward turns toward −y, up in image coordinates
    assert np.allclose(_poses(["ws", "ad", "ik", "jl"]), np.eye(4))
    turned = _poses(["l"] * 15 + ["w"])[-1]  # 15 × 6° = 90° right, then forward
    assert np.allclose(turned[:3, 3], [step, 0, 0], atol=1e-6)
    # looking down does not move the camera down: translation stays on the ground plane
    assert abs(_poses(["k"] * 5 + ["w"])[-1][1, 3]) < 1e-12
    # pitch is clamped at ±85°: 21 steps of 4° reach 84°, the 22nd is dropped
    _, pitch = camera.integrate_actions(["i"] * 30, camera.CameraState.start())
    assert math.degrees(pitch) == pytest.approx(84.0)
    rel = camera.framewise_poses(np.eye(4), p, None)
    assert rel.dtype == torch.float32 and np.allclose(np.linalg.norm(rel[:, :3, 3].numpy(), axis=-1), [1, 1, 1])  # the chunk's largest step is 1
    assert np.allclose(camera.framewise_poses(np.eye(4), _poses(["", "", ""]), None).numpy(), np.eye(4))
    camera.validate_poses(p, 3)


@pytest.mark.parametrize("bad,match", [
    (np.full((3, 4, 4), np.nan), "non-finite"),
    (np.stack([np.eye(4)] * 3) * 2, "last row|orthonormal"),
    (np.stack([np.diag([1.0, 1.0, -1.0, 1.0])] * 3), "reflection"),
    (np.zeros((3, 3, 3)), "shape"),
    (np.stack([np.eye(4)] * 2), "expected 3 poses"),
])
def test_bad_poses_are_clear_errors(bad, match):
    with pytest.raises(HarnessError, match=match):
        camera.validate_poses(bad, 3)


def test_rays_layout():
    h, w = 32, 48
    rays = camera.CameraRays(h, w, CPU)
    poses = torch.from_numpy(_poses(["w", "j"])).float()
    out = rays(poses)
    assert out.shape == (384, 2, h // 8, w // 8)
    # channel c·64 + dy·8 + dx holds ray channel c of pixel (8·y + dy, 8·x + dx)
    full = out.view(6, 8, 8, 2, h // 8, w // 8).permute(3, 4, 1, 5, 2, 0).reshape(2, h, w, 6)
    assert torch.allclose(full[..., :3], poses[:, None, None, :3, 3].expand(2, h, w, 3))
    assert torch.allclose(full[..., 3:].norm(dim=-1), torch.ones(2, h, w), atol=1e-6)
    centre = full[0, h // 2 - 1 : h // 2 + 1, w // 2 - 1 : w // 2 + 1, 3:].mean(dim=(0, 1))
    assert torch.allclose(centre / centre.norm(), torch.tensor([0.0, 0.0, 1.0]), atol=1e-6)


def test_engine_rejects_bad_actions_without_state_change():
    cfg = override(load_preset("tiny"), parallel={"sp": 1})
    eng = DitEngine(cfg, group=RankGroup.single(), device=CPU, seed=0)
    s = eng.start_session(SessionConditions(prompt="x"))
    with pytest.raises(HarnessError, match="invalid key"):
        eng.generate_chunk(s, ["W", "Q", ""])
    assert s.chunk == 0 and eng.kv_stats()["blocks_used"] == 0
    a = eng.generate_chunk(s, ["W", "", ""])
    b = eng.generate_chunk(s, poses=_poses(["W", "W", "W"], s.pose_state))
    assert a.shape == b.shape and s.chunk == 2
    eng.end_session(s)


# ---- conditions -----------------------------------------------------------------------------------
def test_text_embeddings(tmp_path):
    a = synthetic_text_embedding("a castle", 3, 16, 32)
    assert torch.equal(a, synthetic_text_embedding("a castle", 3, 16, 32))
    assert not torch.equal(a, synthetic_text_embedding("a castle", 4, 16, 32))
    assert not torch.equal(a, synthetic_text_embedding("a forest", 3, 16, 32))
    assert 0.8 < a.std().item() < 1.2
    short = torch.randn(5, 32)
    np.save(tmp_path / "t.npy", short.numpy())
    save_file({"text_embedding": short}, str(tmp_path / "t.safetensors"))
    for f in ("t.npy", "t.safetensors"):
        t = load_text_embedding(tmp_path / f, 16, 32)
        assert t.shape == (16, 32) and torch.equal(t[:5], short) and not t[5:].any()
    np.save(tmp_path / "bad.npy", np.zeros((5, 31), np.float32))
    with pytest.raises(HarnessError, match=r"shape \(≤16, 32\)"):
        load_text_embedding(tmp_path / "bad.npy", 16, 32)
    with pytest.raises(HarnessError, match="shape"):
        session_text_embedding(SessionConditions(text_embedding=torch.zeros(17, 32)), 16, 32)


def test_image_condition_layout():
    img = GivenLatent(torch.randn(16, 1, 4, 6), 3)  # a latent handed over: zero latents after it
    y0 = image_condition(img, 0, 3, 4, 6, device=CPU, dtype=torch.float32)
    assert y0.shape == (20, 3, 4, 6)
    assert torch.equal(y0[:4, 0], torch.ones(4, 4, 6)) and not y0[:4, 1:].any()
    assert torch.equal(y0[4:, 0], img.latent[:, 0]) and not y0[4:, 1:].any()
    assert not image_condition(img, 1, 3, 4, 6, device=CPU, dtype=torch.float32).any()
    assert not image_condition(None, 0, 3, 4, 6, device=CPU, dtype=torch.float32)[4:].any()
    cfg = override(load_preset("tiny"), parallel={"sp": 1})
    eng = DitEngine(cfg, group=RankGroup.single(), device=CPU, seed=0)
    with pytest.raises(HarnessError, match="image latent must have shape"):
        eng.start_session(SessionConditions(image_latent=torch.zeros(16, 1, 3, 3)))


# ---- model geometry -------------------------------------------------------------------------------
def test_rope_split_and_token_layout():
    assert rope_dims(128) == (44, 42, 42) and sum(rope_dims(16)) == 16
    # SP4 at 480×832: 1170 tokens per rank against 1560-token frames
    lay = TokenLayout(3, 1560, 1170, 2340)
    assert lay.segments == ((0, 0, 390), (1, 390, 1170)) and not lay.aligned
    x = torch.randn(1170, 8)
    shift, scale, gate = torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 8)
    fi = torch.arange(1170, 2340) // 1560
    assert torch.allclose(lay.modulate(x, shift, scale), x * (1 + scale[fi]) + shift[fi], atol=1e-5)
    x0 = x.clone()
    assert torch.allclose(lay.gated_add(x, x, gate), x + x * gate[fi], atol=1e-5)
    # a bf16 branch onto the fp32 residual stream: fp32 out, and x itself is never written
    mixed = lay.gated_add(x, x.bfloat16(), gate)
    assert mixed.dtype == torch.float32 and torch.equal(x, x0)
    assert torch.allclose(mixed, x + x.bfloat16().float() * gate[fi], atol=1e-5)
    whole = TokenLayout(3, 32, 32, 96)
    assert whole.aligned and whole.segments == ((1, 0, 32), (2, 32, 64))
    y = torch.randn(64, 8)
    fj = torch.arange(32, 96) // 32
    assert torch.allclose(whole.modulate(y, shift, scale), y * (1 + scale[fj]) + shift[fj], atol=1e-5)
    assert torch.allclose(whole.gated_add(y, y, gate), y + y * gate[fj], atol=1e-5)


def test_rope_rotates_pairs_at_absolute_frames():
    grid = (3, 4, 8)
    lay = TokenLayout(3, 32, 0, 96)
    rope = RopeTables(16, grid, lay, CPU)
    x = torch.randn(96, 2, 16)
    rot = rope.for_chunk(0)
    y = apply_rope(x, rot)
    # Wan's layout: channel pairs (2i, 2i+1) rotate as one complex number
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = rot[..., 0], rot[..., 1]
    assert torch.allclose(y[..., 0::2], x0 * c - x1 * s, atol=1e-6)
    assert torch.allclose(y[..., 1::2], x0 * s + x1 * c, atol=1e-6)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    # the real-arithmetic form that traced (compiled) code runs is the same rotation
    traced = torch.compile(apply_rope, backend="eager", fullgraph=True)
    assert torch.allclose(traced(x, rot), y, atol=1e-6)
    # positions are absolute latent frames, so q·k depends on the frame distance alone
    q, k = apply_rope(x, rope.for_chunk(6)), apply_rope(x, rope.for_chunk(3))
    q2, k2 = apply_rope(x, rope.for_chunk(16)), apply_rope(x, rope.for_chunk(13))
    assert torch.allclose((q * k).sum(-1), (q2 * k2).sum(-1), atol=1e-4)
    assert not torch.allclose(apply_rope(x, rope.for_chunk(3)), y)
    with pytest.raises(HarnessError, match="RoPE"):
        rope.for_chunk(1023)


def test_unpatchify_inverts_wan_patch_order():
    c, f, h, w = 16, 3, 4, 6  # latent (16, 3, 8, 12), patch (1, 2, 2)
    lat = torch.randn(c, f, 2 * h, 2 * w)
    tokens = lat.view(c, f, h, 2, w, 2).permute(1, 2, 4, 3, 5, 0).reshape(f * h * w, 4 * c)  # (pt ph pw c)
    assert torch.equal(unpatchify(tokens, (f, h, w), (1, 2, 2), c), lat)
    assert math.prod((1, 2, 2)) * c == 64
