"""Streaming decode: the causal cache makes chunk-by-chunk decoding equal one pass over the session."""

from __future__ import annotations

import pytest
import torch

from harness.config import load_preset, override
from harness.engine.groups import RankGroup
from harness.engine.vae import LOCAL
from harness.engine.vae_engine import VaeEngine
from harness.errors import HarnessError


@pytest.fixture(scope="module")
def engine():
    cfg = override(load_preset("tiny"), parallel={"vae_ranks": 1})
    return VaeEngine(cfg, group=RankGroup.single(), device=torch.device("cpu"), seed=3)


def _latent(engine, frames, seed=0):
    v = engine.cfg.video
    return torch.randn(16, frames, v.latent_h, v.latent_w, generator=torch.Generator().manual_seed(seed))


def test_chunked_equals_whole_sequence(engine):
    z = _latent(engine, 9)
    s = engine.start_session()
    chunks = [engine.decode_chunk(s, z[:, i : i + 3]) for i in range(0, 9, 3)]
    engine.end_session(s)
    assert [c.shape[1] for c in chunks] == [9, 12, 12]

    # the whole session in one call, and with frames 1..8 through the decoder in one forward
    for frames_per_step in (1, 0):
        cache = engine.model.new_decode_cache()
        with torch.inference_mode():
            whole = engine.model.decode(z[None], cache, LOCAL, frames_per_step=frames_per_step)[0]
        assert whole.shape == (3, 33, 64, 128)
        err = (torch.cat(chunks, dim=1) - whole).abs().max().item()
        assert err <= 1e-5, (frames_per_step, err)


def test_session_of_ten_chunks_gives_117_frames(engine):
    s = engine.start_session()
    frames = []
    for c in range(10):
        out = engine.decode_chunk(s, _latent(engine, 3, seed=c))
        assert out.dtype == torch.float32 and out.min() >= -1 and out.max() <= 1
        frames.append(out.shape[1])
    engine.end_session(s)
    assert frames == [9] + [12] * 9
    assert sum(frames) == 117 == engine.cfg.video.session_frames() == s.frames


def test_sessions_are_independent_and_end_is_idempotent(engine):
    z = _latent(engine, 3, seed=5)
    a = engine.start_session()
    first = engine.decode_chunk(a, z)
    engine.decode_chunk(a, z)
    b = engine.start_session()  # a fresh cache: decodes like a new session, not like chunk 2 of a
    assert torch.equal(engine.decode_chunk(b, z), first)
    engine.end_session(a)
    engine.end_session(a)
    with pytest.raises(HarnessError):
        engine.decode_chunk(a, z)
    with pytest.raises(HarnessError):
        engine.decode_chunk(b, z[:, :, :4])  # wrong latent width
