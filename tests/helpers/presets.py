"""Configs the tests run on."""

from __future__ import annotations

from harness.config import HarnessConfig, load_preset, override


def tiny(*, chunks: int | None = None, **runtime) -> HarnessConfig:
    """The tiny preset with ``runtime`` fields replaced and, when given, ``chunks`` per session."""
    return override(load_preset("tiny"), runtime=runtime, video={"chunks_per_session": chunks})


#: serve options for one DiT rank and one VAE rank: for the tests of what a server or a command does
#: whatever the split (protocol, idle connections, load, compare, Ray replicas), each launch then
#: starts two processes fewer (start and stop of a tiny server: ≈ 16 s of CPU instead of ≈ 25 s on
#: the 2-core box). Sharding keeps its own tests: the engine's on 2 and 4 gloo processes, and the
#: servers of tests/hostile/test_server_hostile.py, tests/scenarios and tests/drivers at the preset's
#: SP 2 / VAE 2 (tests/serving/test_replicas.py at SP 2).
ONE_RANK_EACH = ("--sp", "1", "--vae-ranks", "1")
