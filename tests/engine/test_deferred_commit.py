"""H5b on CPU: a deferred commit pass (``runtime.commit = "deferred"``) gives the latents of the
inline one byte for byte on 1, 2 and 4 ranks, through window saturation and eviction, with sessions
interleaved chunk by chunk and with a session ended while its commit waits; the commit runs at the
engine's next call (the first chunk's call runs 4 forwards, every later one 5, the last commit
never), a commit that fails runs again, and a session's end leaves no block behind."""

from __future__ import annotations

import pytest
import torch

from harness import candidates as C
from harness.config import load_preset, override
from harness.engine.conditions import SessionConditions
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup, run_ranks
from harness.errors import HarnessError
from helpers.ranks import assert_ranks_match

#: saturated at chunk 2, evicting from chunk 3 on (as in test_dit_sp)
CACHE = {"sink_frames": 3, "window_frames": 9, "max_sessions": 2}
CHUNKS = 5
ACTIONS = [["W", "WJ", ""], ["D", "", "I"], ["", "", ""], ["SL", "K", "A"]]


def _cfg(sp: int = 1, commit: str = "inline"):
    return override(load_preset("tiny"), parallel={"sp": sp}, cache=CACHE, runtime={"commit": commit})


def _engine(group: RankGroup | None = None, commit: str = "inline") -> DitEngine:
    group = group or RankGroup.single()
    return DitEngine(_cfg(group.size, commit), group=group, device=torch.device("cpu"), seed=3)


def _session(eng: DitEngine, seed: int = 11) -> list[bytes]:
    s = eng.start_session(SessionConditions(prompt="h5b", seed=seed))
    out = [eng.generate_chunk(s, ACTIONS[c % 4]).numpy().tobytes() for c in range(CHUNKS)]
    eng.end_session(s)
    return out


def _interleaved(eng: DitEngine) -> tuple[list[bytes], list[bytes]]:
    """Two sessions, chunk by chunk in turn: each call settles the other session's commit."""
    a, b = (eng.start_session(SessionConditions(prompt="h5b", seed=seed)) for seed in (11, 12))
    out: tuple[list[bytes], list[bytes]] = ([], [])
    for c in range(CHUNKS):
        for s, got in zip((a, b), out):
            got.append(eng.generate_chunk(s, ACTIONS[c % 4]).numpy().tobytes())
    eng.end_session(a)
    eng.end_session(b)
    return out


def test_deferred_latents_are_the_inline_bytes():
    inline = _engine()
    want = _session(inline)
    want_b = _session(inline, seed=12)
    eng = _engine(commit="deferred")
    assert _session(eng) == want
    assert _interleaved(eng) == (want, want_b)
    # a session ended while its commit waits: the commit is dropped with the blocks, and the next
    # session is a fresh one's bytes
    s = eng.start_session(SessionConditions(prompt="h5b", seed=11))
    eng.generate_chunk(s, ACTIONS[0])
    assert eng.pending_commit is s and eng.kv_stats()["blocks_used"] > 0
    eng.end_session(s)
    assert eng.pending_commit is None and eng.kv_stats()["blocks_used"] == 0
    assert _session(eng) == want
    assert eng.kv_stats()["blocks_used"] == 0


def _steps(eng: DitEngine) -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []
    eng.hooks.append(lambda event, info: seen.append((info["chunk"], info["step"])) if event == "step_start" else None)
    return seen


def test_commit_runs_at_the_next_call():
    eng = _engine(commit="deferred")
    seen = _steps(eng)
    s = eng.start_session(SessionConditions(prompt="h5b", seed=11))
    calls = []
    for c in range(3):
        before = len(seen)
        eng.generate_chunk(s, ACTIONS[c])
        calls.append(seen[before:])
    assert calls[0] == [(0, i) for i in range(4)]  # the first chunk's latent: 4 forwards
    for c in (1, 2):  # the previous chunk's commit (step 4, its own chunk index), then 4 denoising passes
        assert calls[c] == [(c - 1, 4)] + [(c, i) for i in range(4)]
    eng.end_session(s)
    assert len(seen) == 3 * 5 - 1  # the last chunk's commit never ran
    inline = _engine()
    seen_inline = _steps(inline)
    _session(inline)
    assert len(seen_inline) == CHUNKS * 5 and seen_inline[:5] == [(0, i) for i in range(5)]


def test_a_failed_commit_runs_again():
    eng = _engine(commit="deferred")
    fail = {"left": 1}

    def hook(event, info):
        if event == "step_start" and info["step"] == 4 and fail["left"]:
            fail["left"] -= 1
            raise RuntimeError("injected: the commit pass failed")

    eng.hooks.append(hook)
    s = eng.start_session(SessionConditions(prompt="h5b", seed=11))
    got = [eng.generate_chunk(s, ACTIONS[0]).numpy().tobytes()]
    with pytest.raises(RuntimeError, match="injected"):
        eng.generate_chunk(s, ACTIONS[1])
    assert eng.pending_commit is s and s.chunk == 0
    got += [eng.generate_chunk(s, ACTIONS[c % 4]).numpy().tobytes() for c in range(1, CHUNKS)]
    eng.end_session(s)
    assert got == _session(_engine())


def test_switching_settles_first():
    eng = _engine(commit="deferred")
    s = eng.start_session(SessionConditions(prompt="h5b", seed=11))
    eng.generate_chunk(s, ACTIONS[0])
    eng.commit = "inline"
    assert eng.pending_commit is None and s.chunk == 1
    with pytest.raises(HarnessError, match="inline or deferred"):
        eng.commit = "later"
    eng.end_session(s)


def _rank(group: RankGroup, commit: str) -> list[bytes]:
    return _session(_engine(group, commit))


@pytest.mark.parametrize("sp", [2, 4])
def test_sp_ranks_deferred_bytes(sp):
    """Every rank defers the same commit: the bytes of the inline commit on those ranks, and within
    SP's tolerance of one rank."""
    one = run_ranks(_rank, 1, "inline")[0]
    inline = run_ranks(_rank, sp, "inline")
    deferred = run_ranks(_rank, sp, "deferred")
    assert_ranks_match(deferred, inline[0], one, 1e-4)


def test_candidate_sets_the_switch_and_is_refused_where_it_cannot_show():
    cfg = C.configure(["H5b"], load_preset("tiny"))
    assert cfg.runtime.commit == "deferred" and C.get("H5b").gate == "exact"
    from harness.experiments.ab_engine import plan_arm

    with pytest.raises(HarnessError, match="runtime.commit.*use compare"):
        plan_arm(["H5b"], load_preset("tiny"))
    with pytest.raises(HarnessError, match="does not apply to --engine vllm-omni"):
        C.resolve(["H5b"], override(load_preset("tiny"), engine={"backend": "vllm-omni"}, parallel={"sp": 1}))
