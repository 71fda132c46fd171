"""FlashAttention-3 entries of the replay matrix, and an FP8 attention emulation to tell which
rounding costs the accuracy.

Kernels (need the ``fa3-fwd`` wheel and a Hopper GPU, otherwise an ``Unsupported`` row with the
reason): ``fa3`` (bf16), ``fa3-fp8`` (per-head descales), ``fa3-fp8-smooth`` (K/V means shifted
out first) — the engine's own dense functions (``engine.fa3``) on the input's (1, H, S, D) views,
so a row here is the kernel ``H1b:fa3`` / ``H6b:head`` / ``H6b:smooth`` put into the model.

Emulations (``emu-fp8-<parts>``, any device; not kernels, their times mean nothing): attention in
fp32 with e4m3 rounding applied only to ``parts`` of q, k, v, p (per-head scales like the kernel;
P rounded after the row max is subtracted, the row sum kept in fp32, as FA3 does). Against the
same FP64 reference they answer "what if Q/K stayed bf16" or "what does P's rounding alone cost"
— choices the FA3 kernel (one dtype for Q, K and V) cannot run.

H6f's FP8 attention (any device for the emulation, CUDA for the kernel): ``fp8-<mode>`` is its
Triton kernel (``engine/fused_fp8_attention``) and ``fp8-<mode>-emulated`` the same rounding
through PyTorch ops (``engine/fp8_fine``), both the engine's own dense backends: against the FP64
reference the pair tells the kernel's error from the placement's, and the kernel's time beside
``fa3``'s is what the placement buys.

``register`` adds these rows to the registry of ``op_backends`` (which does not import this module);
``runner.load_backends`` calls it.
"""

from __future__ import annotations

import torch

from harness.engine import attention, fp8_fine
from harness.engine.fa3 import FP8, quantize_heads
from harness.experiments.replay.op_backends import Prepared, Unsupported, attn_views, register_backend

EMULATIONS = ("v", "qk", "p", "qkv", "qkvp")


def emulate_fp8_attention(q, k, v, parts: str, smoothed: bool = False, heads_per_step: int = 4):
    """(1, H, S, D) → (1, H, Sq, D) fp32: attention with e4m3 rounding of ``parts`` ⊆ "qkvp"."""
    def rt(x, part, shift=False):  # one of q, k, v (token-major) through e4m3, per-head scales
        if part not in parts:  # the shifts are exact: they matter only where e4m3 rounds
            return x.float(), None
        x8, s, m = quantize_heads(x, smoothed and shift)
        return x8.float() * s[None, :, None], m

    (qs, _), (ks, _), (vs, vm) = (rt(x[0].transpose(0, 1), n, n != "q") for x, n in ((q, "q"), (k, "k"), (v, "v")))
    scale = q.shape[-1] ** -0.5
    out = torch.empty(q.shape[1], q.shape[2], q.shape[3], dtype=torch.float32, device=q.device)
    for h0 in range(0, q.shape[1], heads_per_step):  # bounds the fp32 score matrix
        hs = slice(h0, h0 + heads_per_step)
        s = torch.einsum("qhd,khd->hqk", qs[:, hs], ks[:, hs]) * scale
        p = torch.exp(s - s.amax(-1, keepdim=True))
        rowsum = p.sum(-1, keepdim=True)
        if "p" in parts:
            p = p.to(FP8).float()
        out[hs] = torch.einsum("hqk,khd->hqd", p, vs[:, hs]) / rowsum
    if vm is not None:
        out += vm[:, None, :]
    return out.unsqueeze(0)


def _emulation(parts: str, smoothed: bool):
    def make(case, t: dict, device) -> Prepared:
        a = attn_views(case, t)
        return Prepared(lambda: emulate_fp8_attention(a["q"], a["k"], a["v"], parts, smoothed))

    return make


def _engine_dense(name: str, bf16_only: bool):
    """A row that runs the engine's dense backend ``name`` on the input's (1, H, S, D) views."""
    def make(case, t: dict, device) -> Prepared:
        why = attention.unavailable_reason(name, device)
        if why is not None:
            raise Unsupported(why)
        if bf16_only and case.dtype != "bfloat16":
            raise Unsupported(f"the kernel {name} is built for bf16 inputs only, input is {case.dtype}")
        a = attn_views(case, t)
        fn = attention.dense(name)
        return Prepared(lambda: fn(a["q"], a["k"], a["v"]))

    return make


def register() -> None:
    """The FA3 kernels and the emulations into the replay's registry (again: replaces them)."""
    for name in ("fa3", "fa3-fp8", "fa3-fp8-smooth"):
        register_backend("attention", name, _engine_dense(name, True), needs=("cuda",), default="cuda",
                         description=f"FlashAttention-3 forward, engine backend {name!r}", h1b="fa3" if name == "fa3" else None,
                         model_gated=name != "fa3")
    for parts in EMULATIONS:
        for smoothed in (False, True):
            name = f"emu-fp8-{parts}" + ("-smooth" if smoothed else "")
            register_backend("attention", name, _emulation(parts, smoothed), default=False,
                             description=f"fp32 emulation, e4m3 rounding of {', '.join(parts)}"
                                         + (" after K/V mean shift" if smoothed else "") + " (times meaningless)")
    for mode in fp8_fine.MODES:
        name = fp8_fine.kernel_name(mode)
        register_backend("attention", name, _engine_dense(name, True), needs=("cuda",), default="cuda",
                         description=f"H6f's FP8 attention kernel ({mode}), engine backend {name!r}", model_gated=True)
        name = fp8_fine.backend_name(mode)
        register_backend("attention", name, _engine_dense(name, False), default=False,
                         description=f"H6f's FP8 rounding ({mode}) through PyTorch ops (times meaningless)", model_gated=True)
