"""Where the VAE decode's time goes: the same latents decoded under layout and algorithm choices.

    python -m harness gpu-checks vae-layout [--chunks 6] [--json F]

One VAE engine at the full 480×832 preset (random weights, fixed seed) decodes one session of
``chunks`` chunks per variant, with the same latents every time. A variant is a set of knobs
that change how the convolutions run, not what they compute:

* ``benchmark`` — cuDNN times its algorithms per shape and keeps the fastest
  (``torch.backends.cudnn.benchmark``; the workers leave it off, PyTorch's default);
* ``chunk`` — the chunk's latent frames go through the decoder in one step instead of one frame
  a step (``WanVAE.decode(frames_per_step=0)``: a longer time axis per convolution);
* ``cl3d`` — weights and activations in ``channels_last_3d`` (NDHWC, the layout cuDNN's
  tensor-core kernels read without a transpose);
* ``bf16`` — the decoder's weights and activations in bf16 (what ``H3b`` makes a candidate);
* ``fp16chunk`` — ``H3b:fp16-chunk``: fp16, whole-chunk steps, cuDNN autotuning (the engine's own
  ``decode_in``);
* ``compile`` — ``H3a``: the decoder's step through ``torch.compile`` (inductor's default mode),
  which fuses the norms, SiLUs, padding and concatenations around the convolutions.

Each variant reports its steady decode (median over chunks ≥ 2: the first chunk is the
session's short one, the second pays cuDNN's autotuning), its TF32 MFU against the FLOPs of the
meta-device count, and its pixels against the reference variant's (RMSE, max|Δ|, PSNR on uint8
frames): the gate a candidate built on a variant would face.
"""

from __future__ import annotations

import functools
import statistics
import time

import numpy as np
import torch

from harness.candidates.h3c_condition_fp16 import MODES as CONDITION_MODES
from harness.config import load_preset, override
from harness.engine.convert import to_uint8
from harness.engine.groups import RankGroup
from harness.engine.image import conditioning_image
from harness.engine.vae_engine import VaeEngine
from harness.experiments.bench_engine import _sync, count_steady_flops, measure_peak_tflops, timed_decode
from harness.errors import HarnessError
from harness.measure.gates import pixel_metrics, pixel_passes, psnr_db

PRESET = "lingbot-480x832"
#: name → knobs; "reference" is what the harness runs today
VARIANTS: dict[str, tuple[str, ...]] = {
    "reference": (),
    "benchmark": ("benchmark",),
    "chunk": ("chunk",),
    "cl3d": ("cl3d",),
    "benchmark+chunk": ("benchmark", "chunk"),
    "benchmark+cl3d": ("benchmark", "cl3d"),
    "benchmark+chunk+cl3d": ("benchmark", "chunk", "cl3d"),
    "bf16": ("bf16",),
    "bf16+benchmark+chunk": ("bf16", "benchmark", "chunk"),
    "bf16+benchmark+chunk+cl3d": ("bf16", "benchmark", "chunk", "cl3d"),
    "compile": ("compile",),
    "compile+chunk": ("compile", "chunk"),
    "fp16chunk": ("fp16chunk",),
    "fp16chunk+compile": ("fp16chunk", "compile"),
}


def _engine(preset: str, device: torch.device, knobs: tuple[str, ...]) -> VaeEngine:
    cfg = override(load_preset(preset), parallel={"sp": 1, "vae_ranks": 1},
                   runtime={"vae_dtype": "bfloat16" if "bf16" in knobs else "float32"})
    eng = VaeEngine(cfg, group=RankGroup.single(), device=device, seed=0)
    if "cl3d" in knobs:
        for m in eng.model.modules():  # Module.to(memory_format=) would also try the 1-D parameters
            if isinstance(m, torch.nn.Conv3d):
                m.weight.data = m.weight.data.contiguous(memory_format=torch.channels_last_3d)
    if "chunk" in knobs:
        eng.model.decode = functools.partial(eng.model.decode, frames_per_step=0)
    if "fp16chunk" in knobs:
        eng.decode_in(torch.float16, frames_per_step=0, autotune=True)
    if "compile" in knobs:
        eng.compile_decoder()
    return eng


def _session(eng: VaeEngine, latents: list[torch.Tensor], channels_last: bool) -> tuple[list[np.ndarray], list[float]]:
    inputs = (lat.contiguous(memory_format=torch.channels_last_3d)[0] if channels_last else lat[0] for lat in latents)
    times, pix = timed_decode(eng, inputs, lambda f: to_uint8(f).cpu().numpy())
    return pix, times


