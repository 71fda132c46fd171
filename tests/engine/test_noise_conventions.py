"""What a seed means (``schedule.noise``) and the image condition after the first frame, on the
reference engine (tiny preset, CPU): production's stream per session by default, reproducible run
to run, untouched by other sessions (interleaved or cancelled) and by a chunk that failed and ran
again; the per-(seed, chunk, step) option; the encoder's condition over zero pixel frames."""

from __future__ import annotations

import pytest
import torch

from harness.config import apply_sets, load_preset, override
from harness.engine.conditions import SessionConditions
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup
from harness.engine.image import conditioning_image, conditioning_image_latent, synthetic_image
from harness.engine.noise import SessionNoise
from harness.errors import ConfigError

CPU = torch.device("cpu")
ACTIONS = [["w", "wj", ""], ["d", "", "i"], ["", "", ""]]
CHUNKS = 3


@pytest.fixture(scope="module")
def cfg():
    return override(load_preset("tiny"), parallel={"sp": 1}, cache={"max_sessions": 2})  # two open at once


@pytest.fixture(scope="module")
def engine(cfg):
    return DitEngine(cfg, group=RankGroup.single(), device=CPU, seed=4)


def _session(eng: DitEngine, seed: int, chunks: int = CHUNKS) -> list[torch.Tensor]:
    s = eng.start_session(SessionConditions(prompt="noise", seed=seed))
    out = [eng.generate_chunk(s, ACTIONS[c % len(ACTIONS)]).clone() for c in range(chunks)]
    eng.end_session(s)
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_session_stream_is_productions_sequence(cfg):
    """One generator on the device seeded with the seed (as vLLM-Omni's runner seeds it), drawn
    in order: chunk 0's initial noise, its 3 re-noises, then chunk 1's …"""
    v = cfg.video
    shape = (16, v.frames_per_chunk, v.latent_h, v.latent_w)
    prod = torch.Generator(device="cpu").manual_seed(123)
    want = [torch.randn((1, *shape), generator=prod, device=CPU, dtype=torch.float32)[0] for _ in range(8)]
    noise = SessionNoise("session-stream", 123, CPU)
    got = []
    for chunk in range(2):
        noise.begin_chunk()
        got += [noise.draw(chunk, step, shape) for step in range(4)]
        noise.commit_chunk()
    assert _equal(got, want)
    # per-chunk-step: a draw is a function of (seed, chunk, step) alone, whatever was drawn before
    a, b = SessionNoise("per-chunk-step", 123, CPU), SessionNoise("per-chunk-step", 123, CPU)
    a.draw(0, 0, shape)
    assert torch.equal(a.draw(1, 2, shape), b.draw(1, 2, shape))
    assert not torch.equal(b.draw(0, 0, shape), want[0])


def test_same_seed_same_video_and_sessions_do_not_share_a_stream(cfg, engine):
    ref = _session(engine, 5)
    assert _equal(_session(engine, 5), ref)  # the same engine, run again
    assert _equal(_session(DitEngine(cfg, group=RankGroup.single(), device=CPU, seed=4), 5), ref)  # a new one
    # another session cancelled after one chunk does not shift the next one's stream
    other = engine.start_session(SessionConditions(prompt="noise", seed=9))
    engine.generate_chunk(other, ACTIONS[0])
    engine.end_session(other)
    assert _equal(_session(engine, 5), ref)
    # two sessions interleaved chunk by chunk each draw their own stream
    s5, s9 = (engine.start_session(SessionConditions(prompt="noise", seed=k)) for k in (5, 9))
    got = []
    for c in range(CHUNKS):
        engine.generate_chunk(s9, ACTIONS[c % len(ACTIONS)])
        got.append(engine.generate_chunk(s5, ACTIONS[c % len(ACTIONS)]).clone())
    engine.end_session(s5)
    engine.end_session(s9)
    assert _equal(got, ref)
    assert not torch.equal(_session(engine, 6, 1)[0], ref[0])


def test_a_chunk_that_failed_part_way_runs_again_with_the_same_noise(engine):
    ref = _session(engine, 5)
    s = engine.start_session(SessionConditions(prompt="noise", seed=5))
    got = [engine.generate_chunk(s, ACTIONS[0]).clone()]

    def fail(event, info):  # after chunk 1 has drawn its first two noises
        if event == "step_start" and info["step"] == 2:
            raise RuntimeError("injected")
    engine.hooks.append(fail)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.generate_chunk(s, ACTIONS[1])
    finally:
        engine.hooks.remove(fail)
    got += [engine.generate_chunk(s, ACTIONS[c]).clone() for c in (1, 2)]
    engine.end_session(s)
    assert _equal(got, ref)


