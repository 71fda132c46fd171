"""H6a: the FFN's two GEMMs of every block in FP8 (e4m3), per-token × per-channel scales.

Weights are quantised once per output channel when the candidate is first applied (kept beside
the bf16 weights, ≈ 5.7 GB at full size, so the patch reverts by swapping modules back);
activations are quantised per token in the forward, fused with the LayerNorm-modulate before
FFN-up and the GELU before FFN-down under ``torch.compile``. The FFN is 2·dim·ffn = 5.4·dim² of
a block's ≈ 15·dim² GEMM work per token, the largest single share, and in a whole-model probe
(480×832, full depth, random weights) FFN-only FP8 moved the latent by rel-L2 0.0033 while adding
the attention projections gave 0.026 and every large linear 0.038: the FFN is where FP8 is
cheap in accuracy. ``H6a:ffn+o`` adds the attention output projections (self o, cross q and o)
to measure that claim; the fused QKV GEMM stays bf16 in both (its outputs feed the RMSNorm, RoPE
and the scores directly).

Gate: threshold (DESIGN §5). On random weights the verdict is indicative only: activation and
weight ranges of the real checkpoint differ, so re-run the gate with the checkpoint loaded
(``--weights``) before trusting it.
"""

from harness.candidates import Candidate
from harness.engine.fp8_linear import LAYER_SETS, block_paths, swap_linears


def patch_ffn_fp8(engine, arg: str):
    cache = engine.__dict__.setdefault("_fp8_linears", {})  # quantised once per engine
    return swap_linears(engine.model, block_paths(len(engine.model.blocks), arg or "ffn"), cache)


CANDIDATE = Candidate(
    id="H6a",
    name="fp8_linear",
    description="FFN GEMMs in FP8 e4m3 (per-token activation, per-channel weight scales; _scaled_mm)",
    gate="threshold",
    # a GPU candidate: the CPU has an FP8 GEMM but no speed to gain, and at the tiny preset's
    # width (64) FP8 fails the latent gate that the full model passes (dot products of 64 terms)
    needs=("cuda", "fp8"),
    changes="engine",
    patch_dit=patch_ffn_fp8,
    arg_choices=tuple(LAYER_SETS),
    default_arg="ffn",
)
