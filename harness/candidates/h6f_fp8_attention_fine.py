"""H6f: attention with FP8 where its error is smallest — in P·V only (``pv``), with per-block
rather than per-head scales for Q and K (``qk-block``), or both (``qk-block+pv``); the numerics in
``engine/fp8_fine.py``, self- and cross-attention alike.

Why: H6b's per-head FP8 in Q·Kᵀ and P·V fails the gate on random weights, and its passing form
(``smooth-early``) keeps bf16 in two of five forwards. Issue 25 asks which finer placement passes
and what it buys. This candidate answers the first half at any size on any device: the backends
emulate the rounding (e4m3 operands with their scales, fp32 accumulation) through PyTorch ops,
slowly. The second half — the time — needs an FP8 attention kernel with block scales (a Triton
or CUTLASS kernel in SageAttention's manner), which is not built: do not read a speed off this
candidate.

Every scale is SP-invariant (Q per query row, K per block of the head's whole key sequence, V per
channel), so SP 1, 2 and 4 round the same values the same way. Gate: threshold, indicative on
random weights (near-uniform attention is harder on FP8 than a trained model's).
"""

from harness.candidates import Candidate, set_runtime
from harness.engine.fp8_fine import MODES, backend_name
from harness.errors import HarnessError


def _configure(cfg, arg: str):
    if cfg.runtime.kv_path == "paged":  # the paged walk merges its own partials: no dense backend runs there
        raise HarnessError("H6f needs the gather KV path (runtime.kv_path=gather): the paged walk does not run a dense backend")
    return set_runtime(cfg, attention=backend_name(arg))


CANDIDATE = Candidate(
    id="H6f",
    name="fp8_attention_fine",
    description="attention with FP8 in P·V only (pv), per-block Q/K scales (qk-block) or both — emulated numerics for the gate, no kernel",
    gate="threshold",
    conflicts=("H1a", "H1b", "H6b", "H6c", "H6d"),
    changes="engine",
    arg_choices=tuple(MODES),
    default_arg="pv",
    configure=_configure,
)
