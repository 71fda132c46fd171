"""H5a: Case E scheduling — DiT(i+1) starts as soon as DiT(i) returned its latent, while the VAE
decodes chunk i (at most ``max_pending_decodes`` in flight). Only timing may change: the gate is
exact, the outputs must be byte-identical to Case D."""

from harness.candidates import Candidate, set_runtime

CANDIDATE = Candidate(
    id="H5a",
    name="decode_overlap",
    description="Case E scheduling: decode chunk i while the DiT runs chunk i+1",
    gate="exact",
    changes="scheduler",
    configure=lambda cfg, arg: set_runtime(cfg, scheduler="case-e"),
)
