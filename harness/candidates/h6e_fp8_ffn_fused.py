"""H6e: H6a's FP8 FFN with FFN-up's epilogue (bias, tanh-GELU, the per-row e4m3 quantisation of
the hidden activation) in one Triton pass instead of Inductor's looped two-pass reduction.

The numbers are H6a's (``engine/fp8_ffn.py``: the same ops in the same order; on CUDA the kernel
rounds where they round, and differs only where its own ``exp`` puts a GELU value on the other side
of a bf16 rounding boundary). What it changes is the kernel: in gpu-batch16's kernel table the
epilogue was the largest kernel outside GEMM and attention (58.8 ms a chunk at 480×832, 200 calls
of ≈ 0.29 ms, reading each row twice); one pass over a row held in registers reads 28 KB and
writes 14 KB a row. ``H6e:ffn-mid`` keeps the first and last blocks bf16 as ``H6a:ffn-mid`` does.

Gate: threshold, as H6a's (the FP8 itself is what moves the latent); on random weights indicative
only, like every FP8 verdict here.
"""

import weakref

import torch.nn as nn

from harness.candidates import Candidate
from harness.engine.fp8_ffn import Fp8Ffn
from harness.engine.fp8_linear import fp8_blocks
from harness.errors import HarnessError

#: engine → block index → its Fp8Ffn, quantised once per engine and kept across patch/revert
QUANTISED: "weakref.WeakKeyDictionary[object, dict[int, nn.Module]]" = weakref.WeakKeyDictionary()


def patch_ffn_fused(engine, arg: str):
    blocks = engine.model.blocks
    chosen = fp8_blocks(len(blocks), arg)
    if engine.device.type == "cuda":  # the kernel's autotuning, before any graph is compiled or captured
        from harness.engine.fused_gelu_quant import tune  # Triton: imported only on a GPU

        tune(engine.cfg.tokens_per_chunk // engine.group.size, engine.cfg.model.ffn_dim, engine.device)
    cache = QUANTISED.setdefault(engine, {})
    for i in chosen:  # every FFN wrapped (or refused) before any is swapped
        if i not in cache:
            cache[i] = Fp8Ffn(blocks[i].ffn)
    originals = [(blocks[i], blocks[i].ffn) for i in chosen]
    for i in chosen:
        blocks[i].ffn = cache[i]

    def revert() -> None:
        for block, ffn in originals:
            block.ffn = ffn

    return revert


def _configure(cfg, arg: str):
    # the kernel rounds as bf16 does: a float32 model would silently stop matching H6a
    if cfg.runtime.dtype != "bfloat16":
        raise HarnessError(f"candidate H6e fuses a bf16 FFN epilogue; this run's runtime.dtype is {cfg.runtime.dtype}")
    return cfg


CANDIDATE = Candidate(
    id="H6e",
    name="fp8_ffn_fused",
    description="H6a's FP8 FFN with bias + GELU + per-row e4m3 quantisation fused into one Triton pass",
    gate="threshold",
    needs=("cuda", "fp8", "triton"),
    conflicts=("H6a", "H6c"),  # each replaces the FFN's GEMMs; H6a:ffn+o's attention projections have no fused form here
    changes="engine",
    configure=_configure,
    patch_dit=patch_ffn_fused,
    arg_choices=("ffn", "ffn-mid"),
    default_arg="ffn",
)
