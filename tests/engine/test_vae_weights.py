"""VAE weights (save/load, strictness), image encode, and the full-size topology on meta."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from harness.config import VaeConfig, load_preset
from harness.engine.groups import RankGroup
from harness.engine.vae import WanVAE, build_vae, load_weights, parameter_count, save_weights
from harness.engine.vae_engine import VaeEngine
from harness.errors import HarnessError

TINY = load_preset("tiny")


def test_save_load_bit_exact(tmp_path):
    src = build_vae(TINY.vae, encoder=True, decoder=True, seed=11)
    save_weights(src, tmp_path / "vae.safetensors")
    dst = build_vae(TINY.vae, encoder=True, decoder=True, seed=12)
    assert not all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))
    load_weights(dst, tmp_path)  # a directory: finds vae.safetensors
    for (k, a), (k2, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    # a decoder-only model takes the decoder half of a full file
    dec = build_vae(TINY.vae, encoder=False, decoder=True, weights=tmp_path)
    assert torch.equal(dec.decoder.conv_out.weight, src.decoder.conv_out.weight)


def test_random_init_is_keyed_by_name():
    a = build_vae(TINY.vae, encoder=True, decoder=True, seed=5)
    b = build_vae(TINY.vae, encoder=False, decoder=True, seed=5)
    for k, v in b.state_dict().items():
        assert torch.equal(v, a.state_dict()[k]), k


def test_missing_and_unexpected_keys(tmp_path):
    model = build_vae(TINY.vae, encoder=False, decoder=True, seed=0)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    missing = dict(sd)
    del missing["decoder.mid_block.attentions.0.to_qkv.weight"]
    save_file(missing, tmp_path / "missing.safetensors")
    with pytest.raises(HarnessError, match="missing 1 .*decoder.mid_block.attentions.0.to_qkv.weight"):
        load_weights(model, tmp_path / "missing.safetensors")

    extra = dict(sd, **{"decoder.up_blocks.9.resnets.0.conv1.weight": torch.zeros(1)})
    save_file(extra, tmp_path / "extra.safetensors")
    with pytest.raises(HarnessError, match="unexpected 1 .*up_blocks.9"):
        load_weights(model, tmp_path / "extra.safetensors")

    bad = dict(sd, **{"decoder.conv_out.bias": torch.zeros(4)})
    save_file(bad, tmp_path / "bad.safetensors")
    with pytest.raises(HarnessError, match="decoder.conv_out.bias has shape"):
        load_weights(model, tmp_path / "bad.safetensors")

    with pytest.raises(HarnessError, match="no VAE weights"):
        load_weights(model, tmp_path / "nowhere")


def test_encode_image_shape():
    engine = VaeEngine(TINY, group=RankGroup.single(), device=torch.device("cpu"), seed=0)
    img = np.random.default_rng(0).integers(0, 256, (TINY.video.height, TINY.video.width, 3), dtype=np.uint8)
    z = engine.encode_image(img)
    assert z.shape == (16, 1, TINY.video.latent_h, TINY.video.latent_w) and z.dtype == torch.float32
    assert torch.isfinite(z).all()
    assert torch.equal(engine.encode_image(torch.from_numpy(img)), z)
    with pytest.raises(HarnessError):
        engine.encode_image(img[:, :, :2])


def test_full_size_topology_on_meta():
    with torch.device("meta"):
        vae = WanVAE(VaeConfig())
    shapes = {k: tuple(v.shape) for k, v in vae.state_dict().items()}
    # Wan 2.1 decoder: 384-wide middle, upsamplers halving channels, 96-wide last stage
    assert shapes["decoder.conv_in.weight"] == (384, 16, 3, 3, 3)
    assert shapes["decoder.mid_block.attentions.0.to_qkv.weight"] == (1152, 384, 1, 1)
    assert shapes["decoder.up_blocks.0.upsamplers.0.time_conv.weight"] == (768, 384, 3, 1, 1)
    assert shapes["decoder.up_blocks.0.upsamplers.0.resample.1.weight"] == (192, 384, 3, 3)
    assert shapes["decoder.up_blocks.1.resnets.0.conv_shortcut.weight"] == (384, 192, 1, 1, 1)
    assert shapes["decoder.up_blocks.2.upsamplers.0.resample.1.weight"] == (96, 192, 3, 3)
    assert "decoder.up_blocks.2.upsamplers.0.time_conv.weight" not in shapes
    assert shapes["decoder.up_blocks.3.resnets.2.conv2.weight"] == (96, 96, 3, 3, 3)
    assert shapes["decoder.conv_out.weight"] == (3, 96, 3, 3, 3)
    assert shapes["encoder.down_blocks.5.time_conv.weight"] == (192, 192, 3, 1, 1)
    assert shapes["quant_conv.weight"] == (32, 32, 1, 1, 1)
    assert parameter_count(vae.decoder) + parameter_count(vae.post_quant_conv) == 73_295_603
    assert parameter_count(vae) == 126_892_531
    assert vae.decoder.num_slots == 33  # causal convs, i.e. decoder cache entries
