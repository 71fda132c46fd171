"""The recorder's FLOPs for tiny-preset DiT chunks equal an independent count from the model
shapes: linear exactly, attention with the effective KV length before and after the sink+window
saturates — on CPU and on the meta device, for both KV paths."""

import pytest
import torch

from harness.config import load_preset, override
from harness.engine import dit_engine
from harness.engine.groups import RankGroup
from harness.hooks import context as hctx
from harness.hooks.dispatch import DispatchRecorder


#: CPU: the tiny preset as is — the 18-frame window (6 chunks of 3) saturates at chunk 5, chunk 6
#: is past it. Meta: elementwise meta kernels are Python references (~3 s a paged chunk), so the
#: meta runs shrink the window to 3 sink + 6 recent frames, which saturates at chunk 2.
CHUNKS = {"cpu": 7, "cuda": 7, "meta": 4}
SMALL_WINDOW = {"sink_frames": 3, "window_frames": 9}


def expected_per_step(cfg, kv_tokens):
    """FLOPs of one DiT forward, by category, written from the architecture (DESIGN §2)."""
    m, f = cfg.model, cfg.video.frames_per_chunk
    n, d = cfg.tokens_per_chunk, m.dim
    patch = 1
    for p in m.patch_size:
        patch *= p
    linear = (
        2 * n * d * (m.in_channels * patch)  # patch_embedding (a conv, counted as the GEMM it is)
        + 2 * f * m.freq_dim * d + 2 * f * d * d  # time_embedding, one timestep per latent frame
        + 2 * f * d * 6 * d  # time_projection
        + 2 * n * (m.cam_channels * patch) * d  # patch_embedding_wancamctrl
        + 2 * (2 * n * d * d)  # c2ws_hidden_states_layer1/2
        + 2 * n * d * (m.out_channels * patch)  # head
    )
    per_block = (
        2 * n * d * 3 * d + 2 * n * d * d  # fused qkv, o
        + 4 * (2 * n * d * d)  # cam_injector_layer1/2, cam_scale_layer, cam_shift_layer
        + 2 * (2 * n * d * d)  # cross q, o (text K/V are per session)
        + 2 * (2 * n * d * m.ffn_dim)  # ffn.0, ffn.2
    )
    linear += m.num_layers * per_block
    self_attn = m.num_layers * 4 * n * kv_tokens * m.num_heads * m.head_dim
    cross = m.num_layers * 4 * n * m.text_len * m.num_heads * m.head_dim
    return {"linear": linear, "self_attention": self_attn, "cross_attention": cross}


def effective_kv(cfg, chunk):
    """Visible frames: everything so far plus this chunk, capped at the window (sink + recent)."""
    frames = min((chunk + 1) * cfg.video.frames_per_chunk, cfg.cache.window_frames)
    return frames * cfg.tokens_per_frame


_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device,kv_path", [
    ("cpu", "gather"), ("cpu", "paged"), ("meta", "gather"), ("meta", "paged"),
    pytest.param("cuda", "gather", marks=_cuda), pytest.param("cuda", "paged", marks=_cuda),
])
def test_tiny_chunk_flops_match_the_model_shapes(device, kv_path):
    runtime = {"kv_path": kv_path, "device": device if device != "meta" else "cpu"}
    if device == "cuda":
        runtime["dtype"] = "bfloat16"  # the fused kernels, as in production
    cfg = override(load_preset("tiny"), parallel={"sp": 1, "vae_ranks": 1}, runtime=runtime,
                   cache=SMALL_WINDOW if device == "meta" else {})
    eng = dit_engine.DitEngine(cfg, group=RankGroup.single(), device=torch.device(device), seed=0)
    s = eng.start_session(dit_engine.SessionConditions(prompt="flops", seed=1))
    actions = ["W"] * cfg.video.frames_per_chunk
    steps = len(cfg.schedule.timesteps) + 1  # 4 denoise + commit
    saw_saturation = False
    for chunk in range(CHUNKS[device]):
        rec = DispatchRecorder(group_by=("step",))
        with rec, hctx.phase(session=s.sid, chunk=chunk):
            eng.generate_chunk(s, actions)
        kv = effective_kv(cfg, chunk)
        assert s.kv_tokens[-1] == kv, "the engine's effective KV length disagrees with the window rule"
        saw_saturation |= kv == cfg.max_kv_tokens and chunk > 0 and effective_kv(cfg, chunk - 1) == kv
        want = expected_per_step(cfg, kv)
        by_step = rec.flops_by("step")
        for step in range(steps):
            got = by_step[(step,)]
            for cat, flops in want.items():
                assert got.get(cat, 0) == flops, (chunk, step, cat)
            assert got.get("attention", 0) == 0 and got.get("vae_conv", 0) == 0
        # Outside the 5 forwards: the camera ray directions (pixels × 3×3 rotation per frame) and the
        # fp32 pose differencing of production's convention, in torch: f + 1 rotations of a 3-vector
        # (the anchor's and each frame's) and 2f + 1 products of 4×4 poses.
        outside = by_step.get((None,), {})
        pixels, f = cfg.video.height * cfg.video.width, cfg.video.frames_per_chunk
        poses = (f + 1) * 2 * 3 * 3 + (2 * f + 1) * 2 * 4**3
        assert sum(outside.values()) == 2 * f * pixels * 3 * 3 + poses
        assert rec.total_flops == steps * sum(want.values()) + sum(outside.values())
    assert saw_saturation
    eng.end_session(s)
