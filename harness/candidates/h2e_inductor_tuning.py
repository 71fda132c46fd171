"""H2e: inductor picks the shapes of the kernels it generates for the DiT blocks by timing them
on the device, instead of by its heuristics.

What is left outside GEMM and attention is inductor's Triton kernels (130.8 of 135.8 ms a steady
chunk at 480×832 in gpu-batch22). Their row reductions over the 5 120-wide stream are generated
looped, because inductor keeps a row in registers (a persistent reduction) only up to 1 024
columns: the FFN norm + modulation + FP8 quantisation kernel walks each row three times (22.9 ms,
against ≈ 15 ms for one read and one write of what it moves, at the rate the other norm kernels
reach). ``multi-kernel`` has inductor generate each reduction both ways and keep the faster, timed
at its first call (in the warm-up, before a CUDA graph records it); ``coordinate-descent`` tunes
each kernel's block sizes and warps by coordinate descent as it compiles; ``both`` does both.

The graphs and their ops are the same; a reduction may sum in another order, hence a threshold
gate. Compile time grows (each variant is compiled, and timed): measure it beside the chunk. A
compile option, not a per-session switch: ``ab-engine`` refuses it, ``ab-arms`` (an engine per
arm) judges it. Refused in eager (nothing is compiled) and in the deterministic mode (a kernel
chosen by timing is not the same from one launch to the next).

Measured (gpu-batch23, one H200, with H2d): ``multi-kernel`` kept the cross-attention norm kernel
persistent (19.1 → 16.9 ms a chunk) and timed the FFN norm + quantisation and the first norm kernels
faster looped (23.9 → 24.4, 21.1 → 21.1 ms): Triton −1.7 ms, the chunk unchanged. Forcing persistence
(inductor's ``multi_kernel = 2``) would keep what its timing found slower; one read a row of those two
kernels needs a kernel of our own, as H2d is for the q/k norms.
"""

from harness.candidates import Candidate, set_runtime
from harness.errors import HarnessError


def _configure(cfg, arg: str):
    if cfg.runtime.mode != "compiled":
        raise HarnessError(f"candidate H2e tunes inductor's kernels: it needs --mode compiled, not {cfg.runtime.mode}")
    return set_runtime(cfg, inductor_tuning=arg)


CANDIDATE = Candidate(
    id="H2e",
    name="inductor_tuning",
    description="inductor times its generated kernels' shapes on the device: reductions looped or persistent, block sizes",
    gate="threshold",
    needs=("cuda", "triton"),
    changes="engine",
    configure=_configure,
    arg_choices=("multi-kernel", "coordinate-descent", "both"),
    default_arg="multi-kernel",
)
