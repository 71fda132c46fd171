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
        _compare("DiT", rt.dit_weights, files, build_model(cfg.model, device=torch.device("meta"), dtype=torch.bfloat16))
    if rt.vae_weights:
        path = Path(rt.vae_weights)
        if not path.exists():
            raise HarnessError(f"engine.vae_weights: no VAE weights at {path}")
        file = find_weights(path) if path.is_dir() else path
        _compare("VAE", rt.vae_weights, [file], build_vae(cfg.vae, encoder=True, decoder=True, device="meta"))


def _compare(what: str, where: str, files: list[Path], model) -> None:
    """The loader's rules (``weights.key_mismatch``: every key the model has, nothing else), then
    each key's shape, on the headers of ``files`` against ``model`` built on the meta device."""
    from harness.engine.weights import and_more, checkpoint_index, key_mismatch  # torch with it, as above

    index = checkpoint_index(files)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    refusal = key_mismatch(where, index, expected)
    if refusal:
        raise HarnessError(f"{what} {refusal}")
    wrong = [k for k in expected if index[k][1] != expected[k]]
    if wrong:
        k = wrong[0]
        raise HarnessError(f"{what} weights in {where}: {k!r} is {list(index[k][1])}, the configured model has "
                           f"{list(expected[k])}{and_more(wrong)}")
