"""Config overrides from the command line (``--set``): typed like a config file, validated, and
refused in one line when the field, the type or the resulting shapes are wrong."""

from __future__ import annotations

import pytest

from harness.config import apply_sets, load_preset, preset_names
from harness.errors import ConfigError


def test_every_preset_loads_and_validates():
    names = preset_names()
    assert {"tiny", "lingbot-480x832", "lingbot-704x1280"} <= set(names)
    for name in names:
        assert load_preset(name).name == name


def test_set_overrides_typed_fields():
    base = load_preset("lingbot-480x832")
    cfg = apply_sets(base, ["model.num_layers=4", "runtime.mode=compiled", "cache.window_frames=21",
                            "vae.dim_mult=[1, 2, 4, 4]", "runtime.encoder = ffmpeg"])
    assert (cfg.model.num_layers, cfg.runtime.mode, cfg.cache.window_frames) == (4, "compiled", 21)
    assert tuple(cfg.vae.dim_mult) == (1, 2, 4, 4) and cfg.runtime.encoder == "ffmpeg"
    assert cfg.model.dim == base.model.dim and apply_sets(base, []) is base


@pytest.mark.parametrize("item, why", [
    ("model.layers=4", "no field model.layers"),
    ("nosuch.x=1", "no field nosuch.x"),
    ("model.num_layers", "SECTION.FIELD=VALUE"),
    ("num_layers=4", "SECTION.FIELD=VALUE"),
    ("model.num_layers=four", "Expected `int`"),
    ("runtime.mode=fast", "runtime.mode"),
    ("model.num_heads=7", "not divisible by num_heads"),  # validated like a file: shapes must work
])
def test_bad_sets_are_refused_in_one_line(item, why):
    with pytest.raises(ConfigError, match=None) as e:
        apply_sets(load_preset("tiny"), [item])
    assert why in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_frames_per_chunk_says_it_counts_latent_frames(tmp_path):
    from harness.config import CONFIG_DIR, load_config, to_dict, upgrade_recorded

    cfg = load_preset("tiny")
    assert to_dict(cfg)["video"]["latent_frames_per_chunk"] == cfg.video.frames_per_chunk == 3
    assert (cfg.video.pixel_frames(0), cfg.video.pixel_frames(1)) == (9, 12)  # what the media hold
    assert apply_sets(cfg, ["video.latent_frames_per_chunk=6", "cache.sink_frames=6"]).video.frames_per_chunk == 6
    # the old name is refused in one line that gives the new one, in a file and in --set
    old = tmp_path / "old.toml"
    old.write_text((CONFIG_DIR / "tiny.toml").read_text().replace("latent_frames_per_chunk", "frames_per_chunk"))
    for refuse in (lambda: load_config(old), lambda: apply_sets(cfg, ["video.frames_per_chunk=3"])):
        with pytest.raises(ConfigError) as e:
            refuse()
        assert "video.frames_per_chunk is now video.latent_frames_per_chunk" in str(e.value)
        assert "\n" not in str(e.value)
    # a manifest recorded before the rename still reads
    recorded = to_dict(cfg)
    recorded["video"] = {("frames_per_chunk" if k == "latent_frames_per_chunk" else k): v for k, v in recorded["video"].items()}
    assert upgrade_recorded(recorded) == to_dict(cfg)
