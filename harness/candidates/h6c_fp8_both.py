"""H6c: H6a's FP8 FFN and H6b's FP8 attention together (the argument is H6b's scaling).

The two errors add up in the latent, so H6c can fail its gate where each half passes; it is a
candidate of its own so that the combination gets its own verdict. Same caveat as its halves: a
verdict on random weights is indicative, re-run it with the checkpoint loaded.
"""

from harness.candidates import Candidate, set_runtime
from harness.candidates.h6a_fp8_linear import patch_ffn_fp8
from harness.candidates.h6b_fp8_attention import BACKENDS, patch_steps


def _patch(engine, arg: str):
    reverts = [patch_ffn_fp8(engine, "ffn"), patch_steps(engine, arg)]

    def revert() -> None:
        for r in reversed(reverts):
            r()

    return revert


CANDIDATE = Candidate(
    id="H6c",
    name="fp8_ffn_attention",
    description="H6a (FFN GEMMs in FP8) + H6b (FP8 FlashAttention-3) in one candidate",
    gate="threshold",
    needs=("cuda", "fa3", "fp8"),
    conflicts=("H1b", "H6a", "H6b"),
    changes="engine",
    arg_choices=tuple(BACKENDS),
    default_arg="smooth",
    configure=lambda cfg, arg: set_runtime(cfg, attention=BACKENDS[arg]),
    patch_dit=_patch,
)
