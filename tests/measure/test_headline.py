"""What the console headline and the setting line say (``measure.headline``, ``measure.setting``):
what ran, every flag raised (defined, valid run or not), TTFC at each row's own boundary, and the
warm-up's compile figure."""

from __future__ import annotations

import json

import msgspec
import pytest
from helpers.events import case_d_table

from harness.measure import figures as F
from harness.measure import summary as SM
from harness.measure.headline import headline, run_headline
from harness.measure.setting import hook_cost_ms, setting_line

MANIFEST = {"preset": "tiny", "mode": "compiled", "scheduler": "case-e", "candidates": ["H5a"], "hooks": ["nvtx", "trace"],
            "devices": ["NVIDIA H200"], "engine": {"backend": "reference"},
            "config": {"runtime": {"device": "cuda"}, "parallel": {"sp": 2, "vae_ranks": 2}},
            "host": {"cpus": 16, "load_start": [1.5, 1.0, 0.5], "load_end": [2.25, 1.0, 0.5]}}


@pytest.fixture(scope="module")
def small_run():
    events, starts = case_d_table({}, n_sessions=3)  # 2 measured sessions × 4 steady intervals: a valid run, n < 100
    return msgspec.to_builtins(SM.build_summary(events, starts, n_boot=50))


def test_every_raised_flag_is_shown_with_its_definition_on_a_valid_run(small_run):
    assert small_run["valid"] and SM.FLAG_TOO_FEW in small_run["flags"]
    lines = headline(small_run, "case-d", "eager")
    assert f"  flag {SM.FLAG_TOO_FEW}: {F.define(F.flag_figure(SM.FLAG_TOO_FEW)).formula}" in lines
    assert not any(l.strip().startswith("INVALID") for l in lines)


def test_every_summary_flag_is_a_figure():
    flags = {v for k, v in vars(SM).items() if k.startswith("FLAG_")}
    assert flags == set(F.FLAG_NAMES)
    for f in flags:
        assert F.resolve(f).name == F.flag_figure(f)


def test_ttfc_is_a_column_at_each_rows_boundary(small_run):
    lines = headline(small_run)
    head = lines[0].split("  ")
    assert F.label("ttfc_p50") in [h.strip() for h in head if h.strip()]
    for b in ("cpu_ready", "encoded", "delivered"):
        row = next(l for l in lines if l.strip().startswith(b + " "))
        assert f"{small_run['ttfc'][b]['p50_ms']:.1f}" in row.split()
    assert not any("@ delivered" in l for l in lines)  # no second TTFC on another boundary


def test_warm_up_first_chunk_is_reported_beside_the_steady_median(small_run):
    w = small_run["warmup"]["stages"]["dit"]
    assert w["first_ms"] == pytest.approx(40.0) and w["steady_p50_ms"] == pytest.approx(40.0) and w["excess_ms"] == 0
    line = next(l for l in headline(small_run, mode="compiled") if F.label("warmup_first_chunk") in l)
    assert "dit 40.0 (steady P50 40.0)" in line and "(compiled mode, mostly compilation)" in line


def test_the_first_chunks_parts_are_one_line(small_run):
    parts = small_run["ttfc_parts"]
    assert parts["setup"]["p50_ms"] == pytest.approx(10.0) and parts["dit"]["p50_ms"] == pytest.approx(40.0)
    line = next(l for l in headline(small_run) if F.label("ttfc_parts") in l)
    assert "setup 10.0, dit_queue 1.0, dit 40.0" in line and "decode 30.0" in line and line.endswith("sink 1.0")


def test_the_setting_line_says_what_ran():
    line = setting_line(MANIFEST, {"nvtx": 3.25})
    for part in ("preset tiny", "device cuda (NVIDIA H200)", "mode compiled", "case-e", "SP 2 / VAE ranks 2",
                 "engine reference", "candidates H5a", "hooks nvtx (3.2 ms in-run), trace", "host load 1.50→2.25",
                 "on 16 CPUs"):
        assert part in line, (part, line)
    assert "hooks none" in setting_line({**MANIFEST, "hooks": []})


def test_run_headline_reads_the_setting_from_the_run_directory(tmp_path, small_run):
    (tmp_path / "manifest.json").write_text(json.dumps(MANIFEST))
    for label, ms in (("dit0", 1.0), ("dit1", 2.5)):
        (tmp_path / f"hooks.{label}.json").write_text(json.dumps({"overhead_ms": {"start": 9.0, "nvtx_in_run": ms}}))
    assert hook_cost_ms(tmp_path) == {"nvtx": 3.5}  # in-run cost summed over processes; start/close are outside
    lines = run_headline(tmp_path, small_run)
    assert lines[0] == f"run directory: {tmp_path.resolve()}" and lines[1].startswith("setting: ")
    assert "nvtx (3.5 ms in-run)" in lines[1]
