"""H3c's ``-compile`` modes on CPU: the image condition's encoder with its step compiled
(``runtime.condition_compile``) gives the eager encoder's conditions within rounding, per frame in
fp32 and whole-chunk in bf16; a session's first call runs eagerly and every later one through the
one compiled step; the candidate's arguments set the switch, and an unknown mode is refused."""

from __future__ import annotations

import pytest
import torch

from harness import candidates as C
from harness.config import load_preset, override
from harness.engine.image import conditioning_image
from harness.errors import HarnessError

CPU = torch.device("cpu")
CHUNKS = 3


def _conditions(runtime: dict, compiled: bool) -> tuple[list[torch.Tensor], list[bool]]:
    """Each chunk's condition latents, and for each encoder call whether it went through the
    compiled step."""
    cfg = override(load_preset("tiny"), runtime={**runtime, "condition_compile": compiled})
    cond = conditioning_image(cfg, 3, CPU)
    enc = cond.model.encoder
    calls: list[bool] = []
    step_for = enc._step_for

    def spy(cache):
        step = step_for(cache)
        calls.append(enc.compiled_step is not None and step is enc.compiled_step)
        return step

    enc._step_for = spy
    try:
        return [cond.latents(k).clone() for k in range(CHUNKS)], calls
    finally:
        del enc._step_for


@pytest.mark.parametrize("runtime, tol", [({}, 1e-5), ({"condition_dtype": "bfloat16", "condition_chunk": True}, 2e-2)],
                         ids=["fp32-per-frame", "bf16-chunk"])
def test_compiled_encoder_gives_the_eager_conditions(runtime, tol):
    eager, eager_calls = _conditions(runtime, False)
    compiled, calls = _conditions(runtime, True)
    assert not any(eager_calls)
    assert calls[0] is False and all(calls[1:]) and len(calls) == len(eager_calls)
    for a, b in zip(compiled, eager):
        assert a.shape == b.shape and torch.isfinite(a).all()
        assert float((a - b).norm() / b.norm()) <= tol


def test_compile_modes_set_the_switch_and_unknown_modes_are_refused():
    cfg = C.configure(["H3c:bf16-chunk-compile"], load_preset("tiny"))
    rt = cfg.runtime
    assert (rt.condition_dtype, rt.condition_chunk, rt.condition_compile) == ("bfloat16", True, True)
    assert not C.configure(["H3c:bf16-chunk"], load_preset("tiny")).runtime.condition_compile
    with pytest.raises(HarnessError, match="needs cuda"):
        C.resolve(["H3c:fp16-chunk-compile"], load_preset("tiny"))
    from harness.experiments.vae_probe import check_condition

    with pytest.raises(HarnessError, match="unknown condition mode fp8"):
        check_condition(1, device="cpu", modes=("fp8",))
