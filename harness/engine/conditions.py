"""Session conditions: the text embedding and the image condition the DiT sees besides the noise.

Text: the production stack runs UMT5 (text_len × text_dim); we have no text encoder here, so a
prompt maps to a deterministic synthetic embedding (std ≈ 1, seeded from SHA-256 of seed and
prompt) unless the caller supplies real embeddings (a tensor, or a .npy/.safetensors file).

Image condition (Wan I2V layout): y = concat(4 mask channels, 16 latent channels). The session's
first latent frame has a mask of ones, every later frame a zero mask. The latent channels are, by
default, production's: the VAE encoder run over the image and then zero pixel frames, chunk by
chunk (``harness.engine.image.EncodedCondition``), so frames after the first carry the encoding of
zero pixels, not zeros. A caller that hands a latent directly (``image_latent``: no encoder at
hand) gets it in the first frame and zero latents after; with no image at all every latent
channel is zero. Model input = concat(noisy latent 16, y 20) = 36 channels.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from safetensors.torch import load_file
from torch import Tensor

from harness.config import LATENT_CHANNELS, MASK_CHANNELS
from harness.errors import HarnessError


class ImageCondition(Protocol):
    def latents(self, chunk: int) -> Tensor:
        """The image-condition latents (16, F, h, w) of the session's chunk ``chunk`` (in order)."""
        ...


@dataclass
class SessionConditions:
    prompt: str = ""
    seed: int = 0
    image_latent: Tensor | None = None  # (16, 1, h, w): VAE-encoded first frame, zero latents after
    text_embedding: Tensor | None = None  # (≤ text_len, text_dim); None = synthetic from prompt
    #: production's image condition (image.EncodedCondition); takes the place of image_latent
    image_condition: ImageCondition | None = None


class GivenLatent:
    """A first-frame latent handed over directly: it in the session's first latent frame, zero
    latents after (no encoder is at hand to continue over zero pixels)."""

    def __init__(self, latent: Tensor, frames: int):
        self.latent, self.frames = latent, frames

    def latents(self, chunk: int) -> Tensor:
        out = self.latent.new_zeros(self.latent.shape[0], self.frames, *self.latent.shape[2:])
        if chunk == 0:
            out[:, :1] = self.latent
        return out


def session_image(cond: SessionConditions, frames: int, h: int, w: int, device: torch.device) -> ImageCondition | None:
    """The session's image condition, or None for none at all (zero latents)."""
    if cond.image_condition is not None:
        return cond.image_condition
    latent = check_image_latent(cond.image_latent, h, w)
    return None if latent is None else GivenLatent(latent.to(device, torch.float32), frames)


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any printable parts; stable across processes and Python versions."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def synthetic_text_embedding(prompt: str, seed: int, text_len: int, text_dim: int) -> Tensor:
    g = torch.Generator(device="cpu").manual_seed(derive_seed("text", seed, prompt))
    return torch.randn(text_len, text_dim, generator=g, dtype=torch.float32)


def check_text_embedding(emb: Tensor, text_len: int, text_dim: int) -> Tensor:
    """Accept (L, text_dim) or (1, L, text_dim) with L ≤ text_len; zero-pad to text_len as Wan does."""
    if not isinstance(emb, Tensor):
        raise HarnessError(f"text embedding must be a tensor, got {type(emb).__name__}")
    if emb.ndim == 3 and emb.shape[0] == 1:
        emb = emb[0]
    if emb.ndim != 2 or emb.shape[1] != text_dim or not 1 <= emb.shape[0] <= text_len:
        raise HarnessError(f"text embedding must have shape (≤{text_len}, {text_dim}), got {tuple(emb.shape)}")
    emb = emb.detach().to(device="cpu", dtype=torch.float32)
    if not torch.isfinite(emb).all():
        raise HarnessError("text embedding has non-finite values")
    if emb.shape[0] < text_len:
        emb = torch.cat([emb, emb.new_zeros(text_len - emb.shape[0], text_dim)])
    return emb


def load_text_embedding(path: str | Path, text_len: int, text_dim: int) -> Tensor:
    """From a .npy array or a .safetensors file holding one tensor (or one named 'text_embedding')."""
    path = Path(path)
    if not path.is_file():
        raise HarnessError(f"text embedding file not found: {path}")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as e:
            raise HarnessError(f"cannot read text embedding {path.name}: {e}") from None
        emb = torch.from_numpy(np.asarray(arr, dtype=np.float32))
    elif path.suffix == ".safetensors":
        try:
            tensors = load_file(str(path))
        except Exception as e:  # safetensors raises its own error types for malformed files
            raise HarnessError(f"cannot read text embedding {path.name}: {e}") from None
        if "text_embedding" in tensors:
            emb = tensors["text_embedding"]
        elif len(tensors) == 1:
            emb = next(iter(tensors.values()))
        else:
            raise HarnessError(f"{path.name} holds {len(tensors)} tensors; name the embedding 'text_embedding'")
    else:
        raise HarnessError(f"text embedding must be a .npy or .safetensors file, got {path.name}")
    return check_text_embedding(emb, text_len, text_dim)


def session_text_embedding(cond: SessionConditions, text_len: int, text_dim: int) -> Tensor:
    if cond.text_embedding is not None:
        return check_text_embedding(cond.text_embedding, text_len, text_dim)
    return synthetic_text_embedding(cond.prompt, cond.seed, text_len, text_dim)


def check_image_latent(latent: Tensor | None, h: int, w: int) -> Tensor | None:
    if latent is None:
        return None
    if not isinstance(latent, Tensor):
        raise HarnessError(f"image latent must be a tensor, got {type(latent).__name__}")
    if latent.ndim == 5 and latent.shape[0] == 1:
        latent = latent[0]
    if tuple(latent.shape) != (LATENT_CHANNELS, 1, h, w):
        raise HarnessError(f"image latent must have shape ({LATENT_CHANNELS}, 1, {h}, {w}), got {tuple(latent.shape)}")
    if not latent.is_meta and not torch.isfinite(latent).all():
        raise HarnessError("image latent has non-finite values")
    return latent


def image_condition(image: ImageCondition | None, chunk: int, frames: int, h: int, w: int,
                    *, device: torch.device, dtype: torch.dtype) -> Tensor:
    """y (20, F, h, w) for the session's chunk ``chunk`` (latent frames from chunk·F on)."""
    y = torch.zeros(MASK_CHANNELS + LATENT_CHANNELS, frames, h, w, device=device, dtype=dtype)
    if chunk == 0:
        y[:MASK_CHANNELS, 0] = 1
    if image is not None:
        lat = image.latents(chunk)
        if tuple(lat.shape) != (LATENT_CHANNELS, frames, h, w):
            raise HarnessError(f"image condition of chunk {chunk} has shape {tuple(lat.shape)}, "
                               f"expected {(LATENT_CHANNELS, frames, h, w)}")
        y[MASK_CHANNELS:] = lat.to(device=device, dtype=dtype)
    return y


def model_input(noisy: Tensor, y: Tensor) -> Tensor:
    return torch.cat([noisy.to(y.dtype), y], dim=0)
