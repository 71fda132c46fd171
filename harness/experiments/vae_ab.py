"""``ab-engine`` for a VAE candidate (H3a, H3b): the decode alone, A and B sessions alternating in
one ``VaeEngine`` per launch, the candidate's patch applied for each B session and reverted after.

Every pair decodes the same random latents (seeded by the pair), so B's frames are compared with
A's frames of identical inputs: the pixel gate of DESIGN §5 on the float frames (RMSE ≤ 0.01 —
PSNR ≥ 46 dB on [−1, 1] — and max|Δ| ≤ 0.03; exact: bit-identical), with the worst PSNR and
max|Δ| reported. Timings are per-chunk decode milliseconds, the device synchronised around each;
a session's first chunk (the eager "Rep" frame) is left out of the steady figure. One unmeasured
session per arm first (cuDNN's algorithm choice, H3a's compilation). The verdict is
``ab_engine``'s: launches are the unit, a failed gate gives no verdict.
"""

from __future__ import annotations


import numpy as np
import torch

from harness import candidates as C
from harness.config import HarnessConfig
from harness.engine.groups import RankGroup, run_ranks
from harness.engine.vae_engine import VaeEngine
from harness.experiments.bench_engine import _device_for, timed_decode
from harness.measure.gates import frame_metrics, pixel_passes, psnr_db

#: chunk index from which a decode session is steady (chunk 0 is the session's eager first frame)
STEADY = 1


def vae_only(resolved: list[tuple[C.Candidate, str]]) -> bool:
    """Whether every candidate (as ``candidates.resolve`` returned them) patches the VAE and
    nothing else (these take this path)."""
    return bool(resolved) and all(c.patch_vae and not (c.patch_dit or c.patch_output or c.configure)
                                  for c, _ in resolved)


def _session(eng: VaeEngine, seed: int, chunks: int) -> tuple[list[float], list[np.ndarray]]:
    g = torch.Generator().manual_seed(seed)
    shape = (eng.model.z_dim, eng.cfg.video.frames_per_chunk, eng.latent_h, eng.latent_w)
    return timed_decode(eng, (torch.randn(shape, generator=g) for _ in range(chunks)), lambda out: out.cpu().numpy())


def _rank(group: RankGroup, cfg: HarnessConfig, chosen: tuple[C.Chosen, ...], order: list[str], chunks: int) -> dict:
    device = _device_for(cfg, group.rank)
    eng = VaeEngine(cfg, group=group, device=device, seed=cfg.runtime.seed)

    def session(arm: str, seed: int) -> tuple[list[float], list[np.ndarray]]:
        patches = C.EnginePatches(chosen if arm == "B" else ())
        patches.apply(vae=eng)
        try:
            return _session(eng, seed, chunks)
        finally:
            patches.revert()

    for arm in ("A", "B"):
        session(arm, 10_000)
    out: dict = {"A": [], "B": [], "frames": {"A": [], "B": []}, "order": order}
    for i, arm in enumerate(order):
        times, frames = session(arm, seed=i // 2)
        out[arm].append(times)
        out["frames"][arm].append(frames)
    return out


def gate_frames(kind: str, a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> dict:
    """The candidate's gate over every chunk of every pair of sessions (float frames on [−1, 1])."""
    failed, worst_rmse, worst_max = [], 0.0, 0.0
    for p, (sa, sb) in enumerate(zip(a, b)):
        for c, (xa, xb) in enumerate(zip(sa, sb)):
            m = frame_metrics(xa, xb)
            bad = not np.array_equal(xa, xb) if kind == "exact" else bool(pixel_passes(m))
            if not m["nonfinite"]:
                worst_rmse, worst_max = max(worst_rmse, m["rmse"]), max(worst_max, m["max_abs"])
            if bad or m["nonfinite"]:
                failed.append(f"pair {p} chunk {c}")
    n = sum(len(s) for s in a)
    return {"kind": kind, "passed": not failed and n > 0, "compared": n, "failed": failed[:10],
            "worst_rmse": worst_rmse, "min_psnr_db": psnr_db(worst_rmse), "worst_max_abs": worst_max}


def run_launches(cfg: HarnessConfig, chosen: tuple[C.Chosen, ...], order: list[str], chunks: int, launches: int) -> list[dict]:
    """Each launch a fresh process group of ``vae_ranks`` ranks; rank 0's timings and frames."""
    backend = "nccl" if cfg.runtime.device == "cuda" else "gloo"
    return [run_ranks(_rank, cfg.parallel.vae_ranks, cfg, chosen, order, chunks, backend=backend, timeout_s=3600)[0]
            for _ in range(launches)]
