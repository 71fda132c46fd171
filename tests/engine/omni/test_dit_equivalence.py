"""The reference DiT against vLLM-Omni's LingBot-World transformer and DMD block runner.

One tiny checkpoint written by our loader (real layer structure: 2 layers, 4 heads), CPU fp32,
a session of 12 chunks (the 9-frame sink fills at chunk 3, the window saturates at chunk 5 and
evicts from chunk 6 on), text, image and camera conditioning, the 4 DMD probes and the commit,
the same noise, the timesteps as production builds them (fp32). Every forward's flow prediction
and every committed latent are compared.
"""

from __future__ import annotations

import time

import pytest
import torch

from harness.config import load_preset, override
from harness.engine.conditions import SessionConditions
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup
from harness.engine.image import conditioning_image_latent
from harness.engine.weights import save_weights

CHUNKS = 12
TOL = 1e-5
ACTIONS = [["w", "w", "wj"], [["w"], ["l"], []], ["", "", ""], ["i", "i", "d"], ["s", "a", "k"], ["wl", "wl", "wl"]]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def engines(omni_dist, tmp_path_factory):
    from harness.engine.omni.dit_engine import OmniDitEngine

    cfg = override(load_preset("tiny"), parallel={"sp": 1})
    ref = DitEngine(cfg, group=RankGroup.single(), device=torch.device("cpu"), seed=7)
    ckpt = tmp_path_factory.mktemp("ckpt")
    save_weights(ref.model, ckpt)
    ref = DitEngine(cfg, group=RankGroup.single(), device=torch.device("cpu"), seed=0, weights_dir=str(ckpt))
    omni = OmniDitEngine(cfg, group=RankGroup.single(), device=torch.device("cpu"), weights_dir=str(ckpt))
    return cfg, ref, omni


def _flows(engine: DitEngine, out: list):
    """Record every forward's velocity of the reference engine."""
    fwd = engine._forward

    def spy(*a, **k):
        v = fwd(*a, **k)
        out.append(v.float().clone())
        return v
    engine._forward = spy


def test_session_matches_vllm_omni(engines, record_property):
    cfg, ref, omni = engines
    image = conditioning_image_latent(cfg, 3, torch.device("cpu"))
    cond = SessionConditions(prompt="a lighthouse at dusk", seed=11, image_latent=image)
    rs, os_ = ref.start_session(cond), omni.start_session(cond)
    ref_flows: list = []
    _flows(ref, ref_flows)
    latent_err, flow_err, kv_tokens, t_ref, t_omni = [], [], [], 0.0, 0.0
    for c in range(CHUNKS):
        acts = ACTIONS[c % len(ACTIONS)]
        ref_flows.clear()
        t0 = time.perf_counter()
        a = ref.generate_chunk(rs, acts)
        t1 = time.perf_counter()
        b = omni.generate_chunk(os_, acts)
        t_ref, t_omni = t_ref + t1 - t0, t_omni + time.perf_counter() - t1
        latent_err.append(rel_l2(a, b))
        flow_err.append(max(rel_l2(x, y) for x, y in zip(ref_flows[:4], omni.last_flows)))
        kv_tokens.append(os_.cache.self_attention[0].end)
    record_property("latent_rel_l2_per_chunk", latent_err)
    record_property("flow_rel_l2_max_per_chunk", flow_err)
    print("\nchunk  latent rel-L2  max flow rel-L2  omni K/V tokens after commit")
    for c in range(CHUNKS):
        print(f"{c:5d}  {latent_err[c]:.3e}      {flow_err[c]:.3e}       {kv_tokens[c]}")
    print(f"DiT wall time, {CHUNKS} chunks: reference {t_ref:.2f} s, vllm-omni {t_omni:.2f} s")
    # the window really saturated and evicted: K/V stops growing at 18 frames
    tpf = cfg.tokens_per_frame
    assert kv_tokens[4] == 15 * tpf and kv_tokens[5:] == [18 * tpf] * (CHUNKS - 5)
    assert len(ref_flows) == 5 and max(flow_err) <= TOL and max(latent_err) <= TOL, (latent_err, flow_err)
    # both engines free their state at the end
    ref.end_session(rs)
    omni.end_session(os_)
    assert ref.kv_stats()["blocks_used"] == 0 and omni.kv_stats()["blocks_used"] == 0


def test_schedule_is_built_as_production_builds_it(engines):
    """Production's shifted DMD schedule (``_build_shifted_flow_schedule`` in its pipeline module,
    which needs torchvision to import, so its three lines are restated here): σ = shift·b /
    ((1 − b) + shift·b) in float64 for b = label / 1000, the model timestep σ·1000 handed over as
    a float32 tensor. The backend feeds exactly these to vLLM-Omni's runner."""
    cfg, _, omni = engines
    b = torch.tensor(cfg.schedule.timesteps, dtype=torch.float64) / 1000
    shift = cfg.schedule.flow_shift
    sigma = shift * b / ((1.0 - b) + shift * b)
    t32 = (sigma * 1000).to(torch.float32)
    assert [t for t, _ in omni.steps] == t32.tolist()
    assert [s for _, s in omni.steps] == pytest.approx(sigma.tolist(), rel=1e-15, abs=0)


def test_weights_and_sp_refusals(engines, tmp_path):
    from harness.engine.omni.dit_engine import OmniDitEngine
    from harness.errors import HarnessError

    cfg, _, _ = engines
    with pytest.raises(HarnessError, match="sp=1"):
        OmniDitEngine(override(cfg, parallel={"sp": 2}), group=RankGroup.single(), device=torch.device("cpu"))
    with pytest.raises(HarnessError, match="no \\*.safetensors"):
        OmniDitEngine(cfg, group=RankGroup.single(), device=torch.device("cpu"), weights_dir=str(tmp_path))
    from safetensors.torch import save_file

    save_file({"blocks.0.bogus.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HarnessError, match="cannot load the weights.*bogus"):
        OmniDitEngine(cfg, group=RankGroup.single(), device=torch.device("cpu"), weights_dir=str(tmp_path))
