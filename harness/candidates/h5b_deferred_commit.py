"""H5b: the chunk's latent leaves the DiT after its 4 denoising passes; the commit pass (the 5th
forward, which writes the chunk's final K/V for later chunks) runs at the DiT's next call instead of
before the return (``runtime.commit = "deferred"``, engine/dit_engine.py). The DiT runs the same
forwards in the same order, so every value is the same (exact gate); what moves is when the latent
reaches the decoder: one forward sooner, which is most of what a first chunk waits for after its
DiT (TTFC), and a session's last commit, which nothing reads, is never run. In Case D a steady
chunk's interval keeps the commit (it opens the next chunk's DiT span)."""

from harness.candidates import Candidate, set_runtime

CANDIDATE = Candidate(
    id="H5b",
    name="deferred_commit",
    description="return the chunk's latent after its 4 denoising passes; its commit pass runs at the DiT's next call",
    gate="exact",
    changes="engine",
    configure=lambda cfg, arg: set_runtime(cfg, commit="deferred"),
)
