"""On CUDA, a chunk never waits on the host: no synchronising CUDA call from the first denoise
step to the returned latent (``torch.cuda.set_sync_debug_mode("error")`` raises on any), in
eager and, after its warm-up chunks (compilation, CUDA-graph recording), in compiled mode."""

from __future__ import annotations

import pytest
import torch

from harness.config import load_preset, override
from harness.engine.conditions import SessionConditions
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_chunk_has_no_host_sync(mode):
    cfg = override(load_preset("tiny"), parallel={"sp": 1},
                   runtime={"mode": mode, "device": "cuda", "dtype": "bfloat16"})
    eng = DitEngine(cfg, group=RankGroup.single(), device=torch.device("cuda"), seed=0)
    s = eng.start_session(SessionConditions(prompt="nosync", seed=1))
    for _ in range(3):  # warm-up: compilation and CUDA-graph recording may synchronise
        eng.generate_chunk(s, ["W", "", "D"])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # past the window's saturation: eviction included
            latent = eng.generate_chunk(s, ["W", "", "D"])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(latent).all()
    eng.end_session(s)
