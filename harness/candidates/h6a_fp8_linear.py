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
and the scores directly). ``H6a:ffn-mid`` is the FFN in FP8 except the first and last 2 blocks
(``EDGE_BF16``), which make the stack's input and output and stay bf16. ``H6a:ffn+attn-smooth``
is ``ffn+o`` with the three attention projections smoothed SmoothQuant-style: per input channel
j, s_j = amax(x_j)^½ / amax(W_:,j)^½ rounded to a power of two, x·diag(1/s) and diag(s)·W
quantised instead (the same product exactly; outliers of an input channel move from the
per-token activation scale into the per-channel weight scale). The activation amax comes from a
calibration forward — one chunk of a throwaway session, eager, at the patch's first application
per engine, the max over SP ranks — not from per-call statistics.

Gate: threshold (DESIGN §5). On random weights the verdict is indicative only: activation and
weight ranges of the real checkpoint differ, so re-run the gate with the checkpoint loaded
(``--dit-weights PATH``; ``--set engine.dit_weights=PATH`` for ``ab-engine``) before trusting it.
"""

import weakref

import torch.distributed as dist

from harness.candidates import Candidate
from harness.engine.conditions import SessionConditions
from harness.engine.fp8_linear import LAYER_SETS, SMOOTHED, block_paths, input_amax, smooth_factors, swap_linears


#: The candidate's own state, not an attribute of the engine: per engine ("plain" or
#: "smooth:<arg>") → linear path → its Fp8Linear, kept across patch/revert so that weights are
#: quantised (and calibrated) once; a weak key, so it goes with the engine.
QUANTISED: "weakref.WeakKeyDictionary[object, dict[str, dict]]" = weakref.WeakKeyDictionary()


def calibrate(engine, paths: list[str]) -> dict:
    """Per-input-channel amax of the linears at ``paths`` over one chunk of a throwaway session,
    run eagerly on the bf16 model (hooks on compiled blocks would recompile them), the max over
    the SP group taken so that every rank smooths alike."""
    model = engine.model
    compiled, model.compiled_blocks = model.compiled_blocks, None

    def run() -> None:
        s = engine.start_session(SessionConditions(prompt="H6a calibration", seed=0))
        try:
            engine.generate_chunk(s, [""] * engine.frames)  # standing still: no camera motion
        finally:
            engine.end_session(s)

    group = engine.group
    reduce = (lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.group)) if group.active else None
    try:
        return input_amax(model, paths, run, reduce)
    finally:
        model.compiled_blocks = compiled


def patch_ffn_fp8(engine, arg: str):
    arg = arg or "ffn"
    n = len(engine.model.blocks)
    caches = QUANTISED.setdefault(engine, {})  # quantised once per engine
    if arg not in SMOOTHED:
        return swap_linears(engine.model, block_paths(n, arg), caches.setdefault("plain", {}))
    cache = caches.setdefault(f"smooth:{arg}", {})
    smoothed = block_paths(n, arg, SMOOTHED[arg])
    smooth = {}
    if not all(p in cache for p in smoothed):  # the calibration forward, once per engine
        amax = calibrate(engine, smoothed)
        smooth = {p: smooth_factors(amax[p], engine.model.get_submodule(p).weight) for p in smoothed}
    plain = [p for p in block_paths(n, arg) if p not in smoothed]
    reverts = [swap_linears(engine.model, plain, caches.setdefault("plain", {})),
               swap_linears(engine.model, smoothed, cache, smooth)]

    def revert() -> None:
        for r in reversed(reverts):
            r()

    return revert


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
