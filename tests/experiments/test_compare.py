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
from harness.measure import stats as S

from helpers.procs import run_segments


def test_compare_h5a_runs_interleaved_rounds_and_writes_the_gate_and_table(h5a_compare):
    rc, out, workers_left = h5a_compare
    assert rc == 0
    assert wait_gone(workers_left) == []  # every serve reaped its ranks
    assert not run_segments(os.getpid())
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
        assert r["ab"]["launches"] == [2, 2] and r["ab"]["confidence"] == pytest.approx(0.95)
        assert r["candidate_ms"] / r["baseline_ms"] == pytest.approx(r["ab"]["value"])  # the columns are the ratio's units
        if r["ab"]["low"] is None:  # CPU launches that disagree by more than ×/÷10 over t(1-2 df): no figure
            assert r["verdict"] == "no verdict" and r["pending"] and r["mde"] is None
        else:
            assert r["ab"]["low"] <= r["ab"]["value"] <= r["ab"]["high"] and (r["mde"] is None or r["mde"] > 0)
            assert r["verdict"] in ("faster", "slower", "equivalent", "no resolvable difference")
        assert r["aa"] is None and r["noise_floor"] is None  # an A/A check needs ≥ 4 rounds; no floor any more
    assert rows["cpu_ready"]["candidate_samples"] == 8  # 2 steady intervals (chunks 5-6) per session
    assert res["verdict"] == rows["cpu_ready"]["verdict"]
    assert "each launch" in res["method"] and res["schema"] == 2
    q = res["sequential"]  # --until-resolved --max-rounds 2: one look, at the full 5 %
    assert q["looks"] == [2] and q["levels"] == [0.05] and q["rounds"] == 2 and res["rounds_requested"] == 2
    assert q["outcome"] in ("faster after 2 rounds", "slower after 2 rounds", "equivalent after 2 rounds",
                            "unresolved at the maximum of 2 rounds")
    assert q["mde_before"] == q["mde_after"]  # the budget is the rounds run
    md = (out / "compare.md").read_text()
    assert "| metric | baseline | candidate | ratio [interval] | launches |" in md and "{" not in md
    assert "gate (exact): pass" in md and "| 2+2 |" in md and "minimum detectable effect (80 % power)" in md
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
        "--max-rounds must be": ["--candidate", "H5a", "--until-resolved", "--max-rounds", "1"],
        "--margin must be": ["--candidate", "H5a", "--margin", "0"],
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
    base = [[[100, 101], [101, 100]], [[99, 100], [100, 99]]]  # 2 launches × 2 sessions
    fast = [[[50, 51], [51, 50]], [[49, 50], [50, 49]]]
    row = C.compare_metric("steady interval P50 @ cpu_ready", "cpu_ready", base, fast, False)
    assert row.verdict == "no verdict" and row.significant is None and "gate failed" in row.reason
    ok = C.compare_metric("steady interval P50 @ cpu_ready", "cpu_ready", base, fast, True)
    assert ok.verdict == "faster" and ok.significant is True and ok.ab.value == pytest.approx(0.5, abs=0.005)
    assert ok.ab.launches == (2, 2)


def test_one_launch_per_arm_is_no_verdict():
    one = [[[100, 101], [102, 100]]]
    row = C.compare_metric("m", "cpu_ready", one, [[[50, 51], [52, 50]]], True)
    assert row.verdict == "no verdict" and row.reason.startswith("one launch") and row.ab is None
    assert row.within_launch is not None and row.within_launch.high < 1  # described, not judged
    empty = C.compare_metric("m", "cpu_ready", one, [[[]]], True)
    assert empty.verdict == "no verdict" and empty.ab is None and "no candidate samples" in empty.reason


def test_gate_kind():
    assert C.gate_kind(["exact"]) == "exact"
    assert C.gate_kind(["exact", "threshold"]) == "threshold"
    assert C.gate_kind(["serving"]) == "serving"
    assert C.gate_kind(["serving", "exact"]) == "exact"


def test_plan_levels_and_the_budget_mde():
    fixed, seq = C.Plan(3), C.Plan(5, sequential=True)
    assert fixed.looks == (3,) and fixed.level(3) == pytest.approx(0.05, abs=1e-4)
    assert seq.looks == (2, 3, 4, 5) and seq.level(2) < seq.level(5) < 0.05
    row = C.compare_metric("m", "cpu_ready", [[[100, 101]], [[99, 100]]], [[[90, 91]], [[92, 90]]], True, seq.level(2))
    before = seq.mde_for_budget(row, 2)
    assert 0 < before < row.mde  # five rounds resolve less than two do
    # the budget's MDE is that of its last look (5 launches per arm at that look's level), not the current look's
    assert before == S.min_detectable(*row.ab.sd_log, 5, 5, seq.level(5))
    assert before < S.min_detectable(*row.ab.sd_log, 5, 5, seq.level(3))


