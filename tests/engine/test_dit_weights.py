"""DiT weights: checkpoint names, fused QKV, save/load round trip, clear key errors, meta build."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.config import load_preset, override
from harness.engine.conditions import SessionConditions
from harness.engine.dit import FULL_SIZE_PARAMETERS, build_model, parameter_count
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup
from harness.engine.weights import WEIGHTS_FILE, init_value, init_weights, load_weights, save_weights
from harness.errors import HarnessError

CPU = torch.device("cpu")

#: DESIGN §2 checkpoint names (block 0 stands for every block).
NAMES = [
    "patch_embedding.weight", "patch_embedding_wancamctrl.weight", "c2ws_hidden_states_layer1.weight",
    "c2ws_hidden_states_layer2.weight", "text_embedding.0.weight", "text_embedding.2.weight",
    "time_embedding.0.weight", "time_embedding.2.weight", "time_projection.1.weight",
    *[f"blocks.0.{a}.{p}.weight" for a in ("self_attn", "cross_attn") for p in ("q", "k", "v", "o", "norm_q", "norm_k")],
    "blocks.0.norm3.weight", "blocks.0.norm3.bias", "blocks.0.ffn.0.weight", "blocks.0.ffn.2.weight", "blocks.0.modulation",
    "blocks.0.cam_injector_layer1.weight", "blocks.0.cam_injector_layer2.weight", "blocks.0.cam_scale_layer.weight",
    "blocks.0.cam_shift_layer.weight", "head.head.weight", "head.modulation",
]


@pytest.fixture(scope="module")
def cfg():
    return override(load_preset("tiny"), parallel={"sp": 1})


def _chunks(eng: DitEngine, n: int = 2) -> list[torch.Tensor]:
    s = eng.start_session(SessionConditions(prompt="weights", seed=4))
    out = [eng.generate_chunk(s, ["W", "J", ""]) for _ in range(n)]
    eng.end_session(s)
    return out


@pytest.mark.parametrize("preset", ["lingbot-480x832", "lingbot-704x1280"])
def test_full_size_on_meta(preset):
    cfg = load_preset(preset)
    model = build_model(cfg.model, device=torch.device("meta"), dtype=torch.bfloat16)
    assert parameter_count(model) == FULL_SIZE_PARAMETERS == 18_544_332_864
    sd = model.state_dict()
    assert len(sd) == 1421 and all(n in sd for n in NAMES)
    m = cfg.model
    assert sd["patch_embedding.weight"].shape == (5120, 36, 1, 2, 2)
    assert sd["patch_embedding_wancamctrl.weight"].shape == (5120, 384 * 4)
    assert sd["time_projection.1.weight"].shape == (6 * 5120, 5120)
    assert sd["blocks.39.ffn.0.weight"].shape == (m.ffn_dim, m.dim)
    assert sd["blocks.0.modulation"].shape == (1, 6, 5120) and sd["head.modulation"].shape == (1, 2, 5120)
    assert sd["head.head.weight"].shape == (64, 5120)
    # the whole engine builds on meta too (KV pools included), with no memory
    eng = DitEngine(override(cfg, parallel={"sp": 4}), group=RankGroup(0, 4, None), device=torch.device("meta"))
    assert eng.cache.k[0].is_meta and eng.kv_stats()["blocks_total"] == 18 * cfg.tokens_per_frame // cfg.block_size


def test_meta_engine_runs_a_chunk(cfg):
    eng = DitEngine(cfg, group=RankGroup.single(), device=torch.device("meta"))
    s = eng.start_session(SessionConditions(prompt="meta"))
    out = eng.generate_chunk(s, ["", "", ""])
    assert out.is_meta and out.shape == (16, 3, cfg.video.latent_h, cfg.video.latent_w)
    eng.end_session(s)


def test_fused_qkv_shares_storage(cfg):
    model = init_weights(build_model(cfg.model, device=CPU, dtype=torch.float32), seed=0)
    attn = model.blocks[0].self_attn
    dim = cfg.model.dim
    assert attn._qkv_w.shape == (3 * dim, dim)
    for i, lin in enumerate((attn.q, attn.k, attn.v)):
        assert lin.weight.data_ptr() == attn._qkv_w[i * dim].data_ptr()
    assert parameter_count(model) == sum(t.numel() for t in model.state_dict().values())
    model.double()
    with pytest.raises(HarnessError, match="fuse_qkv_"):
        attn.forward(torch.zeros(2, dim, dtype=torch.float64), None)


def test_init_is_a_pure_function_of_name_and_seed():
    a = init_value("blocks.3.ffn.0.weight", (8, 4), seed=1)
    assert torch.equal(a, init_value("blocks.3.ffn.0.weight", (8, 4), seed=1))
    assert not torch.equal(a, init_value("blocks.3.ffn.0.weight", (8, 4), seed=2))
    assert not torch.equal(a, init_value("blocks.4.ffn.0.weight", (8, 4), seed=1))
    assert torch.equal(init_value("blocks.0.norm3.weight", (4,), 0), torch.ones(4))
    assert torch.equal(init_value("head.head.bias", (4,), 0), torch.zeros(4))


def test_save_load_round_trip_is_bit_exact(cfg, tmp_path):
    a = DitEngine(cfg, group=RankGroup.single(), device=CPU, seed=5)
    path = save_weights(a.model, tmp_path)
    assert path.name == WEIGHTS_FILE
    on_disk = load_file(str(path))
    assert "blocks.0.self_attn.q.weight" in on_disk and not any("qkv" in k for k in on_disk)
    b = DitEngine(cfg, group=RankGroup.single(), device=CPU, seed=6, weights_dir=str(tmp_path))
    c = DitEngine(cfg, group=RankGroup.single(), device=CPU, seed=6)
    ref = _chunks(a)
    for x, y in zip(ref, _chunks(b)):
        assert torch.equal(x, y)
    assert not torch.equal(ref[0], _chunks(c, 1)[0]), "a different seed should give different weights"


def test_missing_unexpected_and_misshaped_keys(cfg, tmp_path):
    model = init_weights(build_model(cfg.model, device=CPU, dtype=torch.float32), seed=0)
    tensors = load_file(str(save_weights(model, tmp_path / "ok")))

    def write(name: str, t: dict) -> str:
        (tmp_path / name).mkdir()
        save_file(t, str(tmp_path / name / "w.safetensors"))
        return str(tmp_path / name)

    missing = dict(tensors)
    del missing["blocks.1.cross_attn.norm_k.weight"]
    with pytest.raises(HarnessError, match=r"missing 'blocks\.1\.cross_attn\.norm_k\.weight'"):
        load_weights(model, write("missing", missing))
    extra = dict(tensors, **{"blocks.0.img_emb.weight": torch.zeros(2)})
    with pytest.raises(HarnessError, match=r"unexpected key 'blocks\.0\.img_emb\.weight'"):
        load_weights(model, write("extra", extra))
    bad = dict(tensors, **{"head.head.weight": torch.zeros(3, 3)})
    with pytest.raises(HarnessError, match=r"'head\.head\.weight' has shape"):
        load_weights(model, write("bad", bad))
    (tmp_path / "empty").mkdir()
    with pytest.raises(HarnessError, match="no .*safetensors files"):
        load_weights(model, tmp_path / "empty")
    with pytest.raises(HarnessError, match="not found"):
        load_weights(model, tmp_path / "nowhere")
