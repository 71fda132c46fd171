"""The reference DiT against vLLM-Omni's LingBot-World transformer and DMD block runner, from the
same *request*: seed, prompt, image and per-chunk actions.

One tiny checkpoint written by our loader (real layer structure: 2 layers, 4 heads), CPU fp32, a
session of 12 chunks (the 9-frame sink fills at chunk 3, the window saturates at chunk 5 and evicts
from chunk 6 on). Three sides get the request: the reference engine and the ``vllm-omni`` backend,
each with its default conventions (noise, image condition, camera: harness/engine/noise.py,
image.py, camera.py), and production driven by hand through its own modules in its pipeline's
order (tests/helpers/omni_production.py says exactly what is driven by hand and why): the
runner's generator seeded with the seed, diffusers' Wan encoder over the image then zero pixel
frames, vLLM-Omni's camera code, its transformer and ``generate_block``. The text embedding is the
one input both sides are handed as a tensor (no UMT5 checkpoint here). Every committed latent is
compared, and every forward's flow prediction between the two engines.
"""

from __future__ import annotations

import time

import pytest
import torch
from helpers.omni_production import ProductionCondition, diffusers_vae, production_rays, production_session

from harness.config import apply_sets, load_preset, override
from harness.engine.conditions import SessionConditions, synthetic_text_embedding
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup
from harness.engine.image import conditioning_image, conditioning_image_latent, synthetic_image
from harness.engine.vae import WAN21_LATENTS_MEAN, WAN21_LATENTS_STD, build_vae
from harness.engine.weights import save_weights

CHUNKS = 12
TOL = 1e-5
CPU = torch.device("cpu")
SEED, PROMPT, IMAGE_SEED = 11, "a lighthouse at dusk", 3
ACTIONS = [["w", "w", "wj"], [["w"], ["l"], []], ["", "", ""], ["i", "i", "d"], ["s", "a", "k"], ["wl", "wl", "wl"]]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def engines(omni_dist, tmp_path_factory):
    from harness.engine.omni.omni_dit_engine import OmniDitEngine

    cfg = override(load_preset("tiny"), parallel={"sp": 1})
    ref = DitEngine(cfg, group=RankGroup.single(), device=CPU, seed=7)
    ckpt = tmp_path_factory.mktemp("ckpt")
    save_weights(ref.model, ckpt)
    ref = DitEngine(cfg, group=RankGroup.single(), device=CPU, seed=0, weights_dir=str(ckpt))
    omni = OmniDitEngine(cfg, group=RankGroup.single(), device=CPU, weights_dir=str(ckpt))
    return cfg, ref, omni, str(ckpt)


def _flows(engine: DitEngine, out: list):
    """Record every forward's velocity of the reference engine."""
    fwd = engine._forward

    def spy(*a, **k):
        v = fwd(*a, **k)
        out.append(v.float().clone())
        return v
    engine._forward = spy


def _request(cfg, **kw) -> SessionConditions:
    kw.setdefault("image_condition", conditioning_image(cfg, IMAGE_SEED, CPU))
    return SessionConditions(prompt=PROMPT, seed=SEED, **kw)


def _actions() -> list:
    return [ACTIONS[c % len(ACTIONS)] for c in range(CHUNKS)]


def _session(engine, cond: SessionConditions) -> list[torch.Tensor]:
    s = engine.start_session(cond)
    out = [engine.generate_chunk(s, a).clone() for a in _actions()]
    engine.end_session(s)
    return out


@pytest.fixture(scope="module")
def production(engines, lingbot):
    """Production's committed latents for the request (tests/helpers/omni_production.py)."""
    cfg, _, omni, _ = engines
    v, m = cfg.video, cfg.model
    ours = build_vae(cfg.vae, encoder=True, decoder=True, seed=cfg.runtime.seed)  # the harness encoder's weights
    vae = diffusers_vae(cfg.vae, ours.state_dict(), WAN21_LATENTS_MEAN, WAN21_LATENTS_STD)
    condition = ProductionCondition(vae, synthetic_image(IMAGE_SEED, v.height, v.width), v.frames_per_chunk)
    text = synthetic_text_embedding(PROMPT, SEED, m.text_len, m.text_dim)[None]
    rays = production_rays(lingbot, _actions(), height=v.height, width=v.width)
    t0 = time.perf_counter()
    out = production_session(omni.model, omni.runner, seed=SEED, text=text, condition=condition, rays=rays,
                             schedule=omni.steps, latent_hw=(v.latent_h, v.latent_w))
    return out, time.perf_counter() - t0


