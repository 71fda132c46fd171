"""``bench-pipeline`` and ``gpu-checks`` run through ``python -m harness`` like every command:
a smoke run of each transport benchmark on tiny frames, and the GPU checks' refusal on a machine
without CUDA (one line, exit 2)."""

from __future__ import annotations

import json

import pytest
import torch

from harness.cli import main


@pytest.mark.parametrize("argv, keys", [
    (["ring"], {"write_GBps", "read_GBps", "end_to_end_chunks_per_s", "high_water", "leftover"}),
    (["channel"], {"end_to_end_chunks_per_s", "ms_per_chunk_median", "producer_blocked_ms", "leftover"}),
])
def test_bench_pipeline_transport_smoke(argv, keys, capsys):
    small = ["--height", "16", "--width", "24", "--frames", "2", "--chunks", "6", "--slots", "2"]
    assert main(["bench-pipeline", *argv, *small]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert keys <= set(res)
    # every chunk went through and its ring was unlinked: nothing left in /dev/shm
    assert res["leftover"] == [] and res["chunks"] == 6 and res["chunk_bytes"] == 2 * 16 * 24 * 3
    assert res["end_to_end_chunks_per_s"] > 0
    if argv == ["ring"]:
        assert 1 <= res["high_water"] <= 2  # at most `slots` chunks in flight


def test_bench_pipeline_encode_smoke(capsys):
    assert main(["bench-pipeline", "encode", "--sizes", "32x48", "--backends", "pyav", "--threads", "1", "--chunks", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [(r["backend"], r["size"], r["threads"], r["chunks"]) for r in rows] == [("pyav", "32x48", 1, 2)]
    assert rows[0]["compression"] > 1  # FFV1 is lossless but compresses the synthetic gradients


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_gpu_checks_refuse_without_cuda(capsys):
    assert main(["gpu-checks", "output"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: gpu-checks output needs a CUDA device"]
