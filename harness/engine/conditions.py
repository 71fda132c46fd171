"""Session conditions: the text embedding and the image condition the DiT sees besides the noise.

Text: the production stack runs UMT5 (text_len × text_dim); we have no text encoder here, so a
prompt maps to a deterministic synthetic embedding (std ≈ 1, seeded from SHA-256 of seed and
prompt) unless the caller supplies real embeddings (a tensor, or a .npy/.safetensors file).

Image condition (Wan I2V layout): y = concat(4 mask channels, 16 latent channels). The session's
first latent frame carries the VAE-encoded first image and a mask of ones; every later frame has a
zero mask and a zero latent. Model input = concat(noisy latent 16, y 20) = 36 channels.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import Tensor

from harness.config import LATENT_CHANNELS, MASK_CHANNELS
from harness.errors import HarnessError


@dataclass
class SessionConditions:
    prompt: str = ""
    seed: int = 0
    image_latent: Tensor | None = None  # (16, 1, h, w): VAE-encoded first frame; None = zeros
    text_embedding: Tensor | None = None  # (≤ text_len, text_dim); None = synthetic from prompt


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


def image_condition(image_latent: Tensor | None, first_frame: int, frames: int, h: int, w: int,
                    *, device: torch.device, dtype: torch.dtype) -> Tensor:
    """y (20, F, h, w) for the latent frames [first_frame, first_frame + frames) of a session."""
    y = torch.zeros(MASK_CHANNELS + LATENT_CHANNELS, frames, h, w, device=device, dtype=dtype)
    if first_frame == 0:
        y[:MASK_CHANNELS, 0] = 1
        if image_latent is not None:
            y[MASK_CHANNELS:, 0] = image_latent[:, 0].to(device=device, dtype=dtype)
    return y


def model_input(noisy: Tensor, y: Tensor) -> Tensor:
    return torch.cat([noisy.to(y.dtype), y], dim=0)
