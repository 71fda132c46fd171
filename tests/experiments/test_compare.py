"""``compare``: the interleaved A/B on the tiny preset, its refusals, and its pure judgement."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import msgspec
import pytest

from harness.cli import main
from harness.drivers.procwatch import wait_gone
from harness.experiments import compare as C


def test_compare_h5a_runs_interleaved_rounds_and_writes_the_gate_and_table(h5a_compare):
    rc, out, workers_left = h5a_compare
    assert rc == 0
    assert wait_gone(workers_left) == []  # every serve reaped its ranks
    assert not list(Path("/dev/shm").glob(f"harness-{os.getpid()}-*"))
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["round0-A", "round0-B", "round1-A", "round1-B"]
    res = json.loads((out / "compare.json").read_text())
    assert res["order"] == "A0 B0 A1 B1" and res["rounds_run"] == 2
    assert res["candidate"] == ["H5a"] and res["baseline"] == []
    assert res["gate"]["kind"] == "exact" and res["gate"]["status"] == "pass"
    assert res["gate"]["n_failed"] == 0 and res["gate"]["run_a"].endswith("round0-A")
    rows = {r["boundary"] if r["metric"].startswith("steady") else "ttfc": r for r in res["rows"]}
    assert set(rows) == {"cpu_ready", "encoded", "delivered", "ttfc"}
    for r in rows.values():
        assert r["ab"]["n_sessions"] == 8  # 2 measured sessions per launch, 2 launches per arm
        assert r["ab"]["low"] <= r["ab"]["value"] <= r["ab"]["high"]
        assert r["aa"] is not None and r["noise_floor"] is not None  # A/A: baseline round 0 vs round 1
        assert r["verdict"] in ("faster", "slower", "no resolvable difference")
    assert rows["cpu_ready"]["candidate_samples"] == 8  # 2 steady intervals (chunks 5-6) per session
    assert res["verdict"] == rows["cpu_ready"]["verdict"]
    assert "odd rounds" in res["noise_floor_method"]
    md = (out / "compare.md").read_text()
    assert "| metric | baseline | candidate | ratio | 95 % interval |" in md
    assert "pass (exact)" in md and "significant?" in md
    for arm, sched in (("A", "case-d"), ("B", "case-e")):
        man = json.loads((out / f"round1-{arm}" / "manifest.json").read_text())
        assert man["scheduler"] == sched and man["protocol"]["name"] == "timing"
        assert man["protocol"]["ab"] == {"round": 1, "arm": arm, "compare_dir": str(out)}
        summ = json.loads((out / f"round1-{arm}" / "summary.json").read_text())
        assert (summ["window"]["first_chunk"], summ["window"]["last_chunk"]) == (5, 6)  # short session honoured
        assert "missing_boundaries" not in summ["flags"]


def test_reanalysis_reproduces_the_comparison(h5a_compare):
    _, out, _ = h5a_compare
    again = C.reanalyze(out)
    saved = json.loads((out / "compare.json").read_text())
    assert json.loads(json.dumps(msgspec.to_builtins(again))) == saved  # fixed bootstrap seed


def _copy_meta(out: Path, dest: Path) -> Path:
    """The round directories' manifest + summary only: enough for the refusals, which read nothing else."""
    for r in ("round0-A", "round0-B"):
        (dest / r).mkdir(parents=True)
        for f in ("manifest.json", "summary.json"):
            shutil.copy(out / r / f, dest / r / f)
    return dest


