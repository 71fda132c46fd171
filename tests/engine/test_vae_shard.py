"""Width-sharded streaming decode equals the unsharded decode (tiny preset, fp32, gloo)."""

from __future__ import annotations

import pytest
import torch

from harness.config import load_preset, override
from harness.engine.groups import RankGroup, run_ranks
from harness.engine.vae_engine import VaeEngine

CHUNKS = 3


def _latents(cfg) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    v = cfg.video
    return [torch.randn(16, v.frames_per_chunk, v.latent_h, v.latent_w, generator=g) for _ in range(CHUNKS)]


def _decode(group: RankGroup, cfg, latents):
    engine = VaeEngine(cfg, group=group, device=torch.device("cpu"), seed=7)
    session = engine.start_session()
    outs = [engine.decode_chunk(session, z) for z in latents]
    engine.end_session(session)
    # numpy, not tensors: run_ranks ships results through torch's fd-sharing pickler, which
    # races with the child process exiting
    outs = [None if o is None else o.numpy() for o in outs]
    halo = getattr(engine.width, "halo_bytes", 0)
    return outs, halo


@pytest.fixture(scope="module")
def reference():
    cfg = override(load_preset("tiny"), parallel={"vae_ranks": 1})
    latents = _latents(cfg)
    outs, _ = _decode(RankGroup.single(), cfg, latents)
    return latents, outs


@pytest.mark.parametrize("ranks", [2, 4])
def test_sharded_decode_equals_unsharded(reference, ranks):
    latents, ref = reference
    cfg = override(load_preset("tiny"), parallel={"vae_ranks": ranks})
    results = run_ranks(_decode, ranks, cfg, latents)
    outs, halo = results[0]
    assert all(r[0] == [None] * CHUNKS for r in results[1:]), "only VAE rank 0 returns frames"
    assert halo > 0, "the sharded decode exchanged no halos"
    assert [o.shape[1] for o in outs] == [9, 12, 12]
    for k, (a, b) in enumerate(zip(outs, ref)):
        assert a.shape == b.shape == (3, a.shape[1], cfg.video.height, cfg.video.width)
        err = float(abs(a - b).max())
        assert err <= 1e-5, f"chunk {k}: sharded over {ranks} differs by {err}"
