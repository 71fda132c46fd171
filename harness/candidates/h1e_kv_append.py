"""H1e: the attention kernel writes the chunk's K/V into the cache itself. With the window layout
(H1c) the chunk in flight is the tail of the session's visible span, which is exactly FA3's
append-KV contract: the kernel is given the span, the chunk's new K/V and the kept length, stores
the new K/V behind the kept tokens and attends over the span. The copy kernels that write them
(≈ 18 ms of a 480×832 chunk on an H200: the V slice is strided, so one of the two is an
elementwise copy) go. Implies the window layout. A kernel without an appending form (anything but
``H1b:fa3``) keeps the copy; so does the capture hook, which must see the K/V go in.

The gate is a threshold: the appending kernel is another instantiation of FA3's forward (bit-
identical to the plain one in the GPU kernel test, tests/engine/test_fa3_cuda.py). Measured on an
H200 (docs/results gpu-batch19): the copies go (51.2 → 15.7 ms with H1d) but FA3's self-attention
with append-KV takes ≈ 270 ms a chunk more, so the chunk is 11 % slower: kept as a measured
candidate, not for use."""

from harness.candidates import Candidate, set_runtime

CANDIDATE = Candidate(
    id="H1e",
    name="kv_append",
    description="the attention kernel writes the chunk's K/V into the window layout's slot (FA3 append-KV): no K/V copy",
    gate="threshold",
    changes="engine",
    conflicts=("H1a", "H6d"),
    configure=lambda cfg, arg: set_runtime(cfg, kv_layout="window", kv_write="append"),
)
