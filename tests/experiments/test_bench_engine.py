"""bench-engine: the FLOP count of the full-size presets (meta device, no arithmetic) and a real
timed run of the tiny preset over 2 SP ranks and 2 VAE ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.config import load_preset
from harness.experiments.bench_engine import steady_chunk_index

from helpers import REPO


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", "bench-engine", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("preset", ["lingbot-480x832", "lingbot-704x1280"])
def test_flops_only_counts_the_steady_chunk_of_the_full_model(preset):
    proc = _run("--preset", preset, "--flops-only")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    f = json.loads(lines[0])
    cfg = load_preset(preset)
    m = cfg.model
    passes = len(cfg.schedule.timesteps) + 1
    # self-attention at the saturated window: 4·Sq·Skv·H·D per layer per pass, all ranks summed
    expect_self = 4 * cfg.tokens_per_chunk * cfg.max_kv_tokens * m.num_heads * m.head_dim * m.num_layers * passes
    assert f["self_attention_flops"] == expect_self
    expect_cross = 4 * cfg.tokens_per_chunk * m.text_len * m.num_heads * m.head_dim * m.num_layers * passes
    assert f["cross_attention_flops"] == expect_cross
    # every per-block GEMM on every token: qkv, o, cross q/o, 4 camera, FFN in and out
    per_token = (4 + 2 + 4) * m.dim * m.dim + 2 * m.dim * m.ffn_dim
    blocks = 2 * per_token * cfg.tokens_per_chunk * m.num_layers * passes
    assert blocks <= f["linear_flops"] <= blocks * 1.01  # + embeddings and head
    assert f["vae_conv_flops"] > 0
    assert f["total_flops"] == f["linear_flops"] + f["self_attention_flops"] + f["cross_attention_flops"] + f["vae_conv_flops"]


def test_bench_engine_tiny_on_two_sp_and_two_vae_ranks(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run("--preset", "tiny", "--sp", "2", "--vae-ranks", "2", "--sessions", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert res["sp"] == 2 and res["vae_ranks"] == 2 and res["mode"] == "eager"
    assert res["complete"] is True and res["steps_done"] == ["dit", "vae", "flops", "peaks"]
    cfg = load_preset("tiny")
    n = cfg.video.chunks_per_session  # a whole session by default: chunk 9 vs chunk 6 is reported
    assert len(res["dit_chunk_ms"]) == n and all(t > 0 for t in res["dit_chunk_ms"])
    assert res["steady_flatness_9_vs_6"] == res["dit_chunk_ms"][9] / res["dit_chunk_ms"][6]
    assert len(res["memory_after_session"]) == 2 and res["memory_growth_mib"]["allocated_mib"] is None
    assert res["memory_growth_mib"]["rss_mib"] == (res["memory_after_session"][1]["rss_mib"]
                                                   - res["memory_after_session"][0]["rss_mib"])
    assert res["dit_kv_tokens"][-1] == cfg.max_kv_tokens  # the timed steady chunks saw a full window
    assert res["vae_steady_decode_ms"] > 0 and res["flops"]["total_flops"] > 0
    assert "DiT steady chunk" in proc.stdout


@pytest.mark.parametrize("bad, why", [(["--set", "model.layers=4"], "no field model.layers"),
                                      (["--set", "model.num_layers=four"], "Expected `int`"),
                                      (["--sessions", "0"], "--sessions must be"),
                                      # chunk 5 is the first with a full window: its FLOPs are the rate's
                                      (["--chunks", "5"], "more than 5 chunks for a steady"),
                                      # only engine patches are applied: others would be claimed, not measured
                                      (["--candidate", "H3b", "--no-vae"], "which --no-vae does not run"),
                                      (["--candidate", "H5a"], "changes the scheduler"),
                                      (["--set", "runtime.attention=fa3"], "runtime.attention=fa3: FlashAttention-3"),
                                      (["--json", "no-such-folder/b.json"], "its folder does not exist")])
def test_bad_options_are_refused_in_one_line(bad, why):
    proc = _run("--preset", "tiny", *bad, timeout=120)
    assert proc.returncode == 2  # a usage error, refused before anything runs
    assert len(proc.stderr.strip().splitlines()) == 1 and why in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_candidate_and_dit_only_options(tmp_path):
    """--candidate applies its DiT patch (H2a: the JSON names it and the chunks still run);
    --no-vae skips the VAE; a non-eager mode first runs a whole unmeasured session (every K length
    the measured one meets, the saturated window's included); a candidate the device cannot run is
    refused before anything starts."""
    out = tmp_path / "b.json"
    proc = _run("--preset", "tiny", "--sp", "1", "--device", "cpu", "--chunks", "6", "--candidate", "H2a",
                "--mode", "deterministic", "--no-vae", "--kernels", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert res["candidates"] == ["H2a"] and len(res["dit_chunk_ms"]) == 6 and res["mode"] == "deterministic"
    assert len(res["warmup_chunk_ms"]) == 6 > steady_chunk_index(load_preset("tiny"))
    assert res["dit_kernels"] is None  # the profiler breakdown is for CUDA devices only
    assert res["vae_decode_ms"] is None and res["vae_steady_decode_ms"] is None and "VAE not run" in proc.stdout
    bad = _run("--preset", "tiny", "--device", "cpu", "--candidate", "H6a")
    assert bad.returncode != 0 and "needs cuda" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_flop_count_of_an_fa3_configuration_is_the_nominal_one():
    """FA3 cannot run on the meta device; its nominal FLOPs are SDPA's (the same 4·Sq·Skv·H·D),
    so a FA3 arm gets a count instead of ``FlashAttention-3 runs on CUDA (Hopper) only, not on meta``."""
    from harness.config import override
    from harness.experiments.bench_engine import count_steady_flops

    cfg = load_preset("tiny")
    assert count_steady_flops(override(cfg, runtime={"attention": "fa3"})) == count_steady_flops(cfg)


def test_a_failing_later_step_keeps_what_was_measured(tmp_path, monkeypatch):
    """The JSON is rewritten whole after each step: when the FLOP count fails, the DiT and VAE
    figures measured before it are in the file, marked incomplete with the steps done."""
    from harness import cli
    from harness.experiments import bench_engine

    def fail(cfg):
        raise RuntimeError("flop count failed")

    monkeypatch.setattr(bench_engine, "count_steady_flops", fail)
    out = tmp_path / "b.json"
    with pytest.raises(RuntimeError, match="flop count failed"):
        cli.main(["bench-engine", "--preset", "tiny", "--chunks", "6", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["complete"] is False and res["steps_done"] == ["dit", "vae"]
    assert len(res["dit_chunk_ms"]) == 6 and len(res["vae_decode_ms"]) == 4 and "flops" not in res
    assert not (tmp_path / "b.json.tmp").exists()


def test_a_vae_candidate_patches_the_timed_decode():
    """bench-engine --candidate H3b decodes in bf16 (the timed VAE rank applies the VAE patch and
    the JSON says which dtype and TF32 setting the decode times are of); without it, fp32."""
    from harness.engine.groups import RankGroup
    from harness.experiments.bench_engine import _vae_rank

    cfg = load_preset("tiny")
    base, bf16 = (_vae_rank(RankGroup.single(), cfg, 2, c) for c in ((), ("H3b",)))
    assert (base["dtype"], bf16["dtype"]) == ("float32", "bfloat16")
    assert len(bf16["decode_ms"]) == 2 and min(bf16["decode_ms"]) > 0
    assert _vae_rank(RankGroup.single(), cfg, 1, ("H3b:tf32-off",))["dtype"] == "float32"
