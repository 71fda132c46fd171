"""H2c: a DiT block's last residual add (x + FFN output · gate) runs at the start of the next
block, where compiled it fuses with that block's first norm.

The blocks are compiled one by one, so the graph of a block's FFN part ends by writing the
residual stream and the next block's first graph starts by reading it back for its LayerNorm: on an
H200 at 480×832 (H6e + H1b:fa3 + H1c + H2a + H1d, batch 19) the gated add is a 13.9 ms pointwise
kernel and the norm + modulation an 11.9 ms reduction, 200 of each a chunk, both over the 96 MB fp32
stream. Handed on as (x, FFN output, gate), the add becomes part of the next block's norm kernel:
the stream is read once instead of written and read again, and one kernel launch goes. The last
block's add runs before the head, compiled with the blocks. With the FP8 FFN (H6a/H6e), whose
FFN-down bias is added outside its GEMM, the bias add goes along too: handed on unadded, it runs in
the next block's norm kernel instead of as a 200-call add kernel over the FFN output at each graph's
end (5.7 ms a steady chunk in gpu-batch22, where it was still added in the block). The first block, with nothing carried
into it, traces a graph of its own: one recompilation in the warm-up, none after.

Same ops in the same order: bitwise in eager; compiled, the add is generated into another kernel,
whose fp32 intermediates need not round in the last place as the block-end kernel's did (on the
CPU a few bf16 chunks differ in their last bits), hence a threshold gate."""

from harness.candidates import Candidate, set_runtime

CANDIDATE = Candidate(
    id="H2c",
    name="ffn_residual_next",
    description="a block's last residual add runs at the next block's start, fused with its first norm",
    gate="threshold",
    changes="engine",
    configure=lambda cfg, arg: set_runtime(cfg, ffn_residual="next"),
)
