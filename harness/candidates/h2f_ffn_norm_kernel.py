"""H2f: the DiT block's FFN input — the cross-attention's residual add, the FFN LayerNorm, the
per-frame modulation, the rounding to bf16 and, with H6e's FP8 FFN, FFN-up's per-row e4m3
quantisation — in one Triton pass over the residual stream.

On an H200 at 480×832 with the stack of gpu-batch23 (H6e … H2d), the largest kernel left outside
GEMM and attention is Inductor's for these steps: 23.9 ms a steady chunk over 200 calls, a looped
reduction that walks each 5 120-wide row three times (Inductor keeps a row in registers only to
1 024 columns), where one read of the fp32 stream and one write of the codes is ≈ 120 MB a call.
The kernel (``engine/fused_norm.py``) holds a row in registers and does it in one pass; the op
around it (``engine/ffn_norm.py``) is opaque to Inductor. Without H6e the op makes the bf16 input
the FFN's GEMM reads (one rounding less to fuse, the same single read). The add is in the pass
because Inductor fuses it into its own norm kernel: gpu-batch25's op, which took the summed stream,
left it as a kernel of its own (14.8 ms a chunk on an H100) and bought nothing.

Numerics: the module's own ops in their order, the moments summed in another order and the
modulation's product and sum contracted as the GPU contracts them, then the quantisation with the
reference's IEEE division: a value at a bf16 rounding boundary can land one step away (the tests
count them), hence a threshold gate. Any layout and SP degree (a rank's slice may start mid-frame:
the kernel finds each row's frame).
"""

from harness.candidates import Candidate, set_runtime

CANDIDATE = Candidate(
    id="H2f",
    name="ffn_norm_kernel",
    description="the block's cross-attention add + FFN LayerNorm + modulation + rounding (+ H6e's FP8 quantisation) "
                "in one Triton pass",
    gate="threshold",
    needs=("cuda", "triton"),
    changes="engine",
    configure=lambda cfg, arg: set_runtime(cfg, ffn_norm="kernel"),
)
