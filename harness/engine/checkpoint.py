"""The checkpoints a config names (``engine.dit_weights``, ``engine.vae_weights``), checked in
the driver before anything is allocated or started.

Each rank loads its weights itself (``weights.load_weights`` for the DiT, ``vae.load_weights``
for the VAE, strictly, by name); a wrong path or a checkpoint of another shape would otherwise
surface a minute later as a rank's traceback. The check here reads only the safetensors headers
— names and shapes, no tensor data, so it costs milliseconds on a 40 GB checkpoint — and compares
them with the model the config builds on the meta device, by the loaders' own rules: every key the
model has, nothing else, each of its shape. The VAE's checkpoint must hold the encoder and the
decoder (the condition image is encoded, the chunks decoded).
"""

from __future__ import annotations

from pathlib import Path

from harness.config import HarnessConfig
from harness.errors import HarnessError


def check_checkpoints(cfg: HarnessConfig) -> None:
    """One-line HarnessError for a named checkpoint that cannot be loaded into the configured model."""
    rt = cfg.engine
    if not (rt.dit_weights or rt.vae_weights):
        return
    # only now: the command line is parsed, and every run without a checkpoint checked, without torch
    import torch
    from harness.engine.dit import build_model
    from harness.engine.vae import build_vae, find_weights
    from harness.engine.weights import weight_files

    if rt.dit_weights:
        try:
            files = weight_files(Path(rt.dit_weights))
        except HarnessError as e:
            raise HarnessError(f"engine.dit_weights: {e}") from None
        expected = _shapes(build_model(cfg.model, device=torch.device("meta"), dtype=torch.bfloat16))
        _compare("DiT", rt.dit_weights, _header(files), expected)
    if rt.vae_weights:
        path = Path(rt.vae_weights)
        if not path.exists():
            raise HarnessError(f"engine.vae_weights: no VAE weights at {path}")
        file = find_weights(path) if path.is_dir() else path
        expected = _shapes(build_vae(cfg.vae, encoder=True, decoder=True, device="meta"))
        _compare("VAE", rt.vae_weights, _header([file]), expected)


def _shapes(model) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _header(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """name → shape over ``files``, from their headers alone; a name in two files is refused."""
    from safetensors import safe_open  # with torch: only once a checkpoint is named

    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                for k in h.keys():
                    if k in out:
                        raise HarnessError(f"weight {k!r} appears twice in {f.parent} (again in {f.name})")
                    out[k] = tuple(h.get_slice(k).get_shape())
        except HarnessError:
            raise
        except Exception as e:  # safetensors' own error types for a truncated or corrupt header
            raise HarnessError(f"cannot read weights file {f}: {e}") from None
    return out


def _compare(what: str, where: str, got: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    missing = sorted(expected.keys() - got.keys())
    if missing:
        raise HarnessError(f"{what} weights in {where} are missing {missing[0]!r}{_more(missing)} for the configured model")
    unexpected = sorted(got.keys() - expected.keys())
    if unexpected:
        raise HarnessError(f"{what} weights in {where} have unexpected key {unexpected[0]!r}{_more(unexpected)}")
    wrong = sorted(k for k in expected if got[k] != expected[k])
    if wrong:
        k = wrong[0]
        raise HarnessError(f"{what} weights in {where}: {k!r} is {list(got[k])}, the configured model has "
                           f"{list(expected[k])}{_more(wrong)}")


def _more(keys: list[str]) -> str:
    return f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
