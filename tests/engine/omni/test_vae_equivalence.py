"""Our streaming, width-sharded VAE decode against diffusers' AutoencoderKLWan decoding whole.

Production's LingBot-World pipeline (vLLM-Omni 0.30.0) decodes with ``DistributedAutoencoderKLWan``,
vLLM-Omni's subclass of diffusers' ``AutoencoderKLWan`` (Wan 2.1 layout, ``is_residual=False``),
after un-normalising the DiT's latents with the checkpoint's latents_mean/std. Here diffusers'
class gets our tiny VAE's weights by name and decodes a 3-chunk session's latents in one call;
ours decodes the same latents chunk by chunk through its causal cache, width-sharded over 2 gloo
ranks (tests/engine/test_vae_shard.py shows the sharded decode equals the unsharded one). Two
chunks: the session's first (one pixel frame from its first latent frame) and one streamed after it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from harness.config import load_preset, override
from harness.engine.groups import RankGroup, run_ranks
from harness.engine.vae import WAN21_LATENTS_MEAN, WAN21_LATENTS_STD, build_vae
from harness.engine.vae_engine import VaeEngine

CHUNKS, RANKS, SEED, TOL = 2, 2, 7, 1e-5


@pytest.fixture(scope="module")
def diffusers_wan():
    try:
        from diffusers import AutoencoderKLWan
    except ImportError as e:
        if os.environ.get("HARNESS_REQUIRE_VLLM") == "1":
            pytest.fail(f"HARNESS_REQUIRE_VLLM=1 but diffusers' AutoencoderKLWan does not import: {e}")
        pytest.skip(f"diffusers is not installed (it comes with the vllm extra): {e}")
    return AutoencoderKLWan


def _decode(group: RankGroup, cfg, latents):
    engine = VaeEngine(cfg, group=group, device=torch.device("cpu"), seed=SEED)
    session = engine.start_session()
    outs = [engine.decode_chunk(session, z) for z in latents]
    return [None if o is None else o.numpy() for o in outs]


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def test_streaming_sharded_decode_matches_diffusers(diffusers_wan, record_property):
    cfg = override(load_preset("tiny"), parallel={"vae_ranks": RANKS})
    v, vc = cfg.video, cfg.vae
    ours_model = build_vae(vc, encoder=True, decoder=True, seed=SEED)
    theirs = diffusers_wan(base_dim=vc.base_dim, z_dim=vc.z_dim, dim_mult=list(vc.dim_mult),
                           num_res_blocks=vc.num_res_blocks, temperal_downsample=list(reversed(vc.temporal_upsample)),
                           latents_mean=list(WAN21_LATENTS_MEAN), latents_std=list(WAN21_LATENTS_STD)).eval()
    missing, unexpected = theirs.load_state_dict(ours_model.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)

    g = torch.Generator().manual_seed(99)
    latents = [torch.randn(16, v.frames_per_chunk, v.latent_h, v.latent_w, generator=g) for _ in range(CHUNKS)]
    whole = torch.cat(latents, dim=1)[None]
    mean, std = (torch.tensor(x).view(1, 16, 1, 1, 1) for x in (WAN21_LATENTS_MEAN, WAN21_LATENTS_STD))
    with torch.inference_mode():
        ref = theirs.decode(whole * std + mean).sample[0].numpy()  # as the pipeline un-normalises
    results = run_ranks(_decode, RANKS, cfg, latents)
    outs = results[0]
    assert results[1] == [None] * CHUNKS, "only VAE rank 0 returns frames"
    assert [o.shape[1] for o in outs] == [9, 12] and ref.shape[1] == 21
    errs, t = [], 0
    for o in outs:
        errs.append(rel_l2(o, ref[:, t : t + o.shape[1]]))
        t += o.shape[1]
    record_property("vae_rel_l2_per_chunk", errs)
    print(f"VAE rel-L2 per chunk ({RANKS} ranks):", " ".join(f"{e:.2e}" for e in errs))
    assert max(errs) <= TOL, errs


def test_image_condition_matches_productions_encoder(diffusers_wan, record_property):
    """The image condition of 12 chunks: our encoder continued over zero pixel frames against
    diffusers' Wan encoder driven as production's ``_prepare_condition_chunk`` drives it
    (tests/helpers/omni_production.py), both from the same uint8 image."""
    from helpers.omni_production import ProductionCondition, diffusers_vae

    from harness.engine.image import conditioning_image, synthetic_image

    cfg = load_preset("tiny")
    v = cfg.video
    ours = conditioning_image(cfg, 3, torch.device("cpu"))
    vae = diffusers_vae(cfg.vae, build_vae(cfg.vae, encoder=True, decoder=True, seed=cfg.runtime.seed).state_dict(),
                        WAN21_LATENTS_MEAN, WAN21_LATENTS_STD)
    theirs = ProductionCondition(vae, synthetic_image(3, v.height, v.width), v.frames_per_chunk)
    errs, rms = [], []
    for c in range(12):
        prod = theirs.next()[0]
        mask = torch.zeros_like(prod[:4])
        mask[:, 0] = float(c == 0)  # ones on the session's first latent frame only
        assert torch.equal(prod[:4], mask)
        lat = ours.latents(c).numpy()
        errs.append(rel_l2(lat, prod[4:].numpy()))
        rms.append(float((prod[4:, 1:] if c == 0 else prod[4:]).double().pow(2).mean().sqrt()))
    record_property("image_condition_rel_l2_per_chunk", errs)
    print("image condition rel-L2 per chunk:", " ".join(f"{e:.2e}" for e in errs),
          f"| rms after the first frame {min(rms):.3f}..{max(rms):.3f}; our encoder's fixed point at chunk {ours.fixed_at}")
    assert max(errs) <= TOL and min(rms) > 0.1, (errs, rms)
