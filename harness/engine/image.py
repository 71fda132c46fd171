"""The session's conditioning image: a deterministic synthetic picture, and the image condition
the DiT sees in every chunk, built as production builds it (DESIGN §2).

Production (vLLM-Omni 0.30.0, LingBot-World's stepwise sessions) runs the Wan VAE's causal
encoder over the session's pixel video: the image as the first pixel frame, then zero pixel
frames, four per later latent frame, chunk by chunk with the encoder's history carried between
chunks. So the condition after the first latent frame is not zero: it is what the encoder makes
of zero pixels after the image (for the Wan 2.1 statistics, rms ≈ 0.5 after normalisation), and it
changes while the image is still in the encoder's causal history. Once that history stops
changing (a chunk's history comes back bit-identical to the one it was given: a fixed point, as
production detects it) the last condition is reused and the encoder no longer runs. The check
reads one bool per cache slot back from the device, so until the fixed point a chunk has one
host wait after its encoder pass (production's check is the same).

The DiT rank builds only the encoder half of the VAE, once per process, and no decoder memory on
the DiT GPUs.
"""

from __future__ import annotations

import numpy as np
import torch

from torch import Tensor

from harness.config import HarnessConfig, VAE_TEMPORAL
from harness.engine.vae import CausalCache, WanVAE, build_vae, cudnn_autotuned
from harness.errors import HarnessError

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


def condition_dtype(cfg: HarnessConfig) -> torch.dtype:
    """The image condition encoder's dtype: ``runtime.condition_dtype``, or the VAE's."""
    return getattr(torch, cfg.runtime.condition_dtype or cfg.runtime.vae_dtype)


def _encoder(cfg: HarnessConfig, device: torch.device, seed: int):
    weights = cfg.engine.vae_weights or None
    dtype = condition_dtype(cfg)
    compiled = cfg.runtime.condition_compile
    key = (cfg.vae, str(device), dtype, seed, weights, compiled)
    if key not in _ENCODERS:
        model = build_vae(cfg.vae, encoder=True, decoder=False, seed=seed, weights=weights, device=device, dtype=dtype)
        if compiled:  # static shapes: the first chunks compile their few shapes (3 on an H200), in the warm-up session
            model.encoder.compile_step(dynamic=False)
        _ENCODERS[key] = model
    return _ENCODERS[key]


def image_pixels(image_uint8_hwc, device: torch.device, dtype: torch.dtype) -> Tensor:
    """(H, W, 3) uint8 RGB → (1, 3, 1, H, W) in [-1, 1], scaled as production scales a picture
    (÷ 255, then × 2 − 1)."""
    img = torch.from_numpy(np.require(image_uint8_hwc, requirements="W")).to(device)  # a wire buffer is read-only
    return (img.permute(2, 0, 1)[None, :, None].float() / 255.0 * 2.0 - 1.0).to(dtype)


def encode_image(model: WanVAE, image_uint8_hwc, device: torch.device, dtype: torch.dtype) -> Tensor:
    """(H, W, 3) uint8 RGB → (z, 1, H/8, W/8) float32 latent, one rank, no sharding."""
    with torch.inference_mode():
        return model.encode(image_pixels(image_uint8_hwc, device, dtype))[0].float()


class EncodedCondition:
    """The image-condition latents (z, F, h, w) of a session's chunks, in production's convention
    (module docstring). Chunks are asked for in order; asking again for the last one (a chunk run
    again after a failure) returns the same latents. ``whole``: a chunk's latent frames go through
    the encoder in one forward (H3c) instead of production's one a forward; ``autotune``: with cuDNN
    timing its algorithms (only where one rank encodes: each rank times its own, and ranks whose
    algorithms differ would round their conditions apart)."""

    def __init__(self, model: WanVAE, pixels: Tensor, frames_per_chunk: int, whole: bool = False, autotune: bool = False):
        if pixels.ndim != 5 or pixels.shape[:3] != (1, 3, 1):
            raise HarnessError(f"the conditioning image must be (1, 3, 1, H, W) pixels, got {tuple(pixels.shape)}")
        self.model, self.pixels, self.frames, self.whole, self.autotune = model, pixels, frames_per_chunk, whole, autotune
        self._zeros = pixels.new_zeros(1, 3, VAE_TEMPORAL, *pixels.shape[3:])
        self._cache: CausalCache = model.new_encode_cache()
        self._next = 0
        self._last: Tensor | None = None
        self.fixed_at: int | None = None  # first chunk whose condition is the fixed point
        self.encoded_chunks = 0  # chunks the encoder ran for

    def latents(self, chunk: int) -> Tensor:
        if chunk == self._next - 1 and self._last is not None:
            return self._last
        if chunk != self._next:
            raise HarnessError(f"image condition for chunk {chunk} asked after chunk {self._next - 1}: chunks come in order")
        if self.fixed_at is None:
            self._last = self._encode(chunk)
        self._next += 1
        return self._last

    def _encode(self, chunk: int) -> Tensor:
        cache = self._cache.copy()
        groups = [self.pixels if chunk == 0 and i == 0 else self._zeros for i in range(self.frames)]
        with torch.inference_mode(), cudnn_autotuned(True if self.autotune else None):
            out = self.model.encode_groups(groups, cache, whole=self.whole)[0].float()
        self.encoded_chunks += 1
        if chunk > 0 and cache.same_state(self._cache):
            self.fixed_at = chunk
        self._cache = cache
        return out


def check_picture(picture: np.ndarray, height: int, width: int) -> np.ndarray:
    """A session's conditioning picture as it arrives: (height, width, 3) uint8 RGB."""
    if picture.dtype != np.uint8 or picture.shape != (height, width, 3):
        raise HarnessError(f"the conditioning picture must be ({height}, {width}, 3) uint8 RGB, "
                           f"got {tuple(picture.shape)} {picture.dtype}")
    return picture


def _conditioning_pixels(cfg: HarnessConfig, image_seed: int, device: torch.device) -> tuple[WanVAE, Tensor]:
    img = synthetic_image(image_seed, cfg.video.height, cfg.video.width)
    return _encoder(cfg, device, cfg.runtime.seed), image_pixels(img, device, condition_dtype(cfg))


def picture_condition(cfg: HarnessConfig, picture: np.ndarray, device: torch.device) -> EncodedCondition:
    """The session's image condition, chunk by chunk, from its picture ((H, W, 3) uint8 RGB)."""
    picture = check_picture(picture, cfg.video.height, cfg.video.width)
    pixels = image_pixels(picture, device, condition_dtype(cfg))
    whole = cfg.runtime.condition_chunk
    return EncodedCondition(_encoder(cfg, device, cfg.runtime.seed), pixels, cfg.video.frames_per_chunk, whole=whole,
                            autotune=whole and cfg.parallel.sp == 1)


def conditioning_image(cfg: HarnessConfig, image_seed: int, device: torch.device) -> EncodedCondition:
    """The session's image condition, chunk by chunk, from the synthetic image of ``image_seed``."""
    return picture_condition(cfg, synthetic_image(image_seed, cfg.video.height, cfg.video.width), device)


def conditioning_image_latent(cfg: HarnessConfig, image_seed: int, device: torch.device) -> Tensor:
    """The first latent frame only (z, 1, h, w): the image encoded alone."""
    model, pixels = _conditioning_pixels(cfg, image_seed, device)
    with torch.inference_mode():
        return model.encode(pixels)[0].float()
