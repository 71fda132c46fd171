"""H2a at the engine: the camera GEMMs run once per chunk instead of five times, and the latents
stay byte-identical to the baseline over 8 chunks (past window saturation and eviction), at SP=1
and SP=2; the patch reverts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.candidates import get
from harness.config import load_preset, override
from harness.engine.conditions import SessionConditions
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup, run_ranks

CHUNKS = 8
_ACTIONS = [["W", "WJ", ""], ["D", "", "I"], ["", "", ""], ["SL", "K", "A"]]
CAMERA_LAYERS = ("cam_injector_layer1", "cam_injector_layer2", "cam_scale_layer", "cam_shift_layer")


def _session(eng: DitEngine, calls: dict[str, int]) -> tuple[list[np.ndarray], list[dict[str, int]]]:
    s = eng.start_session(SessionConditions(prompt="h2a", seed=7))
    latents, per_chunk = [], []
    for c in range(CHUNKS):
        calls.clear()
        latents.append(eng.generate_chunk(s, _ACTIONS[c % len(_ACTIONS)]).numpy().copy())
        per_chunk.append(dict(calls))
    eng.end_session(s)
    return latents, per_chunk


def _run(group: RankGroup) -> dict:
    cfg = override(load_preset("tiny"), parallel={"sp": group.size})
    eng = DitEngine(cfg, group=group, device=torch.device("cpu"), seed=3)
    calls: dict[str, int] = {}

    def counter(name):
        def hook(module, args):
            calls[name] = calls.get(name, 0) + 1
        return hook

    for i, block in enumerate(eng.model.blocks):
        for name in CAMERA_LAYERS:
            getattr(block, name).register_forward_pre_hook(counter(f"{i}.{name}"))
    for name in ("patch_embedding_wancamctrl", "c2ws_hidden_states_layer1", "c2ws_hidden_states_layer2"):
        getattr(eng.model, name).register_forward_pre_hook(counter(name))

    base, base_calls = _session(eng, calls)
    revert = get("H2a").patch_dit(eng, "")
    cached, cached_calls = _session(eng, calls)
    revert()
    again, again_calls = _session(eng, calls)
    return {"base": base, "cached": cached, "again": again, "calls": (base_calls, cached_calls, again_calls),
            "layers": len(eng.model.blocks)}


def _check(r: dict) -> None:
    base_calls, cached_calls, again_calls = r["calls"]
    for c in range(CHUNKS):
        assert r["cached"][c].tobytes() == r["base"][c].tobytes(), f"chunk {c} differs with the camera cache"
        assert r["again"][c].tobytes() == r["base"][c].tobytes(), f"chunk {c} differs after revert"
        # 5 forwards per chunk: every camera GEMM 5 times without the cache, once with it
        assert set(base_calls[c].values()) == {5} and len(base_calls[c]) == 4 * r["layers"] + 3
        assert cached_calls[c] == {k: 1 for k in base_calls[c]}, cached_calls[c]
        assert again_calls[c] == base_calls[c]


def test_camera_cache_sp1_exact_and_once_per_chunk():
    _check(_run(RankGroup.single()))


@pytest.mark.parametrize("sp", [2])
def test_camera_cache_sp2_exact_and_once_per_chunk(sp):
    results = run_ranks(_run, sp)
    for r in results:
        _check(r)
    for c in range(CHUNKS):
        assert results[1]["cached"][c].tobytes() == results[0]["cached"][c].tobytes()


def test_the_cache_is_the_candidates_own_and_installs_into_one_engine_seam():
    from harness.candidates.h2a_camera_chunk_cache import ChunkCameraCache
    from harness.engine.dit import CameraModulation

    cfg = override(load_preset("tiny"), parallel={"sp": 1})
    eng = DitEngine(cfg, group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    assert eng.camera_modulation is CameraModulation  # the engine's default recomputes
    assert not hasattr(eng, "camera_cache")  # no switch of the candidate's left in the engine
    revert = get("H2a").patch_dit(eng, "")
    assert eng.camera_modulation is ChunkCameraCache
    revert()
    assert eng.camera_modulation is CameraModulation
