"""H1b: pin the self/cross attention kernel (SDPA flash / cuDNN / efficient / math).

On Hopper, cuDNN SDPA ran the production shapes ≈ 2× faster than SDPA flash (DESIGN §12). The
argument names the backend, e.g. ``--candidate H1b:cudnn``; an unavailable backend fails in the
worker with the kernel's own refusal rather than silently falling back. ``H1b:fa3`` is
FlashAttention-3's bf16 forward (``engine/fa3.py``), refused before launch without its wheel or a
Hopper GPU."""

from harness.candidates import Candidate, set_runtime

CANDIDATE = Candidate(
    id="H1b",
    name="sdpa_backend",
    description="choose the self/cross attention kernel (flash, cudnn, efficient, math, fa3)",
    gate="threshold",
    changes="engine",
    arg_choices=("flash", "cudnn", "efficient", "math", "fa3"),
    default_arg="cudnn",
    # PyTorch has no CPU kernel for these two; on CPU they fail inside the worker after launch.
    arg_needs={"cudnn": ("cuda",), "efficient": ("cuda",), "fa3": ("cuda", "fa3")},
    configure=lambda cfg, arg: set_runtime(cfg, attention=arg),
)
