"""H1b: pin the self/cross attention kernel (SDPA flash / cuDNN / efficient / math).

On Hopper, cuDNN SDPA ran the production shapes ≈ 2× faster than SDPA flash (DESIGN §12). The
argument names the backend, e.g. ``--candidate H1b:cudnn``; an unavailable backend fails in the
worker with the kernel's own refusal rather than silently falling back."""

from harness.candidates import Candidate, set_runtime

CANDIDATE = Candidate(
    id="H1b",
    name="sdpa_backend",
    description="choose the self/cross attention kernel (flash, cudnn, efficient, math)",
    gate="threshold",
    changes="engine",
    arg_choices=("flash", "cudnn", "efficient", "math"),
    default_arg="cudnn",
    # PyTorch has no CPU kernel for these two; on CPU they fail inside the worker after launch.
    arg_needs={"cudnn": ("cuda",), "efficient": ("cuda",)},
    configure=lambda cfg, arg: set_runtime(cfg, attention=arg),
)
