"""H5c on CPU: a session's first image condition encoded as the session starts
(``runtime.condition_start = "session"``) gives the latents of the chunk-0 encode byte for byte on
1, 2 and 4 ranks, with H5b's deferred commit too; the encoder runs once for chunk 0 either way, at
the session's start under H5c and inside chunk 0 without it. And the session's picture is the
client's: the driver makes it before the session's start stamp and hands it to the DiT ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import candidates as C
from harness.config import load_preset, override
from harness.drivers import driver as D
from harness.engine.conditions import SessionConditions
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup, run_ranks
from harness.engine.image import check_picture, picture_condition, synthetic_image
from harness.errors import HarnessError
from helpers.ranks import assert_ranks_match
from harness.pipeline import messages as M

CPU = torch.device("cpu")
CHUNKS = 3
ACTIONS = [["W", "WJ", ""], ["D", "", "I"], ["", "", ""]]


def _cfg(sp: int = 1, start: str = "chunk", commit: str = "inline"):
    return override(load_preset("tiny"), parallel={"sp": sp}, runtime={"condition_start": start, "commit": commit})


def _session(eng: DitEngine, seed: int = 5) -> tuple[list[bytes], list[int]]:
    """The session's latents, and how many chunks the image encoder had run after its start and
    after each chunk."""
    image = picture_condition(eng.cfg, synthetic_image(seed, eng.cfg.video.height, eng.cfg.video.width), CPU)
    s = eng.start_session(SessionConditions(prompt="h5c", seed=seed, image_condition=image))
    encoded = [image.encoded_chunks]
    out = []
    for c in range(CHUNKS):
        out.append(eng.generate_chunk(s, ACTIONS[c]).numpy().tobytes())
        encoded.append(image.encoded_chunks)
    eng.end_session(s)
    return out, encoded


def _engine(group: RankGroup | None = None, **kw) -> DitEngine:
    group = group or RankGroup.single()
    return DitEngine(_cfg(group.size, **kw), group=group, device=CPU, seed=3)


@pytest.mark.parametrize("commit", ["inline", "deferred"])
def test_session_start_encode_gives_the_same_bytes(commit):
    want, enc_chunk = _session(_engine(commit=commit))
    got, enc_session = _session(_engine(start="session", commit=commit))
    assert got == want
    assert enc_chunk == [0] + list(range(1, CHUNKS + 1))  # chunk 0's encode inside chunk 0
    assert enc_session == [1] + list(range(1, CHUNKS + 1))  # at the start, and not again for chunk 0


def test_switch_is_read_per_session():
    eng = _engine()
    want, _ = _session(eng)
    eng.condition_start = "session"
    got, encoded = _session(eng)
    assert got == want and encoded[0] == 1


def _rank(group: RankGroup, start: str) -> list[bytes]:
    return _session(_engine(group, start=start))[0]


@pytest.mark.parametrize("sp", [2, 4])
def test_sp_ranks_session_start_bytes(sp):
    """Every rank encodes its own condition at the start: the bytes of the chunk-0 encode on those
    ranks, and within SP's tolerance of one rank."""
    one = run_ranks(_rank, 1, "chunk")[0]
    at_chunk = run_ranks(_rank, sp, "chunk")
    at_start = run_ranks(_rank, sp, "session")
    assert_ranks_match(at_start, at_chunk[0], one, 1e-4)


def test_candidate_sets_the_switch_and_is_refused_where_it_cannot_show():
    cfg = C.configure(["H5c"], load_preset("tiny"))
    assert cfg.runtime.condition_start == "session" and C.get("H5c").gate == "exact"
    from harness.experiments.ab_engine import plan_arm

    with pytest.raises(HarnessError, match="runtime.condition_start.*use compare"):
        plan_arm(["H5c"], load_preset("tiny"))
    with pytest.raises(HarnessError, match="does not apply to --engine vllm-omni"):
        C.resolve(["H5c"], override(load_preset("tiny"), engine={"backend": "vllm-omni"}, parallel={"sp": 1}))


def test_a_picture_of_the_wrong_shape_is_refused():
    cfg = load_preset("tiny")
    h, w = cfg.video.height, cfg.video.width
    assert check_picture(np.zeros((h, w, 3), np.uint8), h, w).shape == (h, w, 3)
    with pytest.raises(HarnessError, match=r"must be \(%d, %d, 3\) uint8" % (h, w)):
        picture_condition(cfg, np.zeros((h, w + 8, 3), np.uint8), CPU)
    with pytest.raises(HarnessError, match="uint8"):
        picture_condition(cfg, np.zeros((h, w, 3), np.float32), CPU)


def test_picture_arrives_from_the_wire_as_made():
    """A read-only wire buffer gives the condition of the array it was made from."""
    cfg = load_preset("tiny")
    pic = synthetic_image(7, cfg.video.height, cfg.video.width)
    wire = M.Tensor.of(pic).array()
    assert not wire.flags.writeable
    a, b = picture_condition(cfg, pic, CPU), picture_condition(cfg, wire, CPU)
    assert torch.equal(a.latents(0), b.latents(0))


class _Opened(Exception):
    pass


def test_driver_makes_the_picture_before_the_session_starts(monkeypatch, tmp_path):
    """The picture is the client's upload: made before ``start_ns``, sent whole to the DiT ranks."""
    cfg = load_preset("tiny")
    made: list[int] = []
    real = D.synthetic_image

    def timed(seed, h, w):
        out = real(seed, h, w)
        made.append(D.now())
        return out

    seen = {}

    def opened(self, s, seed, picture):
        seen.update(start_ns=s.start_ns, seed=seed, picture=picture)
        raise _Opened

    monkeypatch.setattr(D, "synthetic_image", timed)
    monkeypatch.setattr(D.Driver, "_open", opened)
    drv = D.Driver(cfg, launcher=None, run_dir=tmp_path)
    try:
        with pytest.raises(_Opened):
            drv.run_session(session=1, epoch=1, seed=42)
    finally:
        drv.close()
    assert made and made[-1] <= seen["start_ns"]
    assert seen["seed"] == 42
    assert np.array_equal(seen["picture"].array(), real(42, cfg.video.height, cfg.video.width))