def test_a_session_from_its_request_matches_vllm_omni(engines, production, record_property):
    cfg, ref, omni, _ = engines
    prod, t_prod = production
    rs, os_ = ref.start_session(_request(cfg)), omni.start_session(_request(cfg))
    ref_flows: list = []
    _flows(ref, ref_flows)
    ref_err, omni_err, flow_err, kv_tokens, t_ref, t_omni = [], [], [], [], 0.0, 0.0
    for c, acts in enumerate(_actions()):
        ref_flows.clear()
        t0 = time.perf_counter()
        a = ref.generate_chunk(rs, acts)
        t1 = time.perf_counter()
        b = omni.generate_chunk(os_, acts)
        t_ref, t_omni = t_ref + t1 - t0, t_omni + time.perf_counter() - t1
        ref_err.append(rel_l2(a, prod[c]))
        omni_err.append(rel_l2(b, prod[c]))
        flow_err.append(max(rel_l2(x, y) for x, y in zip(ref_flows[:4], omni.last_flows)))
        kv_tokens.append(os_.cache.self_attention[0].end)
    record_property("reference_vs_production_rel_l2_per_chunk", ref_err)
    record_property("backend_vs_production_rel_l2_per_chunk", omni_err)
    record_property("flow_rel_l2_max_per_chunk", flow_err)
    print("\nchunk  reference vs production  vllm-omni backend vs production  max flow rel-L2 (ref vs backend)  K/V tokens")
    for c in range(CHUNKS):
        print(f"{c:5d}  {ref_err[c]:.3e}                {omni_err[c]:.3e}                          {flow_err[c]:.3e}"
              f"                         {kv_tokens[c]}")
    print(f"DiT wall time, {CHUNKS} chunks: reference {t_ref:.2f} s, vllm-omni backend {t_omni:.2f} s, "
          f"production by hand {t_prod:.2f} s")
    # the window really saturated and evicted: K/V stops growing at 18 frames
    tpf = cfg.tokens_per_frame
    assert kv_tokens[4] == 15 * tpf and kv_tokens[5:] == [18 * tpf] * (CHUNKS - 5)
    assert len(ref_flows) == 5 and max(flow_err) <= TOL, flow_err
    assert max(ref_err) <= TOL and max(omni_err) <= TOL, (ref_err, omni_err)
    # both engines free their state at the end
    ref.end_session(rs)
    omni.end_session(os_)
    assert ref.kv_stats()["blocks_used"] == 0 and omni.kv_stats()["blocks_used"] == 0


def test_the_old_conventions_generate_another_video(engines, production, record_property):
    """What the request meant before: per-(seed, chunk, step) noise, or zero latents after the
    image's frame. Either alone makes the session something other than production's."""
    cfg, _, _, ckpt = engines
    prod, _ = production
    from harness.engine.omni.omni_dit_engine import OmniDitEngine

    alt_cfg = apply_sets(cfg, ["schedule.noise=per-chunk-step"])
    alt = DitEngine(alt_cfg, group=RankGroup.single(), device=CPU, seed=0, weights_dir=ckpt)
    old = _session(alt, _request(cfg))
    noise = [rel_l2(a, b) for a, b in zip(old, prod)]
    # the option is the same noise on both engines (the A/B pairing of two arms relies on it)
    alt_omni = OmniDitEngine(alt_cfg, group=RankGroup.single(), device=CPU, weights_dir=ckpt)
    s = alt_omni.start_session(_request(cfg))
    pair = [rel_l2(alt_omni.generate_chunk(s, a), old[c]) for c, a in enumerate(_actions()[:3])]
    alt_omni.end_session(s)
    assert max(pair) <= TOL, pair
    del alt, alt_omni
    ref = engines[1]
    first = conditioning_image_latent(cfg, IMAGE_SEED, CPU)
    zeros = [rel_l2(a, b) for a, b in zip(_session(ref, _request(cfg, image_condition=None, image_latent=first)), prod)]
    record_property("per_chunk_step_noise_rel_l2", noise)
    record_property("zero_latent_condition_rel_l2", zeros)
    print(f"\nper-(seed, chunk, step) noise: rel-L2 to production {min(noise):.3f}..{max(noise):.3f}; "
          f"zero latents after the first frame: {min(zeros):.3e}..{max(zeros):.3e}")
    assert min(noise) > 0.5 and min(zeros) > TOL, (noise, zeros)


def test_schedule_is_built_as_production_builds_it(engines):
    """Production's shifted DMD schedule (``_build_shifted_flow_schedule`` in its pipeline module,
    which needs torchvision to import, so its three lines are restated here): σ = shift·b /
    ((1 − b) + shift·b) in float64 for b = label / 1000, the model timestep σ·1000 handed over as
    a float32 tensor. The backend feeds exactly these to vLLM-Omni's runner."""
    cfg, _, omni, _ = engines
    b = torch.tensor(cfg.schedule.timesteps, dtype=torch.float64) / 1000
    shift = cfg.schedule.flow_shift
    sigma = shift * b / ((1.0 - b) + shift * b)
    t32 = (sigma * 1000).to(torch.float32)
    assert [t for t, _ in omni.steps] == t32.tolist()
    assert [s for _, s in omni.steps] == pytest.approx(sigma.tolist(), rel=1e-15, abs=0)


def test_weights_and_sp_refusals(engines, tmp_path):
    from harness.engine.omni.omni_dit_engine import OmniDitEngine
    from harness.errors import HarnessError

    cfg, _, _, _ = engines
    with pytest.raises(HarnessError, match="sp=1"):
        OmniDitEngine(override(cfg, parallel={"sp": 2}), group=RankGroup.single(), device=torch.device("cpu"))
    with pytest.raises(HarnessError, match="no \\*.safetensors"):
        OmniDitEngine(cfg, group=RankGroup.single(), device=torch.device("cpu"), weights_dir=str(tmp_path))
    from safetensors.torch import save_file

    save_file({"blocks.0.bogus.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HarnessError, match="cannot load the weights.*bogus"):
        OmniDitEngine(cfg, group=RankGroup.single(), device=torch.device("cpu"), weights_dir=str(tmp_path))
