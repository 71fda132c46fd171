"""H3c: the image condition's VAE encoder (in the DiT rank, every chunk until its fixed point) in
fp16 or bf16, and with ``-chunk`` a chunk's latent frames through it in one forward with cuDNN
autotuning — H3b's changes, applied to the encoder that production's image convention runs.

Why: on an H200 at 480×832 that encoder pass costs 242 ms a chunk (gpu-batch15, ``gpu-checks
condition``) and runs in each of a 10-chunk session's chunks (the fixed point comes at chunk 10),
on the DiT's critical path: it is the ≈ 250 ms by which a served DiT chunk exceeds
``bench-engine``'s, and part of the first chunk that bounds the warm TTFC. H3b's fp16 + whole-chunk
+ autotuning took the decoder from 396 to 205 ms (gpu-batch17); the encoder is the same kind of
network (causal 3-D convolutions, RMS norms, one mid-block attention).

``-compile`` also ``torch.compile``s the encoder's step (inductor, static shapes; a session's first
pixel frame runs eagerly, as H3a's decoder does; ``runtime.condition_compile``): the convolutions stay
cuDNN calls, the RMS norms, SiLUs, padding and concatenations around them fuse. The warm-up session
pays the compilation (a few graphs: three on an H200 at 480×832, in chunks 0–2).

A runtime switch (``runtime.condition_dtype``, ``runtime.condition_chunk``), set before launch:
the DiT rank builds its encoder in that dtype. fp16 needs a GPU (the CPU has no fp16 3-D
convolution worth running); bf16 runs anywhere.

Gate: threshold. The condition moves the DiT's input, so the served gate compares what it
always compares (``compare``: latents and frames against the baseline's); ``gpu-checks condition``
times the encoder alone in every mode and gives each mode's condition latents against fp32's.
Random weights: indicative only.
"""

from harness.candidates import Candidate, set_runtime

#: argument → (encoder dtype, whole-chunk forwards with autotuning, the encoder's step compiled)
MODES = {"fp16": ("float16", False, False), "fp16-chunk": ("float16", True, False), "bf16": ("bfloat16", False, False),
         "bf16-chunk": ("bfloat16", True, False), "fp16-chunk-compile": ("float16", True, True),
         "bf16-chunk-compile": ("bfloat16", True, True)}


def _configure(cfg, arg: str):
    dtype, chunk, compiled = MODES[arg]
    return set_runtime(cfg, condition_dtype=dtype, condition_chunk=chunk, condition_compile=compiled)


CANDIDATE = Candidate(
    id="H3c",
    name="condition_fp16",
    description="the image condition's VAE encoder (DiT rank) in fp16/bf16; -chunk: whole-chunk forwards, cuDNN autotuned; -compile: its step compiled",
    gate="threshold",
    changes="runtime",
    configure=_configure,
    arg_choices=tuple(MODES),
    default_arg="fp16-chunk",
    arg_needs={"fp16": ("cuda",), "fp16-chunk": ("cuda",), "fp16-chunk-compile": ("cuda",)},
)
