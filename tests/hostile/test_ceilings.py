"""The up-front bounds at their edges: a value at a ceiling is accepted, one past it refused (one
line naming the field); the memory check counts every SP rank."""

from __future__ import annotations

import msgspec
import pytest

from harness import limits as L
from harness.config import load_preset
from harness.errors import ConfigError


@pytest.fixture(scope="module")
def tiny():
    # one chunk a session, so frames_per_chunk at its ceiling stays within the position table
    cfg = load_preset("tiny")
    return msgspec.structs.replace(cfg, video=msgspec.structs.replace(cfg.video, chunks_per_session=1))


def _with(cfg, section: str, field: str, value):
    return msgspec.structs.replace(cfg, **{section: msgspec.structs.replace(getattr(cfg, section), **{field: value})})


SECTIONS = ("model", "video", "cache", "parallel", "runtime", "vae")


def test_every_ceiling_is_inclusive(tiny):
    checked = 0
    for section in SECTIONS:
        obj = getattr(tiny, section)
        for field, ceiling in L.MAX.items():
            if field not in obj.__struct_fields__:
                continue
            L.check_shapes(_with(tiny, section, field, ceiling))  # at the ceiling: accepted
            with pytest.raises(ConfigError, match=rf"{section}\.\w+ = {ceiling + 1} is outside 1-{ceiling}"):
                L.check_shapes(_with(tiny, section, field, ceiling + 1))
            with pytest.raises(ConfigError, match="is outside 1-"):
                L.check_shapes(_with(tiny, section, field, 0))
            checked += 1
    assert checked == len(L.MAX)  # every ceiling has a field it bounds
    for side in ("height", "width"):
        L.check_shapes(_with(tiny, "video", side, L.MAX_PIXELS_SIDE))
        with pytest.raises(ConfigError, match=f"video.{side} = {L.MAX_PIXELS_SIDE + 1}"):
            L.check_shapes(_with(tiny, "video", side, L.MAX_PIXELS_SIDE + 1))


def test_the_host_memory_check_counts_every_sp_rank(tiny, monkeypatch):
    cpu = _with(_with(tiny, "runtime", "device", "cpu"), "parallel", "sp", 2)
    est = L.estimate_bytes(cpu)
    # two DiT ranks, each with all the weights; every VAE rank, the ring, the encoder and the driver
    need = 2 * est["dit_rank"] + cpu.parallel.vae_ranks * est["vae_rank"] + est["ring"] + 2 * L.PROCESS_BYTES
    monkeypatch.setattr(L, "_shm_free", lambda: None)
    monkeypatch.setattr(L, "_meminfo_bytes", lambda key: need)
    assert L.check_fits(cpu) == est  # exactly fits
    monkeypatch.setattr(L, "_meminfo_bytes", lambda key: need - 1)
    with pytest.raises(ConfigError, match="this host has"):
        L.check_fits(cpu)
    L.check_fits(_with(cpu, "parallel", "sp", 1))  # one rank needs less than the host holds
