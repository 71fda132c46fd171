"""H1d: the attention cores leave their results in persistent buffers (``attention.OutputBuffers``)
instead of a new tensor per call. They run between compiled graphs, so under CUDA graphs every
fresh result is an address the next graph has not seen and must first copy into its own input:
cudagraph trees' input copies (``multi_tensor_apply``, ≈ 27 ms of a 480×832 chunk on an H200 with
FA3). A buffer marked as a static address is read in place instead. FA3 bf16 (``H1b:fa3``) writes
its result straight into the buffer; any other kernel's result is copied there, which only moves
the copy. Same kernels, same values: an exact gate."""

from harness.candidates import Candidate, set_runtime

CANDIDATE = Candidate(
    id="H1d",
    name="static_attention_out",
    description="attention results in persistent static-address buffers: no CUDA-graph input copies (FA3 writes in place)",
    gate="exact",
    changes="engine",
    configure=lambda cfg, arg: set_runtime(cfg, attention_out="static"),
)