def _edit(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def test_compare_refuses_runs_with_different_hooks(h5a_compare, tmp_path, capsys):
    _, out, _ = h5a_compare
    d = _copy_meta(out, tmp_path / "mixed")
    _edit(d / "round0-B" / "summary.json", lambda s: s.update(hooks=["trace"]))
    with pytest.raises(C.HarnessError, match="differ in hooks"):
        C.reanalyze(d)
    assert main(["compare", "--reanalyze", "--out", str(d)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hooks" in err[0]


def test_compare_refuses_config_changes_beyond_the_candidate(h5a_compare, tmp_path):
    _, out, _ = h5a_compare
    d = _copy_meta(out, tmp_path / "seed")
    _edit(d / "round0-B" / "manifest.json", lambda m: m["config"]["runtime"].update(seed=7))
    with pytest.raises(C.HarnessError, match=r"beyond what H5a changes: runtime\.seed"):
        C.reanalyze(d)
    d2 = _copy_meta(out, tmp_path / "same")
    _edit(d2 / "round0-B" / "manifest.json", lambda m: m.update(candidates=[]))
    with pytest.raises(C.HarnessError, match="same candidates"):
        C.reanalyze(d2)


def test_compare_refuses_before_launching(tmp_path, capsys):
    cases = {
        "changes nothing": ["--candidate", "H5a", "--scheduler", "case-e"],
        "needs --candidate": [],
        "unknown candidate": ["--candidate", "H9"],
        "both the candidate and in the baseline": ["--candidate", "H5a", "--baseline", "H5a"],
        "--rounds must be": ["--candidate", "H5a", "--rounds", "0"],
        "not bit-identical across launches": ["--candidate", "H2a", "--mode", "compiled"],
    }
    for i, (msg, argv) in enumerate(cases.items()):
        out = tmp_path / f"c{i}"
        assert main(["compare", *argv, "--preset", "tiny", "--out", str(out)]) == 2
        assert msg in capsys.readouterr().err
        assert not out.exists()  # nothing launched, nothing half-written


def test_exact_gates_need_a_repeatable_mode():
    C.refuse_unrepeatable_exact(["H2a"], "deterministic")
    C.refuse_unrepeatable_exact(["H4a", "H4b"], "eager")
    C.refuse_unrepeatable_exact(["H1a"], "compiled")  # a threshold gate tolerates launch-to-launch kernels
    C.refuse_unrepeatable_exact(["H2a", "H1a"], "compiled")  # together they are judged by the threshold
    with pytest.raises(C.HarnessError, match="--mode deterministic"):
        C.refuse_unrepeatable_exact(["H5a"], "compiled")


def test_a_failed_gate_is_never_a_speed_claim():
    base = [[[100, 101], [101, 100]], [[99, 100], [100, 99]]]
    fast = [[[50, 51], [51, 50]], [[49, 50], [50, 49]]]
    row = C.compare_metric("steady interval P50 @ cpu_ready", "cpu_ready", base, fast, False, {"n_boot": 200, "seed": 0})
    assert row.verdict == "no verdict" and row.significant is None and "gate failed" in row.reason
    ok = C.compare_metric("steady interval P50 @ cpu_ready", "cpu_ready", base, fast, True, {"n_boot": 200, "seed": 0})
    assert ok.verdict == "faster" and ok.significant is True and ok.ab.value == pytest.approx(0.5)


def test_too_little_data_resolves_nothing():
    one = [[[100, 101]]]
    row = C.compare_metric("m", "cpu_ready", one, [[[50, 51]]], True, {"n_boot": 200, "seed": 0})
    assert row.verdict == "no resolvable difference" and "too few sessions" in row.reason
    empty = C.compare_metric("m", "cpu_ready", one, [[[]]], True, {"n_boot": 200, "seed": 0})
    assert empty.verdict == "no verdict" and empty.ab is None and "no candidate samples" in empty.reason


def test_aa_halves_and_gate_kind():
    rounds = [[[1], [2]], [[3]], [[4], []], [[5]]]
    x, y, how = C.aa_halves(rounds)
    assert how == "rounds" and x == [[1], [2], [4]] and y == [[3], [5]]
    x, y, how = C.aa_halves([[[1], [2], [3], [4]]])
    assert how == "sessions" and x == [[1], [3]] and y == [[2], [4]]
    # a half of one session bootstraps to a point: no floor rather than a zero-width one
    assert C.aa_halves([[[1], [2], [3]]]) is None and C.aa_halves([[[1]], [[2]]]) is None
    assert C.aa_halves([[[1]]]) is None
    assert C.gate_kind(["exact"]) == "exact"
    assert C.gate_kind(["exact", "threshold"]) == "threshold"
    assert C.gate_kind(["serving"]) == "serving"
    assert C.gate_kind(["serving", "exact"]) == "exact"


def test_compare_records_its_setting_and_verdicts_reads_it(h5a_compare):
    from harness.config import load_preset
    from harness.experiments.verdicts import load

    _, out, _ = h5a_compare
    res = json.loads((out / "compare.json").read_text())
    tiny = load_preset("tiny")
    assert res["setting"]["preset"] == "tiny" and res["setting"]["mode"] == "eager"
    assert res["setting"]["layers"] == tiny.model.num_layers and res["setting"]["sp"] == tiny.parallel.sp
    v = load(out)
    assert (v.candidate, v.method, v.verdict) == ("H5a", "compare", res["verdict"])
    head = next(r for r in res["rows"] if r["boundary"] == "cpu_ready" and r["metric"].startswith("steady"))
    assert v.ratio == head["ab"]["value"] and v.noise_floor == head["noise_floor"]
    assert f"{tiny.model.num_layers} layers" in v.setting and "2 rounds × 2 measured sessions per launch" in v.setting


def test_compare_prints_the_gate_once_and_calls_a_wide_noise_band_uninformative():
    from types import SimpleNamespace as NS

    from harness.experiments import compare as C

    gate = NS(kind="exact", status="pass", verdict="pass: 28 files and 21 hash records identical")
    row = NS(metric="steady interval P50 @ cpu_ready", baseline_ms=633.0, candidate_ms=594.4, reason="",
             ab=NS(value=0.939, low=0.555, high=1.183), verdict="no resolvable difference",
             aa=NS(low=0.0625, high=1.9375), noise_floor=0.9375)
    lines = C.summary_lines(NS(gate=gate, rows=[row], reference="cpu_ready", verdict="no resolvable difference"))
    assert lines[0] == "gate (exact): pass: 28 files and 21 hash records identical"
    assert "A/A noise band [0.0625, 1.9375] is uninformative" in lines[2]
    tight = NS(**{**vars(row), "aa": NS(low=0.97, high=1.03), "noise_floor": 0.03})
    lines = C.summary_lines(NS(gate=gate, rows=[tight], reference="cpu_ready", verdict="no resolvable difference"))
    assert "uninformative" not in "\n".join(lines) and "[0.9700, 1.0300]" in lines[2]
    assert C.gate_line(NS(kind="threshold", status="fail", verdict="2 of 40 files differ")) == \
        "gate (threshold): fail: 2 of 40 files differ"
