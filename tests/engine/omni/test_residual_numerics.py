"""In bf16, the reference against vLLM-Omni's own transformer, with the residual stream in fp32
(Wan's numerics, the reference's default) and in bf16 rounded where production rounds it (H2b).

One checkpoint, one request, the ``vllm-omni`` backend (vLLM-Omni's transformer and DMD block
runner in our worker; equal to production driven by hand within 1e-5 in fp32,
test_dit_equivalence.py) and the reference engine, all three in bf16 on the CPU. The contract: H2b
is closer to production than the fp32 stream in every chunk, because the stream's rounding is one
of the ways production's bf16 differs from Wan's fp32 stream (the others — RMSNorm's output and
RoPE rounded to bf16 on CPU, flash-attn's rotary kernel on GPU — are not H2b's). The figures
themselves (2 layers here; 40 with HARNESS_SLOW_TESTS=1) are recorded in docs/results/cpu-h2b/.
"""

from __future__ import annotations

import os

import pytest
import torch

from harness.config import load_preset, override
from harness.engine.conditions import SessionConditions
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup
from harness.engine.image import conditioning_image
from harness.engine.weights import save_weights
from harness.measure.gates import latent_metrics, latent_passes

CPU = torch.device("cpu")
CHUNKS = 6
ACTIONS = [["w", "w", "wj"], [["w"], ["l"], []], ["", "", ""], ["i", "i", "d"], ["s", "a", "k"], ["wl", "wl", "wl"]]
LAYERS = [2] + ([40] if os.environ.get("HARNESS_SLOW_TESTS") == "1" else [])


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _session(engine, cfg) -> list[torch.Tensor]:
    s = engine.start_session(SessionConditions(prompt="a lighthouse at dusk", seed=11,
                                               image_condition=conditioning_image(cfg, 3, CPU)))
    out = [engine.generate_chunk(s, ACTIONS[c % len(ACTIONS)]).clone() for c in range(CHUNKS)]
    engine.end_session(s)
    return out


@pytest.mark.parametrize("layers", LAYERS)
def test_bf16_stream_is_closer_to_production_than_the_fp32_stream(omni_dist, tmp_path, layers, record_property):
    from harness.engine.omni.omni_dit_engine import OmniDitEngine

    cfg = override(load_preset("tiny"), parallel={"sp": 1}, runtime={"dtype": "bfloat16"}, model={"num_layers": layers})
    save_weights(DitEngine(override(cfg, runtime={"dtype": "float32"}), group=RankGroup.single(), device=CPU,
                           seed=7).model, tmp_path)
    production = _session(OmniDitEngine(cfg, group=RankGroup.single(), device=CPU, weights_dir=str(tmp_path)), cfg)
    ref = DitEngine(cfg, group=RankGroup.single(), device=CPU, seed=0, weights_dir=str(tmp_path))
    fp32_stream = _session(ref, cfg)
    ref.residual = "runtime"
    bf16_stream = _session(ref, cfg)
    rows = [(rel_l2(f, p), rel_l2(b, p), rel_l2(b, f)) for f, p, b in zip(fp32_stream, production, bf16_stream)]
    record_property("rel_l2_fp32_stream_vs_production", [r[0] for r in rows])
    record_property("rel_l2_bf16_stream_vs_production", [r[1] for r in rows])
    record_property("rel_l2_bf16_stream_vs_fp32_stream", [r[2] for r in rows])
    print(f"\n{layers} layers, bf16: chunk  fp32 stream vs production  H2b vs production  H2b vs fp32 stream")
    for c, (a, b, d) in enumerate(rows):
        print(f"  {c}  {a:.3e}  {b:.3e}  {d:.3e}")
    # the threshold gate's verdict, with the fp32 stream as the reference, on H2b and on production
    for name, other in (("H2b", bf16_stream), ("production", production)):
        failed = [latent_passes(latent_metrics(f.numpy(), o.numpy())) for f, o in zip(fp32_stream, other)]
        print(f"  gate against the fp32 stream, {name}: " + ("pass" if not any(failed) else
              f"FAIL in {sum(map(bool, failed))} of {CHUNKS} chunks, e.g. {next(f for f in failed if f)}"))
    for c, (fp32_gap, bf16_gap, _) in enumerate(rows):
        assert bf16_gap < fp32_gap, (c, rows)
