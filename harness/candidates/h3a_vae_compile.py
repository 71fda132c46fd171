"""H3a: ``torch.compile`` the VAE decoder's per-frame step (inductor).

What is compiled is ``Decoder.step`` for every latent frame but a session's first: the causal
cache slots go in as graph inputs and their replacements come out as outputs, so the steady
state is one graph, traced at the first session's second frame and reused by every later frame
and session (the first frame, once per session, takes the "Rep" path and runs eagerly). With
width sharding the halo exchanges and gathers stay outside the graphs, one fragment per exchange.
Convolutions stay cuDNN/oneDNN calls; what fuses is the RMS norms, SiLUs, padding and
concatenations around them, so the numerics change by summation order only (threshold gate).

The argument picks the inductor mode: ``default`` (no autotuning, compiles fastest) or
``max-autotune-no-cudagraphs`` (GPU). No CUDA graphs: a step's outputs are the next step's cache
inputs, which a replayed graph would overwrite. On CPU it runs, but the first session pays the
compile: about a minute for the tiny preset on two cores (more with VAE ranks > 1).
"""

from harness.candidates import Candidate


def _patch(engine, arg: str):
    engine.compile_decoder(**({} if arg == "default" else {"mode": arg}))
    return engine.uncompile_decoder


CANDIDATE = Candidate(
    id="H3a",
    name="vae_compile",
    description="torch.compile the VAE decoder's per-frame step (cache slots as graph inputs/outputs)",
    gate="threshold",
    changes="engine",
    arg_choices=("default", "max-autotune-no-cudagraphs"),
    default_arg="default",
    arg_needs={"max-autotune-no-cudagraphs": ("cuda",)},
    patch_vae=_patch,
)