def check_vae_layout(chunks: int = 6, variants: tuple[str, ...] = tuple(VARIANTS), *, preset: str = PRESET,
                     device: str = "cuda") -> dict:
    """Every variant's steady decode, MFU and pixels against the first variant's (see the module)."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise HarnessError(f"unknown vae-layout variant {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    dev = torch.device(device)
    cfg = load_preset(preset)
    shape = (1, cfg.vae.z_dim, cfg.video.frames_per_chunk, cfg.video.latent_h, cfg.video.latent_w)
    g = torch.Generator(device=dev).manual_seed(1)
    latents = [torch.randn(shape, generator=g, device=dev) for _ in range(chunks)]
    flops = count_steady_flops(override(cfg, parallel={"sp": 1, "vae_ranks": 1}))["vae_conv_flops"]
    tf32 = None
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        tf32 = measure_peak_tflops(dev, torch.float32)
    out: dict = {"preset": preset, "chunks": chunks, "vae_conv_flops": flops,
                 "peak_tf32_tflops": tf32 and round(tf32, 1), "variants": {}}
    ref = None
    for name in variants:
        knobs = VARIANTS[name]
        torch.backends.cudnn.benchmark = "benchmark" in knobs
        eng = _engine(preset, dev, knobs)
        pix, times = _session(eng, latents, "cl3d" in knobs)
        steady = statistics.median(times[2:] or times)
        row = {"chunk_ms": [round(t, 1) for t in times], "steady_ms": round(steady, 1),
               "tf32_mfu": tf32 and round(flops / (steady / 1e3) / 1e12 / tf32, 4)}
        if ref is None:
            ref = pix
        else:
            ms = [pixel_metrics(a, b) for a, b in zip(ref, pix)]
            worst = max(ms, key=lambda m: m["rmse"])
            psnr = psnr_db(worst["rmse"])  # None: identical frames
            row.update(worst_rmse=round(worst["rmse"], 5), worst_max_abs=round(max(m["max_abs"] for m in ms), 5),
                       psnr_db=None if psnr is None else round(psnr, 2),
                       exact=all(np.array_equal(a, b) for a, b in zip(ref, pix)),
                       gate_pass=all(not pixel_passes(m) for m in ms))
        out["variants"][name] = row
        del eng
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    torch.backends.cudnn.benchmark = False
    base = out["variants"][variants[0]]["steady_ms"]
    for row in out["variants"].values():
        row["ratio"] = round(row["steady_ms"] / base, 3)
    return out


def check_condition(chunks: int = 12, *, preset: str = PRESET, device: str = "cuda",
                    modes: tuple[str, ...] = ("", "fp16", "fp16-chunk", "bf16-chunk")) -> dict:
    """The image condition's encoder passes in the DiT stage (engine/image.py), per encoder mode
    ("": the preset's fp32, production's schedule; the others H3c's): each chunk's encode time
    until the fixed point, the chunk it was found at (None: not within ``chunks``), and each
    chunk's condition latents against the fp32 ones (relative L2, max|Δ|). A ``-chunk`` mode's
    chunks 0 and 1 include cuDNN's autotuning (two shapes); its steady chunks are 2 on."""
    unknown = [m for m in modes if m and m not in CONDITION_MODES]
    if unknown:
        raise HarnessError(f"unknown condition mode {', '.join(unknown)} (known: {', '.join(CONDITION_MODES)})")
    dev = torch.device(device)
    out, ref = {"preset": preset, "chunks": chunks, "modes": {}}, []
    modes = ("", *(m for m in modes if m))  # fp32 first: the reference of every other mode
    for mode in modes:
        dtype, whole, compiled = CONDITION_MODES[mode] if mode else ("", False, False)
        cfg = override(load_preset(preset), runtime={"condition_dtype": dtype, "condition_chunk": whole,
                                                     "condition_compile": compiled})
        cond = conditioning_image(cfg, 1, dev)
        times, lats = [], []
        for k in range(chunks):
            _sync(dev)
            t0 = time.perf_counter()
            lats.append(cond.latents(k).float())
            _sync(dev)
            times.append(round((time.perf_counter() - t0) * 1e3, 1))
        ref = ref or lats
        row = {"chunk_ms": times, "fixed_at": cond.fixed_at, "encoded_chunks": cond.encoded_chunks}
        if mode:
            row["rel_l2"] = [float((a - b).norm() / b.norm()) for a, b in zip(lats, ref)]
            row["max_abs"] = [float((a - b).abs().max()) for a, b in zip(lats, ref)]
        out["modes"][mode or "fp32"] = row
    return out
