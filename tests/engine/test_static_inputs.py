"""H1g on CPU: the blocks' host-made inputs through static-address buffers (``StaticInputs``).

A buffer is one persistent, static-address tensor per name and shape, holding the last value
given. Whole engines give the bytes of fresh inputs, eager and compiled (nothing recompiles after a
setting's first chunk), with two sessions interleaved under H5b's deferred commits (a commit runs
at the other session's call, before that call holds its own chunk's RoPE table), and under SP
with 2 and 4 ranks."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import get_static_address_type

from harness import candidates as C
from harness.config import load_preset, override
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup, run_ranks
from harness.engine.static_inputs import StaticInputs
from harness.errors import HarnessError
from harness.experiments.ab_engine import ENGINE_SWITCHES
from tests.helpers.ranks import assert_ranks_match
from tests.helpers.sessions import interleaved_bytes

CACHE = {"sink_frames": 3, "window_frames": 9}
CHUNKS = 5


def _cfg(sp: int = 1, mode: str = "eager", **runtime):
    return override(load_preset("tiny"), parallel={"sp": sp}, cache={**CACHE, "max_sessions": 2},
                    runtime={"mode": mode, **runtime})


def test_a_buffer_is_persistent_static_and_holds_the_last_value():
    inputs = StaticInputs()
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    held = inputs.hold("rope", a)
    assert torch.equal(held, a) and held.data_ptr() != a.data_ptr()
    assert get_static_address_type(held) == "unguarded"
    again = inputs.hold("rope", b)
    assert again is held and torch.equal(held, b)
    assert inputs.hold("rope", b[:2]).data_ptr() != held.data_ptr() and len(inputs) == 2  # another shape
    assert inputs.hold("modulation", a).data_ptr() != held.data_ptr() and len(inputs) == 3


def _interleaved(eng: DitEngine, how: str) -> list[list[bytes]]:
    eng.block_inputs = how
    return interleaved_bytes(eng, "h1g", CHUNKS)


@pytest.mark.parametrize("mode,commit", [("eager", "inline"), ("eager", "deferred"), ("compiled", "deferred")])
def test_engine_bytes_equal_fresh_inputs(mode, commit):
    eng = DitEngine(_cfg(mode=mode, commit=commit), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    fresh = _interleaved(eng, "fresh")
    assert eng.inputs is None
    assert _interleaved(eng, "static") == fresh
    assert eng.block_inputs == "static" and len(eng.inputs) == 3  # RoPE table, modulation, camera tokens
    kept = eng.inputs
    eng.block_inputs = "fresh"
    assert eng.inputs is None
    eng.block_inputs = "static"  # switched back: the same static addresses (no graph recorded again)
    assert eng.inputs is kept and len(kept) == 3
    if mode == "compiled":
        per_chunk = eng.compile_stats()["compiles_per_chunk"]
        for v in range(2):  # each setting's first chunk pair may trace; nothing after it compiles
            assert per_chunk[v * 2 * CHUNKS + 2 : (v + 1) * 2 * CHUNKS] == [0] * (2 * CHUNKS - 2), per_chunk
    with pytest.raises(HarnessError, match="block_inputs must be fresh or static"):
        eng.block_inputs = "pinned"


def _rank(group: RankGroup, cfg) -> dict:
    eng = DitEngine(override(cfg, parallel={"sp": group.size}), group=group, device=torch.device("cpu"), seed=3)
    return {how: _interleaved(eng, how)[0] for how in ("fresh", "static")}


@pytest.mark.parametrize("sp", [2, 4])
def test_sp_ranks_bytes_equal_fresh_inputs(sp):
    one = run_ranks(_rank, 1, _cfg())[0]
    ranks = run_ranks(_rank, sp, _cfg())
    for r in ranks:
        assert r["static"] == r["fresh"]
    assert_ranks_match([r["static"] for r in ranks], ranks[0]["static"], one["static"], 1e-4)


def test_candidate_sets_the_switch():
    cfg = C.configure(["H1g"], load_preset("tiny"))
    assert cfg.runtime.block_inputs == "static" and C.get("H1g").gate == "exact"
    assert "block_inputs" in ENGINE_SWITCHES