def test_until_resolved_stops_at_the_first_decisive_look(monkeypatch, tmp_path):
    """The loop alone: launches and judgement stand in, verdicts scripted look by look."""
    script = iter(["no resolvable difference", "no resolvable difference", "faster"])
    launched = []
    ratio = C.Ratio(0.9, 0.8, 0.95, 8, 32, (2, 2), 0.99, 2.0, (0.02, 0.02))

    def fake_round(cfg, out, r, arms, *a):
        launched.append(r)
        return {arm: C.RunMeta(r, arm, str(out / f"round{r}-{arm}"), {}, {}) for arm, _ in arms}

    def fake_analyze(ra, rb, *, rounds_requested, plan, **kw):
        assert plan.sequential and len(ra) == len(rb)
        v = next(script) if "sequential" not in kw else "faster"
        row = C.Row("steady interval P50 @ cpu_ready", "cpu_ready", 1.0, 1.0, ratio, None, None, None, v, "r", 1, 1, 0.05)
        return C.CompareResult(2, ["H5a"], [], rounds_requested, len(rb), "", {}, [], None, "", "cpu_ready", v, "r",
                               [row], {}, kw.get("stopped_early"), {}, kw.get("sequential"))

    monkeypatch.setattr(C, "_launch_round", fake_round)
    monkeypatch.setattr(C, "check_comparable", lambda a, b: ["H5a"])
    monkeypatch.setattr(C, "run_gate", lambda a, b, c: C.GateRecord("exact", "pass", "ok", "eager"))
    monkeypatch.setattr(C, "analyze", fake_analyze)
    monkeypatch.setattr(C, "refuse_unrepeatable_exact", lambda *a: None)
    from harness.config import load_preset

    logs: list[str] = []
    res = C.run_compare(load_preset("tiny"), [], ["H5a"], out=tmp_path / "c", until_resolved=True, max_rounds=6,
                        log=logs.append)
    # the budget is said before the first launch, its time after the first round, the MDE at the first look
    assert logs[0].startswith("until resolved: at most 6 rounds (12 launches); looks after rounds 2–6")
    # the rounds a 5 % shift needs, from the stated prior, against the budget, before any launch
    assert logs[1].startswith("a 5 % shift needs ") and "(the prior, before any launch is measured)" in logs[1]
    assert logs[1].endswith("beyond the budget of 6 rounds")
    assert logs[2].startswith("the first round took") and "6 rounds take about" in logs[2]
    assert [x.split(":")[0] for x in logs if x.startswith("look after")] == [f"look after {n} rounds" for n in (2, 3, 4)]
    assert sum("minimum detectable effect" in x and "with all 6 rounds" in x for x in logs) == 1
    assert launched == [0, 1, 2, 3]  # looks after rounds 2, 3, 4: decisive at the third
    q = res.sequential
    assert q["outcome"] == "faster after 4 rounds" and q["looks"] == [2, 3, 4, 5, 6] and q["rounds"] == 4
    assert q["mde_before"] is not None and q["mde_after"] == 0.05
    assert res.stopped_early == "resolved after 4 rounds: faster"


def test_compare_records_its_setting_and_verdicts_reads_it(h5a_compare):
    from harness.config import load_preset
    from harness.experiments.verdicts import load

    _, out, _ = h5a_compare
    res = json.loads((out / "compare.json").read_text())
    tiny = load_preset("tiny")
    assert res["setting"]["preset"] == "tiny" and res["setting"]["mode"] == "eager"
    assert res["setting"]["layers"] == tiny.model.num_layers and res["setting"]["sp"] == 1 != tiny.parallel.sp  # --sp 1
    v = load(out)
    assert (v.candidate, v.method, v.verdict) == ("H5a", "compare", res["verdict"])
    head = next(r for r in res["rows"] if r["boundary"] == "cpu_ready" and r["metric"].startswith("steady"))
    assert v.ratio == head["ab"]["value"] and v.noise_floor == head["noise_floor"]
    assert f"{tiny.model.num_layers} layers" in v.setting and "2 rounds × 2 measured sessions per launch" in v.setting
    # compare.md says what ran, each arm by the setting line every headline carries (measure.setting)
    md = (out / "compare.md").read_text()
    for arm, who, cands in (("A", "baseline", "candidates none"), ("B", "candidate", "candidates H5a")):
        line = next(x for x in md.splitlines() if x.startswith(f"- {who} ({arm}, first launch): `setting: "))
        assert "preset tiny" in line and "mode eager" in line and cands in line and "host load" in line, line


def test_compare_prints_the_gate_once():
    from types import SimpleNamespace as NS

    from harness.experiments import compare as C

    assert C.gate_line(NS(kind="exact", status="pass", verdict="pass: 28 files and 21 hash records identical")) == \
        "gate (exact): pass: 28 files and 21 hash records identical"
    assert C.gate_line(NS(kind="threshold", status="fail", verdict="2 of 40 files differ")) == \
        "gate (threshold): fail: 2 of 40 files differ"


def test_cli_defaults_are_the_documented_budget():
    from harness.cli import build_parser
    from harness.errors import HarnessError
    from harness.experiments.ab_engine import DEFAULT_LAUNCHES
    from harness.measure import stats as S

    def plan(*argv):
        a = build_parser().parse_args(["compare", "--candidate", "H5a", *argv])
        return C.check_plan(a.rounds, a.until_resolved, a.max_rounds, a.margin)

    assert plan() == C.Plan(C.DEFAULT_ROUNDS, False, S.DEFAULT_MARGIN)
    assert plan("--until-resolved") == C.Plan(S.DEFAULT_MAX_ROUNDS, True, S.DEFAULT_MARGIN)
    assert plan("--until-resolved", "--max-rounds", "6").looks == (2, 3, 4, 5, 6)
    # the other mode's option would be silently ignored: refused
    for argv, msg in ((("--until-resolved", "--rounds", "5"), "exclude each other"),
                      (("--max-rounds", "6"), "budget of --until-resolved")):
        with pytest.raises(HarnessError, match=msg):
            plan(*argv)
    line = C.budget_line(plan("--until-resolved"))
    assert f"at most {S.DEFAULT_MAX_ROUNDS} rounds ({2 * S.DEFAULT_MAX_ROUNDS} launches)" in line and "rounds 2–24" in line
    assert build_parser().parse_args(["ab-engine", "--candidate", "H2a"]).launches == DEFAULT_LAUNCHES
