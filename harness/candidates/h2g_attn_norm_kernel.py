"""H2g: the DiT block's self-attention input — the previous block's carried FFN add (H2c), the
block's first LayerNorm, the per-frame modulation and the rounding to bf16 — in one Triton pass
over the residual stream.

On an H200 at 480×832 with the stack of gpu-batch23 (H6e … H2d), Inductor's kernel for these
steps is 21.1 ms a steady chunk over 200 calls: a looped reduction that walks each 5 120-wide row
three times (the add, then the moments, then the modulation), where one read of the stream and
the FFN output and one write of the new stream and the attention's input is the least it can move.
The kernel (``_add_norm_kernel`` in ``engine/fused_norm.py``, next to H2f's) holds a row in
registers and does it in one pass; the op around it (``engine/attn_norm.py``) is opaque to
Inductor. Without H2c (nothing carried) the block's first norm and modulation run as H2f's op does.

Numerics: the block's own ops in their order, the moments summed in another order and a product
and sum contracted as the GPU contracts them: a value at a bf16 rounding boundary can land one
step away (the tests count them), hence a threshold gate. Any layout and SP degree (a rank's
slice may start mid-frame: the kernel finds each row's frame).
"""

from harness.candidates import Candidate, set_runtime

CANDIDATE = Candidate(
    id="H2g",
    name="attn_norm_kernel",
    description="the carried FFN add + the block's first LayerNorm + modulation + rounding in one Triton pass",
    gate="threshold",
    needs=("cuda", "triton"),
    changes="engine",
    configure=lambda cfg, arg: set_runtime(cfg, attn_norm="kernel"),
)
