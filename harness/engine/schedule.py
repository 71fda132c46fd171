"""DMD few-step schedule for the chunk loop: shifted sigmas, model timesteps, x0 prediction, re-noise.

Flow matching with a shift: a nominal timestep t ∈ [0, 1000] gives s = t / 1000, which the shift
warps to σ = shift·s / (1 + (shift − 1)·s) (more of the budget near pure noise). The model is fed
σ·1000 and predicts a velocity v ≈ ε − x0, so x0 = x_t − σ·v; the next step re-noises x0 to the
next σ with fresh noise. The 5th "commit" pass runs at t = 0 on the clean x0.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from harness.config import ScheduleConfig

COMMIT_TIMESTEP = 0.0


def shift_sigma(s: float, shift: float) -> float:
    return shift * s / (1.0 + (shift - 1.0) * s)


def sigmas(sched: ScheduleConfig) -> list[float]:
    """σ for each denoising step, e.g. (1000, 750, 500, 250), shift 5 → 1.0, 0.9375, 0.8333, 0.625."""
    return [shift_sigma(t / sched.num_train_timesteps, sched.flow_shift) for t in sched.timesteps]


def model_timesteps(sched: ScheduleConfig) -> list[float]:
    """What the model's time embedding sees: σ·num_train_timesteps per denoise step, then the commit 0.

    Each value is rounded to float32 as production hands it to the model (a float32 tensor,
    widened to float64 only inside the sinusoidal embedding): 833.333… enters as 833.33331.
    """
    return [float(np.float32(s * sched.num_train_timesteps)) for s in sigmas(sched)] + [COMMIT_TIMESTEP]


def phases(sched: ScheduleConfig) -> list[str]:
    return [f"denoise{i}" for i in range(len(sched.timesteps))] + ["commit"]


def predict_x0(x_t: Tensor, v: Tensor, sigma: float) -> Tensor:
    return x_t - sigma * v


def renoise(x0: Tensor, noise: Tensor, sigma_next: float) -> Tensor:
    return (1.0 - sigma_next) * x0 + sigma_next * noise
