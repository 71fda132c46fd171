"""H2d: self-attention's q/k RMSNorms and RoPE — with H1f, the chunk's K/V store too — in one
Triton kernel over the fused QKV output.

On an H200 at 480×832 with the best combination and H1f (gpu-batch22), Inductor makes five
kernels a block of these steps: the two norms' row reductions (3.3 ms each a steady chunk), a
pointwise kernel normalising and rotating q and k into an fp32 buffer (15.4 ms) and two rounding
it to bf16, K's with the K/V store (11.6 and 6.9 ms): 40.5 ms of the 135.8 ms outside GEMM and
attention, against ≈ 14 ms for one read of q, k, v and one write at the copy bandwidth. The
kernel (``engine/fused_qk_norm_rope.py``) holds a row in registers and does it in one pass; the op
around it (``engine/qk_norm_rope.py``) is opaque to Inductor and declares the pools it writes.

Numerics: the module's own ops in their order, but the mean square summed in another order and
products and sums contracted as the GPU contracts them, rounded once: a value next to a bf16
rounding boundary can land one step away (the tests count them), hence a threshold gate. Any
layout, KV path and SP degree (under SP, or without H1f, the kernel returns K and V is the QKV
output's slice, as before).
"""

from harness.candidates import Candidate, set_runtime

CANDIDATE = Candidate(
    id="H2d",
    name="qk_norm_rope_kernel",
    description="self-attention's q/k RMSNorms + RoPE (+ H1f's K/V store) in one Triton pass over the QKV output",
    gate="threshold",
    needs=("cuda", "triton"),
    changes="engine",
    configure=lambda cfg, arg: set_runtime(cfg, qk_norm_rope="kernel"),
)
