"""H1c: keep each session's KV blocks contiguous and in frame order (the ``window`` layout of
``engine/kvcache.py``), so the gather path hands the kernel a view of the pool instead of copying
the whole window in every forward of every layer (≈ 134 ms of a 480×832 chunk on an H200, the
`copy` kernels). Eviction moves the kept recent frames forward once per chunk instead. The kernel
reads the same values in the same order, so the output is bit-identical: an exact gate."""

from harness.candidates import Candidate, set_runtime

CANDIDATE = Candidate(
    id="H1c",
    name="kv_window",
    description="KV blocks of a session kept contiguous in frame order: attention reads the window in place, no gather",
    gate="exact",
    changes="engine",
    configure=lambda cfg, arg: set_runtime(cfg, kv_layout="window"),
)
