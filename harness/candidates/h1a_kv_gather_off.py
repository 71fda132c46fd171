"""H1a: read the paged KV cache in place through the block table instead of gathering the
visible blocks into a contiguous tensor before attention. Saves the gather copy (≈ 2 × 28080 ×
heads × 128 × 2 bytes per layer per forward at 480×832); numerics change only by summation order."""

from harness.candidates import Candidate, set_runtime

CANDIDATE = Candidate(
    id="H1a",
    name="kv_gather_off",
    description="attention reads the paged KV through the block table instead of gathering it",
    gate="threshold",
    changes="engine",
    configure=lambda cfg, arg: set_runtime(cfg, kv_path="paged"),
)
