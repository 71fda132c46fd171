"""Up-front bounds (issue: absurd input): every case is one line on stderr and exit 2 from the
command line itself, before a run directory, a ring segment or a process exists."""

from __future__ import annotations

import os

import pytest

from harness import cli
from harness.config import load_config, load_preset
from harness.drivers.procwatch import children
from harness.errors import ConfigError
from harness.limits import MAX_CONFIG_BYTES, PROCESS_BYTES, ROPE_MAX_FRAMES, estimate_bytes

from helpers import REPO
from helpers.procs import run_segments

TINY = REPO / "configs" / "tiny.toml"

# (argv after "serve", what the one line must say)
BAD_SERVE = [
    (["--chunks", "342"], "position table holds 1024"),
    (["--set", "video.chunks_per_session=100000"], "position table"),
    (["--set", "video.width=-8"], "video.width = -8 is outside"),
    (["--set", "video.height=0"], "video.height = 0 is outside"),
    (["--set", "video.height=65536"], "video.height = 65536 is outside"),
    (["--set", "model.num_layers=100000"], "model.num_layers = 100000 is outside"),
    (["--set", "model.num_layers=0"], "model.num_layers = 0 is outside"),
    (["--set", "model.dim=-64"], "model.dim = -64 is outside"),
    (["--set", "model.patch_size=[1, -2, 2]"], "model.patch_size[1] = -2"),
    (["--set", "vae.dim_mult=[1, 0, 4, 4]"], "vae.dim_mult[1] = 0"),
    (["--set", "cache.sink_frames=-3"], "sink_frames"),
    (["--set", "runtime.ring_slots=100000"], "runtime.ring_slots = 100000 is outside"),
    (["--set", "runtime.rank_timeout_s=-1"], "rank_timeout_s"),
    (["--set", "schedule.timesteps=[5000, 10]"], "schedule.timesteps"),
    (["--set", "runtime.condition_dtype=float16"], "runtime.condition_dtype = float16 needs runtime.device = cuda"),
    # fits the ceilings, not the machine: refused by the memory estimate, not by ENOMEM
    (["--set", "video.height=8192", "--set", "video.width=8192", "--set", "runtime.ring_slots=200"], "of /dev/shm"),
    (["--set", "model.dim=32768", "--set", "model.num_heads=256", "--set", "model.num_layers=512",
      "--set", "model.ffn_dim=131072"], "this host has"),
    (["--candidate", "H5a", "--scheduler", "case-d"], "--candidate H5a sets runtime.scheduler = case-e"),
    (["--candidate", "H5a", "--set", "runtime.scheduler=case-d"], "--set runtime.scheduler=case-d"),
    (["--sessions", "0"], "--sessions must be ≥ 1"),
    (["--chunks", "-1"], "--chunks must be ≥ 1"),
    # the endpoint's admission and replicas (before any rank starts)
    (["--listen", "127.0.0.1:0", "--replicas", "0"], "--replicas must be in 1-64"),
    (["--listen", "127.0.0.1:0", "--replicas", "2", "--replica-gpus", "0"], "lists 1 GPU groups for --replicas 2"),
    (["--listen", "127.0.0.1:0", "--replicas", "2", "--replica-gpus", "0", "1"], "on the CPU every replica shares"),
    (["--listen", "127.0.0.1:0", "--queue", "0"], "--queue must be in 1-1000"),
    (["--listen", "127.0.0.1:0", "--queue-timeout", "0"], "--queue-timeout must be in (0, 3600] s"),
    (["--listen", "127.0.0.1:0", "--queue-timeout", "nan"], "--queue-timeout must be in (0, 3600] s"),
    (["--listen", "127.0.0.1:0", "--session-cap", "-5"], "--session-cap must be in (0, 604800] s"),
    (["--listen", "127.0.0.1:0", "--max-peer-connections", "0"], "--max-peer-connections must be in 1-8"),
    (["--listen", "127.0.0.1:0", "--api", "vllm-omni", "--replicas", "2"], "one session per server, as production does"),
    (["--replicas", "2"], "--replicas is an option of the network endpoint: add --listen"),
]


