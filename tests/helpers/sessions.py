"""Sessions run on a DiT engine for tests that compare engine settings byte for byte."""

from __future__ import annotations

from harness.engine.conditions import SessionConditions

#: a walk, a turn, idle, strafing: the actions of a test session's chunks, in turn
ACTIONS = [["W", "WJ", ""], ["D", "", "I"], ["", "", ""], ["SL", "K", "A"]]


def session_bytes(eng, prompt: str, chunks: int, seed: int = 11) -> list[bytes]:
    """One session's latents, chunk by chunk, as float32 bytes (numpy bytes, not tensors:
    ``run_ranks``' pickler shares tensor memory by fd, which races a rank's exit)."""
    s = eng.start_session(SessionConditions(prompt=prompt, seed=seed))
    out = [eng.generate_chunk(s, ACTIONS[c % len(ACTIONS)]).numpy().tobytes() for c in range(chunks)]
    eng.end_session(s)
    return out


def interleaved_bytes(eng, prompt: str, chunks: int, seeds: tuple[int, ...] = (11, 12)) -> list[list[bytes]]:
    """Sessions chunk by chunk in turn (under H5b each call runs the other session's deferred
    commit), each one's latents as ``session_bytes`` gives them; the engine holds no block after."""
    sessions = [eng.start_session(SessionConditions(prompt=prompt, seed=seed)) for seed in seeds]
    out: list[list[bytes]] = [[] for _ in seeds]
    for c in range(chunks):
        for s, got in zip(sessions, out):
            got.append(eng.generate_chunk(s, ACTIONS[c % len(ACTIONS)]).numpy().tobytes())
    for s in sessions:
        eng.end_session(s)
    assert eng.kv_stats()["blocks_used"] == 0
    return out

