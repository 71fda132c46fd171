"""H3c: a runtime switch of the DiT rank's image-condition encoder, set before launch — fp16 refused
in one line where there is no GPU, bf16 taken anywhere, the VAE decoder's dtype untouched, and the
engine-only benchmarks (which run no image condition) sending it to ``compare``. Its numbers: the
whole-chunk schedule against production's in tests/engine/test_noise_conventions.py; served end to
end through its gate in tests/candidates/test_candidates.py."""

from __future__ import annotations

import pytest

from harness import candidates as C
from harness.config import load_preset
from harness.errors import HarnessError
from harness.experiments.ab_engine import plan_arm


def test_h3c_configures_the_condition_encoder_only():
    cfg = load_preset("tiny")
    with pytest.raises(HarnessError, match=r"candidate H3c:fp16-chunk \(condition_fp16\) needs cuda; this run is on cpu"):
        C.resolve(["H3c"], cfg)
    after = C.configure_resolved(C.resolve(["H3c:bf16-chunk"], cfg), cfg)
    assert (after.runtime.condition_dtype, after.runtime.condition_chunk) == ("bfloat16", True)
    assert after.runtime.vae_dtype == cfg.runtime.vae_dtype and after.vae == cfg.vae
    after = C.configure_resolved(C.resolve(["H3c:bf16"], cfg), cfg)
    assert (after.runtime.condition_dtype, after.runtime.condition_chunk) == ("bfloat16", False)


def test_h3c_is_not_an_engine_benchmark_candidate():
    with pytest.raises(HarnessError, match="use compare"):
        plan_arm(["H3c:bf16-chunk"], load_preset("tiny"))
