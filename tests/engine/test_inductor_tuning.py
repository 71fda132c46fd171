"""H2e on CPU: inductor's kernel tuning as a switch between sets of compiled blocks
(``runtime.inductor_tuning``).

Its options are Triton's (multi-kernel reductions, coordinate-descent block sizes): the CPU's C++
kernels are the same, so here the settings give the same bytes, which is what shows that a switch
runs the same graphs. What is tested is the switch: each setting compiles its own set at its
first chunk and none after, going back to a setting reuses its kept set (nothing compiles), the
compiled stats name the options in force, and the refusals (eager, deterministic, unknown)."""

from __future__ import annotations

import pytest
import torch

from harness import candidates as C
from harness.config import load_preset, override
from harness.engine.dit_engine import INDUCTOR_TUNING, DitEngine, inductor_tuning
from harness.engine.groups import RankGroup
from harness.errors import HarnessError
from harness.experiments.ab_engine import ENGINE_SWITCHES
from tests.helpers.sessions import session_bytes

CHUNKS = 3


def _cfg(mode: str = "eager", tuning: str = ""):
    return override(load_preset("tiny"), parallel={"sp": 1}, runtime={"mode": mode, "inductor_tuning": tuning})


def test_the_options_of_each_setting_and_the_refusals():
    assert inductor_tuning("", "compiled") == {}
    assert inductor_tuning("multi-kernel", "compiled") == {"triton.multi_kernel": 1}
    assert inductor_tuning("both", "compiled") == {"triton.multi_kernel": 1, "coordinate_descent_tuning": True}
    assert set(INDUCTOR_TUNING) == {"", "multi-kernel", "coordinate-descent", "both"}
    import torch._inductor.config as ic  # every option is one this torch's inductor has

    for opts in INDUCTOR_TUNING.values():
        for k in opts:
            obj = ic
            for part in k.split("."):
                obj = getattr(obj, part)
    with pytest.raises(HarnessError, match="deterministic"):
        inductor_tuning("coordinate-descent", "deterministic")
    with pytest.raises(HarnessError, match="must be one of"):
        inductor_tuning("max-autotune", "compiled")
    assert inductor_tuning("", "deterministic") == {}


def test_switching_compiles_each_set_once_and_keeps_it():
    eng = DitEngine(_cfg("compiled"), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    base = session_bytes(eng, "h2e", CHUNKS)
    eng.inductor_tuning = "both"
    assert eng.compile_stats()["options"]["options"]["triton.multi_kernel"] == 1
    both = session_bytes(eng, "h2e", CHUNKS)
    eng.inductor_tuning = ""
    assert "triton.multi_kernel" not in eng.compile_stats()["options"]["options"]
    again = session_bytes(eng, "h2e", CHUNKS)
    assert both == base and again == base  # Triton's options: the CPU's kernels are the same
    per_chunk = eng.compile_stats()["compiles_per_chunk"]
    assert per_chunk[0] > 0 and per_chunk[CHUNKS] > 0, per_chunk  # each set traced at its first chunk
    # chunk 1 differs in shape from chunk 0 (one compile more); nothing after that, and the kept set reused
    assert per_chunk[2:CHUNKS] == [0] * (CHUNKS - 2) and per_chunk[CHUNKS + 2 : 2 * CHUNKS] == [0] * (CHUNKS - 2)
    assert per_chunk[2 * CHUNKS :] == [0] * CHUNKS, per_chunk


def test_a_configured_engine_compiles_with_it_and_eager_refuses_it():
    eng = DitEngine(_cfg("compiled", "coordinate-descent"), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    assert eng.inductor_tuning == "coordinate-descent"
    assert eng.compile_stats()["options"]["options"]["coordinate_descent_tuning"] is True
    eager = DitEngine(_cfg(), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    with pytest.raises(HarnessError, match="this engine runs eager"):
        eager.inductor_tuning = "multi-kernel"
    assert eager.inductor_tuning == ""
    with pytest.raises(HarnessError, match="deterministic"):
        DitEngine(_cfg("deterministic", "both"), group=RankGroup.single(), device=torch.device("cpu"), seed=3)


def test_candidate_sets_the_switch_in_compiled_mode_only():
    c = C.get("H2e")
    assert c.gate == "threshold" and "inductor_tuning" in ENGINE_SWITCHES and c.default_arg == "multi-kernel"
    cuda = override(load_preset("tiny"), runtime={"device": "cuda", "mode": "compiled"})
    assert c.configure(cuda, "both").runtime.inductor_tuning == "both"
    with pytest.raises(HarnessError, match="needs --mode compiled, not eager"):
        c.configure(override(cuda, runtime={"mode": "eager"}), "both")
    with pytest.raises(HarnessError, match=r"^candidate H2e \(inductor_tuning\) needs cuda; this run is on cpu$"):
        C.resolve(["H2e"], _cfg("compiled"))
