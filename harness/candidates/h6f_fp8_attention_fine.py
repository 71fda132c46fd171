"""H6f: attention with FP8 where its error is smallest — in P·V only (``pv``), with per-block
rather than per-head scales for Q and K (``qk-block``), or both (``qk-block+pv``); the numerics in
``engine/fp8_fine.py``, self- and cross-attention alike.

Why: H6b's per-head FP8 in Q·Kᵀ and P·V fails the gate on random weights, and its passing form
(``smooth-early``) keeps bf16 in two of five forwards. Issue 25 asks which finer placement passes
and what it buys. On CUDA the candidate runs the Triton kernel (``engine/fused_fp8_attention``,
the backends ``fp8-<mode>``): FlashAttention's single pass with these scales, P·V (or Q·Kᵀ) on FP8
tensor cores — what a placement buys. Elsewhere it runs the emulation (``fp8-<mode>-emulated``:
the same rounding through PyTorch ops, slowly), which answers the gate's question at any size on
any device; set ``runtime.attention`` to the emulated name to gate on a GPU without the kernel.
The two round alike but not identically: the kernel casts P against the running row maximum of
its online softmax, and with ``qk-block`` alone rounds P to bf16 for a bf16 P·V.

Every scale is SP-invariant (Q per query row, K per block of the head's whole key sequence, V per
channel), so SP 1, 2 and 4 round the same values the same way. Gate: threshold, indicative on
random weights (near-uniform attention is harder on FP8 than a trained model's).
"""

from harness.candidates import Candidate, set_runtime
from harness.engine.fp8_fine import MODES, backend_name, kernel_name
from harness.errors import HarnessError


def _configure(cfg, arg: str):
    if cfg.runtime.kv_path == "paged":  # the paged walk merges its own partials: no dense backend runs there
        raise HarnessError("H6f needs the gather KV path (runtime.kv_path=gather): the paged walk does not run a dense backend")
    if cfg.runtime.device != "cuda":
        return set_runtime(cfg, attention=backend_name(arg))
    if cfg.runtime.dtype != "bfloat16":  # the kernel's P·V (and its Q·Kᵀ without qk-block) is a bf16 product
        raise HarnessError(f"H6f's kernel attends in bf16; this run's runtime.dtype is {cfg.runtime.dtype}")
    return set_runtime(cfg, attention=kernel_name(arg))


CANDIDATE = Candidate(
    id="H6f",
    name="fp8_attention_fine",
    description="attention with FP8 in P·V only (pv), per-block Q/K scales (qk-block) or both — a Triton kernel on CUDA, emulated elsewhere",
    gate="threshold",
    conflicts=("H1a", "H1b", "H6b", "H6c", "H6d"),
    changes="engine",
    arg_choices=tuple(MODES),
    default_arg="pv",
    configure=_configure,
)
