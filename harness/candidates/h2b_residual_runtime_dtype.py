"""H2b: the DiT's residual stream in the runtime dtype (bf16 on GPU), rounded where vLLM-Omni's
transformer rounds it, instead of Wan's fp32 stream.

Production keeps ``hidden_states`` in the model dtype: each block rounds it after the gated
self-attention add, after the camera update (which it computes in bf16 arithmetic), after the
cross-attention add and after the gated FFN add; norms, modulation and RoPE still run in fp32. The
reference's fp32 stream is the heaviest tensor every elementwise kernel outside the GEMMs reads
and writes (4 bytes a value against 2): at 480×832 each of a block's norm and residual kernels
moves a (4680, 5120) fp32 tensor once or twice, 200 times a chunk. With this switch the stream
is bf16 and the rounding points are production's (``dit.ForwardContext.residual``).

A threshold gate against the fp32 stream. With ``runtime.dtype = float32`` (the tiny CPU preset)
the stream is fp32 either way, so the candidate is refused there in one line rather than run as a
no-op: judge it with ``--set runtime.dtype=bfloat16``."""

from harness.candidates import Candidate, set_runtime
from harness.errors import HarnessError


def _configure(cfg, arg):
    if cfg.runtime.dtype == "float32":
        raise HarnessError("candidate H2b keeps the residual stream in the runtime dtype, and runtime.dtype is float32: "
                           "it would change nothing (set runtime.dtype=bfloat16)")
    return set_runtime(cfg, residual="runtime")


CANDIDATE = Candidate(
    id="H2b",
    name="residual_runtime_dtype",
    description="the DiT's residual stream in the runtime dtype (bf16), rounded where vLLM-Omni rounds it, not fp32",
    gate="threshold",
    changes="engine",
    configure=_configure,
)
