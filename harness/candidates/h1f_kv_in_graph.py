"""H1f: the block writes the chunk's K/V into the cache itself, inside its compiled graph.

By default the K/V leave the block's graph as tensors and the attention core copies them into the
cache (``kvcache.write``): on an H200 at 480×832 with the window layout and H1d that is a 200-call
``direct_copy`` (V is a strided slice of the fused QKV output, 12.9 ms a chunk) and 200
``Memcpy DtoD`` (K, ≈ 5 ms) — the biggest part of the 33.8 ms of copies left in a steady chunk
(docs/results gpu-batch19). With this switch the block's traced code stores them into their blocks
of the pools (``dit.store_kv``: an ``index_copy_`` by the chunk's block ids), so inductor makes
the store part of the kernels of the graph — the norm + RoPE kernel writes K straight into the
pool instead of into a tensor that is then copied — and the pools, marked static addresses, are
written in place by the CUDA graphs. Unlike H1e the attention kernel is the plain one.

Any layout and KV path (the store goes by block id). Under SP the chunk's K/V reach their heads'
ranks only in the attention core's all-to-all, after the graph, so there the core copies them as
before (the switch changes nothing there). Eager runs the same ``index_copy_`` the paged cache's
write runs: an exact gate. Conflicts with H1e (the kernel writes them) and H6d (the FP8 cache
quantises them on its own write)."""

from harness.candidates import Candidate, set_runtime

CANDIDATE = Candidate(
    id="H1f",
    name="kv_in_graph",
    description="the block's compiled graph writes the chunk's K/V into the cache where it makes them: no K/V copy kernels",
    gate="exact",
    changes="engine",
    conflicts=("H1e", "H6d"),
    configure=lambda cfg, arg: set_runtime(cfg, kv_write="graph"),
)
