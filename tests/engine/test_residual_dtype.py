"""H2b on CPU, in bf16: the residual stream in the runtime dtype (``ForwardContext.residual``).

The switch changes the stream's dtype and nothing else (the fp32 stream's bytes are untouched by
its code path); the bf16 stream's latents are measured against the fp32 stream's with the threshold
gate's own metrics, eager and compiled; under SP with 2 and 4 ranks every rank agrees and stays
within SP's tolerance of one rank; the tiny fp32 preset refuses the candidate in one line. Its
gate verdict on random weights is the finding, recorded in docs/results/cpu-h2b/, not asserted.
The comparison with vLLM-Omni's own transformer in bf16 is tests/engine/omni/test_residual_numerics.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import candidates as C
from harness.config import load_preset, override
from harness.engine import dit
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup, run_ranks
from harness.errors import HarnessError
from harness.experiments.ab_engine import ENGINE_SWITCHES
from harness.measure.gates import latent_metrics
from tests.helpers.ranks import assert_ranks_match
from tests.helpers.sessions import session_bytes

CACHE = {"sink_frames": 3, "window_frames": 9}
CHUNKS = 5


def _cfg(sp: int = 1, mode: str = "eager"):
    return override(load_preset("tiny"), parallel={"sp": sp}, cache=CACHE, runtime={"dtype": "bfloat16", "mode": mode})


def _session(eng: DitEngine, residual: str) -> list[bytes]:
    eng.residual = residual
    return session_bytes(eng, "h2b", CHUNKS)


def _floats(chunks: list[bytes]) -> list[np.ndarray]:
    return [np.frombuffer(c, np.float32) for c in chunks]


def test_the_stream_is_the_runtime_dtype_only_when_asked():
    seen, real = [], dit.camera_update

    def spy(x, scale, shift):  # every block updates the stream here, between its two attentions
        seen.append(x.dtype)
        return real(x, scale, shift)

    eng = DitEngine(_cfg(), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    dit.camera_update = spy
    try:
        _session(eng, "float32")
        fp32 = set(seen)
        seen.clear()
        _session(eng, "runtime")
    finally:
        dit.camera_update = real
    assert fp32 == {torch.float32} and set(seen) == {torch.bfloat16}


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_bf16_stream_is_measured_against_the_fp32_stream(mode):
    """The fp32 stream is the same bytes before and after a bf16-stream session (the switch leaves
    nothing behind); the bf16 stream differs from it by bf16 rounding of the stream — more than 0,
    well under the 5 % that a broken cast (a stream rounded to the wrong dtype, or never rounded
    back) would show. The 0.01 gate's verdict itself is the finding, not a contract."""
    eng = DitEngine(_cfg(mode=mode), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    before, bf16, after = _session(eng, "float32"), _session(eng, "runtime"), _session(eng, "float32")
    if mode == "eager":
        assert before == after
    for a, b in zip(_floats(before), _floats(bf16)):
        m = latent_metrics(a, b)
        assert 1e-4 < m["rel_l2"] < 0.05, m
    if mode == "compiled":
        per_chunk = eng.compile_stats()["compiles_per_chunk"]
        for v in range(3):  # each setting's first chunk may trace; nothing after it compiles
            assert per_chunk[v * CHUNKS + 1 : (v + 1) * CHUNKS] == [0] * (CHUNKS - 1), per_chunk


def _rank(group: RankGroup, cfg) -> list[bytes]:
    eng = DitEngine(override(cfg, parallel={"sp": group.size}), group=group, device=torch.device("cpu"), seed=3)
    return _session(eng, "runtime")


@pytest.mark.parametrize("sp", [2, 4])
def test_sp_ranks_agree_and_match_one_rank(sp):
    """Each rank rounds its own tokens' stream; the all-to-alls carry the same bf16 values a single
    rank holds, so SP moves only the attention sums' rounding — which a bf16 stream then rounds."""
    one = run_ranks(_rank, 1, _cfg())[0]
    ranks = run_ranks(_rank, sp, _cfg())
    assert_ranks_match(ranks, ranks[0], one, 5e-3)


def test_candidate_sets_the_switch_and_is_refused_where_it_changes_nothing():
    bf16 = override(load_preset("tiny"), runtime={"dtype": "bfloat16"})
    cfg = C.configure(["H2b"], bf16)
    assert cfg.runtime.residual == "runtime" and C.get("H2b").gate == "threshold"
    assert "residual" in ENGINE_SWITCHES  # ab-engine judges it inside one engine
    with pytest.raises(HarnessError, match="runtime.dtype is float32"):
        C.configure(["H2b"], load_preset("tiny"))
