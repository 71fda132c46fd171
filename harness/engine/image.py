"""The session's conditioning image: a deterministic synthetic picture, encoded by the Wan VAE
encoder into the (16, 1, h, w) latent that conditions latent frame 0 (DESIGN §2).

The DiT rank builds only the encoder half of the VAE, once per process, so conditioning costs
one encoder pass per session and no decoder memory on the DiT GPUs.
"""

from __future__ import annotations

import numpy as np
import torch

from harness.config import HarnessConfig
from harness.engine.vae import build_vae

_ENCODERS: dict[tuple, object] = {}


def synthetic_image(seed: int, height: int, width: int) -> np.ndarray:
    """(H, W, 3) uint8: smooth colour gradients with a seed-dependent phase, plus mild texture."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, size=3).astype(np.float32)
    freq = rng.uniform(1.0, 3.0, size=3).astype(np.float32)
    chans = [np.sin(freq[c] * (x / width + 0.5 * y / height) * np.pi + phase[c]) for c in range(3)]
    img = (np.stack(chans, -1) * 0.45 + 0.5) * 255 + rng.normal(0, 4, (height, width, 3))
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def _encoder(cfg: HarnessConfig, device: torch.device, seed: int):
    key = (cfg.vae, str(device), cfg.runtime.vae_dtype, seed)
    if key not in _ENCODERS:
        _ENCODERS[key] = build_vae(cfg.vae, encoder=True, decoder=False, seed=seed, weights=None,
                                   device=device, dtype=getattr(torch, cfg.runtime.vae_dtype))
    return _ENCODERS[key]


def encode_image(model, image_uint8_hwc, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(H, W, 3) uint8 RGB → (z, 1, H/8, W/8) float32 latent, one rank, no sharding."""
    img = torch.as_tensor(image_uint8_hwc)
    x = (img.to(device).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1.0).to(dtype)
    with torch.inference_mode():
        return model.encode(x)[0].float()


def conditioning_image_latent(cfg: HarnessConfig, image_seed: int, device: torch.device) -> torch.Tensor:
    img = synthetic_image(image_seed, cfg.video.height, cfg.video.width)
    model = _encoder(cfg, device, cfg.runtime.seed)
    return encode_image(model, img, device, getattr(torch, cfg.runtime.vae_dtype))