def test_per_chunk_step_is_the_named_alternative(cfg, engine):
    alt_cfg = apply_sets(cfg, ["schedule.noise=per-chunk-step"])
    assert alt_cfg.schedule.noise == "per-chunk-step" and cfg.schedule.noise == "session-stream"
    alt = DitEngine(alt_cfg, group=RankGroup.single(), device=CPU, seed=4)
    a = _session(alt, 5)
    assert _equal(_session(alt, 5), a)
    assert not torch.equal(a[0], _session(engine, 5, 1)[0])  # the two conventions are different videos
    with pytest.raises(ConfigError, match="schedule.noise"):
        apply_sets(cfg, ["schedule.noise=per-chunk"])


def test_image_condition_continues_the_encoder_over_zero_pixels(cfg):
    """Production's condition: the image, then zero pixel frames through the causal encoder. The
    first frame is the image's latent; later frames are the encoding of zero pixels (not zeros),
    equal to encoding the whole session video at once; a retried chunk gets the same latents;
    once the encoder's history stops changing it no longer runs."""
    v = cfg.video
    cond = conditioning_image(cfg, 3, CPU)
    chunks = [cond.latents(c) for c in range(12)]
    assert torch.equal(cond.latents(11), chunks[11])  # asked again for the same chunk
    with pytest.raises(Exception, match="in order"):
        cond.latents(3)
    first = conditioning_image_latent(cfg, 3, CPU)
    assert torch.allclose(chunks[0][:, :1], first, rtol=0, atol=1e-6)
    later = torch.cat(chunks, dim=1)[:, 1:]
    assert later.pow(2).mean().sqrt() > 0.1  # the zero frames are not zero latents
    # the whole session's pixels [image, 0, 0, …] encoded in one call give the same latents
    model = cond.model
    img = torch.from_numpy(synthetic_image(3, v.height, v.width))
    pixels = (img.permute(2, 0, 1)[None, :, None].float() / 255.0 * 2.0 - 1.0)
    frames = 12 * v.frames_per_chunk
    video = torch.cat([pixels, pixels.new_zeros(1, 3, 4 * (frames - 1), v.height, v.width)], dim=2)
    with torch.inference_mode():
        whole = model.encode(video)[0]
    assert torch.allclose(torch.cat(chunks, dim=1), whole, rtol=0, atol=1e-5)
    # a fixed point was reached and, from it on, the encoder stopped running
    assert cond.fixed_at is not None and cond.encoded_chunks == cond.fixed_at + 1
    assert torch.equal(chunks[-1], chunks[cond.fixed_at])


def test_whole_chunk_condition_encoder_is_the_per_frame_one_up_to_rounding(cfg):
    """H3c's schedule: a chunk's latent frames through the encoder in one forward (the session's
    first pixel frame still alone) gives production's one-a-forward conditions to fp32 rounding,
    reaches the fixed point at the same chunk, and stops encoding there; bf16 is bf16's rounding
    away, and the dtype is the encoder's own (the VAE decoder's is untouched)."""
    per_frame = conditioning_image(cfg, 3, CPU)
    whole_cfg = override(cfg, runtime={"condition_chunk": True})
    whole = conditioning_image(whole_cfg, 3, CPU)
    assert whole.whole and not per_frame.whole
    a = [per_frame.latents(c) for c in range(12)]
    b = [whole.latents(c) for c in range(12)]
    assert all(torch.allclose(x, y, rtol=0, atol=1e-5) for x, y in zip(a, b))
    assert whole.fixed_at == per_frame.fixed_at is not None and whole.encoded_chunks == per_frame.encoded_chunks
    bf16_cfg = override(cfg, runtime={"condition_dtype": "bfloat16", "condition_chunk": True})
    bf16 = conditioning_image(bf16_cfg, 3, CPU)
    assert next(bf16.model.parameters()).dtype == torch.bfloat16 and bf16_cfg.runtime.vae_dtype == "float32"
    c = [bf16.latents(k) for k in range(3)]
    errs = [float((x - y).norm() / y.norm()) for x, y in zip(c, a)]
    assert all(0 < e < 0.05 for e in errs), errs
