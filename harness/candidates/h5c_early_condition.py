"""H5c: a session's first image condition is encoded as the session starts, not inside chunk 0's
DiT (``runtime.condition_start = "session"``, engine/dit_engine.py).

Why: a first chunk's DiT begins with the image condition's VAE encoder pass (≈ 125 ms with
``H3c:fp16-chunk`` on an H200 at 480×832), and before it the DiT rank spends its session start on
the host — the text conditions, the session's noise and KV blocks — while the device idles. The
encoder pass needs only the session's picture, so ``start_session`` launches it first and makes
the text after: the host's part of the setup runs under the device's encode instead of before it.
The same passes run in the same order on the device's stream, so every value is the same (exact
gate). What moves is where chunk 0's encode is counted: in the setup (session start →
``dit_start``), not in chunk 0's DiT span (DESIGN §4)."""

from harness.candidates import Candidate, set_runtime

CANDIDATE = Candidate(
    id="H5c",
    name="early_condition",
    description="encode a session's first image condition as the session starts, while the host makes its text conditions",
    gate="exact",
    changes="engine",
    configure=lambda cfg, arg: set_runtime(cfg, condition_start="session"),
)
