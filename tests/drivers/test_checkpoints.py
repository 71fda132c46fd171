"""Checkpoints named on the command line (``--dit-weights``, ``--vae-weights``, or
``engine.dit_weights``/``engine.vae_weights``): refused in one line before anything starts when
they cannot load into the configured model, and, when they can, what every rank of a served run
computes with — tiny preset on CPU, checkpoints written by the harness's own savers."""

from __future__ import annotations

import json
import os

import pytest
import torch

from harness import cli
from harness.config import load_preset, override
from harness.drivers.procwatch import children
from harness.drivers.serve_run import ServeOptions, serve
from harness.engine import vae as vae_mod
from harness.engine.checkpoint import check_checkpoints
from harness.engine.dit import build_model
from harness.engine.weights import init_weights, save_weights
from harness.errors import HarnessError

CPU = torch.device("cpu")


def _tiny(**engine):
    return override(load_preset("tiny"), parallel={"sp": 1, "vae_ranks": 1}, engine=engine,
                    runtime={"sessions": 1}, video={"chunks_per_session": 2})


def _checkpoint(root, cfg, seed: int) -> tuple[str, str]:
    """The DiT and the VAE of ``cfg`` with the random weights ``seed`` gives, saved as checkpoints."""
    dit = build_model(cfg.model, device=CPU, dtype=torch.float32)
    init_weights(dit, seed)
    dit_dir = save_weights(dit, root / f"dit{seed}").parent
    vae = vae_mod.build_vae(cfg.vae, encoder=True, decoder=True, seed=seed)
    (root / f"vae{seed}").mkdir()
    vae_mod.save_weights(vae, root / f"vae{seed}" / "vae.safetensors")
    return str(dit_dir), str(root / f"vae{seed}")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    cfg = _tiny()
    return {seed: _checkpoint(root, cfg, seed) for seed in (0, 5)} | {"root": root}


def test_a_checkpoint_of_the_configured_model_passes(ckpt):
    dit, vae = ckpt[0]
    check_checkpoints(_tiny(dit_weights=dit, vae_weights=vae))
    check_checkpoints(_tiny(vae_weights=str(ckpt[0][1]) + "/vae.safetensors"))  # the file itself


@pytest.mark.parametrize("change, why", [
    (lambda c, k: _tiny(dit_weights="/nonexistent/dit"), "engine.dit_weights: weights not found: /nonexistent/dit"),
    (lambda c, k: _tiny(vae_weights="/nonexistent/vae"), "engine.vae_weights: no VAE weights at /nonexistent/vae"),
    # a deeper model than the checkpoint's: its extra block is missing
    (lambda c, k: override(_tiny(dit_weights=k[0][0]), model={"num_layers": c.model.num_layers + 1}), "are missing 'blocks."),
    # a shallower one: the checkpoint's last block is unexpected
    (lambda c, k: override(_tiny(dit_weights=k[0][0]), model={"num_layers": c.model.num_layers - 1}), "unexpected key 'blocks."),
    (lambda c, k: override(_tiny(dit_weights=k[0][0]), model={"ffn_dim": c.model.ffn_dim * 2}), "the configured model has"),
    # the DiT's checkpoint given as the VAE's
    (lambda c, k: _tiny(vae_weights=k[0][0] + "/" + os.listdir(k[0][0])[0]), "VAE weights in"),
], ids=["dit-path", "vae-path", "dit-missing", "dit-unexpected", "dit-shape", "vae-wrong-model"])
def test_a_checkpoint_that_cannot_load_is_one_line(ckpt, change, why):
    with pytest.raises(HarnessError) as err:
        check_checkpoints(change(_tiny(), ckpt))
    assert why in str(err.value) and "\n" not in str(err.value), err.value


def test_a_decoder_only_vae_checkpoint_is_refused_for_want_of_the_encoder(ckpt, tmp_path):
    vae = vae_mod.build_vae(_tiny().vae, encoder=False, decoder=True, seed=0)
    vae_mod.save_weights(vae, tmp_path / "vae.safetensors")
    with pytest.raises(HarnessError, match=r"VAE weights in .* are missing 'encoder\."):
        check_checkpoints(_tiny(vae_weights=str(tmp_path)))


def test_the_serve_flags_refuse_a_bad_checkpoint_before_anything_starts(ckpt, tmp_path, capsys):
    out = tmp_path / "run"
    kids = set(children(os.getpid()))
    argv = ["serve", "--preset", "tiny", "--dit-weights", ckpt[0][0], "--set", "model.num_layers=7", "--out", str(out)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: DiT weights in ") and "\n" not in err, err
    assert not out.exists() and set(children(os.getpid())) <= kids


def _served_hashes(cfg, out) -> list[dict]:
    serve(cfg, ServeOptions(out=str(out), progress=False, probes=False))
    rows = [json.loads(x) for x in (out / "outputs" / "hashes.jsonl").read_text().splitlines()]
    assert rows and json.loads((out / "manifest.json").read_text())["status"] == "complete"
    return rows


def test_every_rank_serves_with_the_checkpoint(ckpt, tmp_path):
    """The seed's own weights as a checkpoint give the random-weight run bit for bit (so the loaded
    tensors are what every rank uses, not a re-initialisation); another seed's checkpoint under the
    same noise seed changes the latents (so they are loaded at all)."""
    random = _served_hashes(_tiny(), tmp_path / "random")
    same = _served_hashes(_tiny(dit_weights=ckpt[0][0], vae_weights=ckpt[0][1]), tmp_path / "same")
    other = _served_hashes(_tiny(dit_weights=ckpt[5][0], vae_weights=ckpt[5][1]), tmp_path / "other")
    assert same == random
    assert all(a["latent_sha256"] != b["latent_sha256"] for a, b in zip(random, other))
    man = json.loads((tmp_path / "other" / "manifest.json").read_text())
    assert man["config"]["engine"]["dit_weights"] == ckpt[5][0]
