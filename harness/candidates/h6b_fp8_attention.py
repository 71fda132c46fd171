"""H6b: self- and cross-attention through FlashAttention-3's FP8 forward (``engine/fa3.py``).

Q and K are quantised after their RMSNorm and RoPE, V as it is stored, each with one scale per
head (the kernel's descales); P is e4m3 inside the kernel. ``H6b:head`` is that alone;
``H6b:smooth`` (default) first subtracts K's and V's per-channel means over the visible tokens,
two exact shifts that narrow the ranges e4m3 must hold (softmax ignores a per-query constant,
and P's rows sum to 1 so V's mean is added back in fp32). Both halve the attention's tensor-core
time on Hopper but keep e4m3's 3-bit mantissa: the gate, not the scaling, decides.
``H6b:smooth-early`` puts FP8 where its error is cheapest: the first ``FP8_STEPS`` denoise
forwards of a chunk (high noise; the later steps re-predict x0), while the last denoise step, which
makes the chunk's latent, and the commit pass, which writes the K/V later chunks read, run bf16
FA3. A ``step_start`` hook of the engine switches the backend before each forward.

Gate: threshold. On random weights attention is nearly uniform (its output is a mean of many
V rows, small next to the rounding of each), which is harder on FP8 than a trained model's
peaked attention may be — the verdict here is indicative and must be re-run with the checkpoint.
"""

from harness.candidates import Candidate, set_runtime

BACKENDS = {"head": "fa3-fp8", "smooth": "fa3-fp8-smooth", "smooth-early": "fa3-fp8-smooth"}
FP8_STEPS = 3  # forwards 0..2 of the 5 (denoise0..2) in FP8 under "smooth-early"
BF16 = "fa3"


def patch_steps(engine, arg: str):
    """Under "smooth-early", a hook that picks FP8 or bf16 FA3 per forward; otherwise nothing."""
    if arg != "smooth-early":
        return lambda: None

    def hook(event: str, info: dict) -> None:
        if event == "step_start":
            engine.attention = BACKENDS[arg] if info["step"] < FP8_STEPS else BF16

    engine.hooks.append(hook)

    def revert() -> None:
        engine.hooks.remove(hook)

    return revert


CANDIDATE = Candidate(
    id="H6b",
    name="fp8_attention",
    description="attention in FP8 e4m3 through FlashAttention-3 (per-head descales; smooth: K/V mean shifted out)",
    gate="threshold",
    needs=("cuda", "fa3"),
    conflicts=("H1b",),
    changes="engine",
    arg_choices=tuple(BACKENDS),
    default_arg="smooth",
    configure=lambda cfg, arg: set_runtime(cfg, attention=BACKENDS[arg]),
    patch_dit=patch_steps,
)