@pytest.mark.parametrize("argv, why", BAD_SERVE, ids=[" ".join(a)[:40] for a, _ in BAD_SERVE])
def test_bad_serve_options_are_one_line_exit_2_before_anything_starts(argv, why, tmp_path, capsys):
    out = tmp_path / "run"
    kids = set(children(os.getpid()))
    shm = run_segments(os.getpid())
    assert cli.main(["serve", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and why in err and "\n" not in err, err
    assert not out.exists()  # refused before the run directory
    assert set(children(os.getpid())) <= kids
    assert run_segments(os.getpid()) - shm == set()


@pytest.mark.parametrize("command", [["bench-engine"], ["ab-engine", "--candidate", "H1a"]])
def test_engine_commands_bound_chunks_by_the_position_table(command, capsys):
    assert cli.main([*command, "--chunks", "400"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --chunks 400: ") and "position table holds 1024" in err and "\n" not in err


def test_the_position_table_bound_admits_exactly_the_sessions_that_fit():  # over WebSocket: test_server_hostile
    from harness.limits import max_chunks, session_frames_error

    cfg = load_preset("tiny")
    n = max_chunks(cfg.video.frames_per_chunk)
    assert n * cfg.video.frames_per_chunk <= ROPE_MAX_FRAMES < (n + 1) * cfg.video.frames_per_chunk
    assert session_frames_error(n, cfg.video.frames_per_chunk) is None
    assert "position table" in session_frames_error(n + 1, cfg.video.frames_per_chunk)


def test_a_config_file_must_spell_out_its_shapes(tmp_path):
    text = TINY.read_text()
    (tmp_path / "ok.toml").write_text(text)
    assert load_config(tmp_path / "ok.toml").model.dim == 64
    # leaving out num_layers would have taken the full model's 40 layers
    (tmp_path / "partial.toml").write_text(text.replace("num_layers = 2\n", ""))
    with pytest.raises(ConfigError, match=r"\[model\] must set num_layers"):
        load_config(tmp_path / "partial.toml")
    (tmp_path / "novideo.toml").write_text(text.replace("[video]", "[video_]"))
    with pytest.raises(ConfigError, match="video_"):  # an unknown section, before any missing field
        load_config(tmp_path / "novideo.toml")


def test_config_file_size_is_limited(tmp_path):
    big = tmp_path / "big.toml"
    big.write_bytes(TINY.read_bytes() + b"#" * (MAX_CONFIG_BYTES + 1) + b"\n")
    with pytest.raises(ConfigError, match="not a config file"):
        load_config(big)


def test_memory_estimate_scales_with_the_model():
    tiny, full = estimate_bytes(load_preset("tiny")), estimate_bytes(load_preset("lingbot-480x832"))
    # the tiny model's tensors are a few MiB beside its process; the full model fits one H200
    assert tiny["dit_rank"] - PROCESS_BYTES < 64 * 2**20 < 40 * 2**30 < full["dit_rank"] < 141 * 2**30



# (module whose bound is lowered, argv, what the line names): files the harness reads besides configs
BIG_READS = [
    ("harness.measure.run_report", ["report", "{run}", "--bench", "{big}"], "not a bench-engine --json result"),
    ("harness.experiments.verdicts", ["verdicts", "{big}"], "not a result file"),
]


@pytest.mark.parametrize("module, argv, why", BIG_READS, ids=[a[0] for _, a, _ in BIG_READS])
def test_other_file_reads_are_size_limited(module, argv, why, tmp_path, capsys, monkeypatch):
    import importlib

    monkeypatch.setattr(importlib.import_module(module), "MAX_JSON_BYTES", 1024)  # rather than write 64 MiB
    big = tmp_path / "big.json"
    big.write_text('{"flops": 1, "pad": "' + "x" * 2048 + '"}')
    assert cli.main([a.format(run=tmp_path / "run", big=big) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {big} is over 1 KiB; {why}", err
    assert not (tmp_path / "run").exists()


def test_capture_reads_are_size_limited(tmp_path, monkeypatch):
    """Replay reads an index no larger than the bound and a capture file only at the size its index recorded."""
    import json

    from harness.errors import HarnessError
    from harness.experiments.replay.cases import load_cases
    from harness.hooks import capture

    rec = {"status": "saved", "kind": "attention", "op": "sdpa", "op_id": "a0", "phase": "denoise", "file": "a0.safetensors",
           "bytes": 10, "tensors": {"q": {"shape": [1], "dtype": "float32"}}}
    (tmp_path / "index.jsonl").write_text(json.dumps(rec) + "\n")
    (tmp_path / "a0.safetensors").write_bytes(b"\0" * 11)
    (case,) = load_cases(tmp_path, ops=("attention",))
    with pytest.raises(HarnessError, match="a0.safetensors is 11 bytes, the capture index says 10"):
        case.load("cpu")
    monkeypatch.setattr(capture, "MAX_JSON_BYTES", 1024)
    (tmp_path / "index.jsonl").write_text(json.dumps(rec) + "\n" + " " * 1024 + "\n")
    with pytest.raises(HarnessError, match="index.jsonl is over 1 KiB; not a capture index"):
        capture.read_index(tmp_path)
