"""DiT weights: deterministic random init from a seed, and safetensors save/load by checkpoint name.

Random init. Every parameter gets its own CPU ``torch.Generator`` seeded from (seed, name), so the
values are the same on every rank and device, independent of init order (which lets large models
be filled from several threads), and are then cast and copied to the parameter. The scaling keeps
a 40-layer model's activations of order one through 10 chunks × 5 forwards:

* every Linear/Conv weight ~ N(0, 1/fan_in): a unit-RMS input gives a unit-RMS output, so
  embeddings, q/k/v, the FFN and the head neither blow up nor vanish; biases are zero and the
  norm weights one (q/k are RMS-normalised anyway, so attention logits stay O(1));
* the residual updates are kept small by the *gates* rather than the output projections:
  ``blocks.N.modulation`` ~ N(0, 1/dim) as in Wan (gate ≈ 0.125 at dim 64, ≈ 0.014 at 5120), and
  ``time_projection`` is scaled by 0.1, so the time-dependent part of shift/scale/gate is a few
  percent;
* the camera injection multiplies the residual stream by (1 + cam_scale) in *every* block, so its
  effect compounds with depth; ``cam_scale_layer``/``cam_shift_layer`` are scaled by 0.05, keeping
  the per-block factor within a few percent even when the ray origins have travelled a few units.

Save/load. One ``model.safetensors`` per directory on save; load reads every ``*.safetensors``
in the directory (real checkpoints are sharded), tensor by tensor, and refuses missing, unexpected,
duplicated or mis-shaped keys by name. q/k/v are stored separately under their checkpoint names.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from harness.engine.conditions import derive_seed
from harness.errors import HarnessError

WEIGHTS_FILE = "model.safetensors"

_ONES = ("norm_q.weight", "norm_k.weight", "norm3.weight")
_GAIN = {"time_projection.": 0.1, "cam_scale_layer.": 0.05, "cam_shift_layer.": 0.05}


def init_value(name: str, shape: tuple[int, ...], seed: int) -> Tensor:
    """The fp32 CPU init of parameter ``name`` (a pure function of name, shape and seed)."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if name.endswith(_ONES):
        return torch.ones(shape)
    g = torch.Generator(device="cpu").manual_seed(derive_seed("init", seed, name))
    x = torch.randn(shape, generator=g)
    if name.endswith("modulation"):
        return x.mul_(shape[-1] ** -0.5)
    gain = next((v for k, v in _GAIN.items() if k in name), 1.0)
    return x.mul_(gain / math.sqrt(math.prod(shape[1:])))


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> nn.Module:
    params = list(model.named_parameters())
    if any(p.is_meta for _, p in params):
        raise HarnessError("cannot initialise a model on the meta device; build it on a real device")

    def fill(item: tuple[str, nn.Parameter]) -> None:
        name, p = item
        p.copy_(init_value(name, tuple(p.shape), seed))

    big = sum(p.numel() for _, p in params) > 50_000_000
    if big:  # the full model is 18.5 G values; RNG is single-threaded per call, so spread the calls
        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            list(pool.map(fill, params))
    else:
        for item in params:
            fill(item)
    return model


def save_weights(model: nn.Module, directory: str | Path) -> Path:
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HarnessError(f"cannot create weights directory {directory}: {e.strerror}") from None
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
            t = t.contiguous().clone()  # q/k/v are views of the fused QKV weight: store each alone
        tensors[name] = t
    path = directory / WEIGHTS_FILE
    save_file(tensors, str(path), metadata={"format": "pt", "model": "lingbot-world-dit"})
    return path


def weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise HarnessError(f"weights not found: {path}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise HarnessError(f"no *.safetensors files in {path}")
    return files


def checkpoint_index(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """name → (file, shape) over a checkpoint's files, from their safetensors headers alone (no
    tensor data); a name in two files, or a file that cannot be read, is refused."""
    index: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                shapes = {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}
        except Exception as e:  # safetensors' own error types for truncated/corrupt headers
            raise HarnessError(f"cannot read weights file {f}: {e}") from None
        for k, shape in shapes.items():
            if k in index:
                raise HarnessError(f"weight {k!r} appears in both {index[k][0].name} and {f.name}")
            index[k] = (f, shape)
    return index


def key_mismatch(path: str | Path, names, expected) -> str | None:
    """The refusal of a checkpoint at ``path`` whose ``names`` are not the model's ``expected``
    ones (missing first, in the model's order, then unexpected), or None when they are the same."""
    missing = [k for k in expected if k not in names]
    if missing:
        return f"weights in {path} are missing {missing[0]!r}{and_more(missing)}"
    unexpected = [k for k in names if k not in expected]
    if unexpected:
        return f"weights in {path} have unexpected key {unexpected[0]!r}{and_more(unexpected)}"
    return None


def and_more(keys: list[str]) -> str:
    """`` (and N more)`` after the first of ``keys`` named in a refusal."""
    return f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""


@torch.no_grad()
def load_weights(model: nn.Module, path: str | Path) -> nn.Module:
    files = weight_files(Path(path))
    expected = model.state_dict()
    refusal = key_mismatch(path, checkpoint_index(files), expected)
    if refusal:
        raise HarnessError(refusal)
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                if tuple(t.shape) != tuple(expected[k].shape):
                    raise HarnessError(f"weight {k!r} has shape {tuple(t.shape)}, the model expects {tuple(expected[k].shape)}")
                expected[k].copy_(t)  # in place: q/k/v land in the fused QKV weight they view
    return model
