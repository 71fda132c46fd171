"""``--mode compiled`` on the tiny DiT (CPU inductor): within the threshold gate of eager over a
session that saturates and evicts the KV window, and nothing recompiles after the first chunk —
the K length grows from chunk to chunk, but it never reaches a compiled graph. The camera cache
(H2a) stays exact in compiled mode: the block graph is the same with and without it. Attention
results in static buffers (H1d) are exact too: their (S, H·D) hand-over compiles the code after
each attention core once more, and then both kinds of graph live side by side."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.candidates import EnginePatches
from harness.config import load_preset, override
from harness.engine.conditions import SessionConditions
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup
from harness.measure.gates import latent_metrics, latent_passes

_ACTIONS = [["W", "WJ", ""], ["D", "", "I"], ["", "", ""], ["SL", "K", "A"]]
SESSIONS = ((11, 8), (12, 3))  # (seed, chunks): the window saturates at chunk 5, evicts from 6


def _tiny(mode: str):
    return override(load_preset("tiny"), parallel={"sp": 1}, runtime={"mode": mode})


def _sessions(eng: DitEngine) -> list[np.ndarray]:
    out = []
    for seed, chunks in SESSIONS:
        s = eng.start_session(SessionConditions(prompt="compiled", seed=seed))
        out += [eng.generate_chunk(s, _ACTIONS[c % len(_ACTIONS)]).numpy().copy() for c in range(chunks)]
        eng.end_session(s)
    return out


@pytest.fixture(scope="module")
def runs():
    from torch._dynamo.utils import counters

    eager = DitEngine(_tiny("eager"), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    compiled = DitEngine(_tiny("compiled"), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    breaks = set(counters["graph_break"])
    out = {"eager": _sessions(eager), "compiled": _sessions(compiled), "stats": compiled.compile_stats(),
           "eager_engine": eager, "new_breaks": set(counters["graph_break"]) - breaks}
    EnginePatches(["H2a"]).apply(dit=compiled)
    out["compiled_h2a"] = _sessions(compiled)
    out["stats_after_h2a"] = compiled.compile_stats()
    compiled.attention_out = "static"  # H1d, in the same process as fresh results (as ab-engine runs it)
    out["compiled_h1d"] = _sessions(compiled)
    out["stats_after_h1d"] = compiled.compile_stats()
    compiled.attention_out = "fresh"
    out["compiled_fresh_again"] = _sessions(compiled)
    out["stats_fresh_again"] = compiled.compile_stats()
    return out


def test_engine_reads_the_mode(runs):
    assert runs["eager_engine"].model.compiled_blocks is None
    assert runs["eager_engine"].compile_stats() == {"mode": "eager", "compiled": False}
    det = DitEngine(_tiny("deterministic"), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    assert det.model.compiled_blocks is not None and det.compile_options["mode"] == "default"
    if hasattr(torch._inductor.config, "deterministic"):
        assert det.compile_options["options"]["deterministic"] is True
    # CUDA graphs are asked for by mode, but a CPU engine has nothing to graph: dropped, and said so
    ro = DitEngine(_tiny("compiled"), group=RankGroup.single(), device=torch.device("cpu"), seed=3,
                   compile_mode="reduce-overhead")
    assert ro.compile_options["mode"] == "reduce-overhead" and not ro.cudagraphs
    assert "triton.cudagraphs" not in ro.compile_options["options"] and ro.compile_stats()["cudagraphs"] is False


def test_compiled_passes_the_threshold_gate(runs):
    for c, (a, b) in enumerate(zip(runs["eager"], runs["compiled"])):
        m = latent_metrics(a, b)
        assert not latent_passes(m), f"chunk {c}: {m}"


def test_nothing_recompiles_after_the_first_chunk(runs):
    st = runs["stats"]
    per_chunk = st["compiles_per_chunk"]
    assert len(per_chunk) == sum(n for _, n in SESSIONS)
    assert per_chunk[0] > 0 and per_chunk[1:] == [0] * (len(per_chunk) - 1), per_chunk
    assert st["recompiles"] == 0, st["recompile_reasons"]
    # the graphs break only at the two attention cores (the disabled functions)
    assert st["graphs"] >= 1 and st["graph_breaks"] > 0
    assert all("attend_cache" in why or "attend_text" in why for why in runs["new_breaks"]), runs["new_breaks"]


def test_camera_cache_is_exact_in_compiled_mode_and_compiles_nothing_new(runs):
    for c, (a, b) in enumerate(zip(runs["compiled"], runs["compiled_h2a"])):
        assert a.tobytes() == b.tobytes(), f"chunk {c} differs"
    assert runs["stats_after_h2a"]["frames"] == runs["stats"]["frames"]
    assert runs["stats_after_h2a"]["recompiles"] == 0


def test_static_attention_out_is_exact_and_compiles_once(runs):
    for c, (a, b, again) in enumerate(zip(runs["compiled_h2a"], runs["compiled_h1d"], runs["compiled_fresh_again"])):
        assert a.tobytes() == b.tobytes() == again.tobytes(), f"chunk {c} differs"
    before, h1d, again = runs["stats_after_h2a"], runs["stats_after_h1d"], runs["stats_fresh_again"]
    chunks = sum(n for _, n in SESSIONS)
    new = h1d["compiles_per_chunk"][-chunks:]
    # the two graphs after the attention cores, for the flat hand-over, in the first chunk only
    assert new[0] > 0 and new[1:] == [0] * (chunks - 1), new
    assert h1d["frames"] > before["frames"]
    # back to fresh results: the first graphs still match, nothing compiles
    assert again["frames"] == h1d["frames"] and again["compiles_per_chunk"][-chunks:] == [0] * chunks
