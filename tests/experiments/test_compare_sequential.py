"""``compare --reanalyze`` on synthetic round directories with a known truth (helpers.compare_dirs):
the sequential loop's looks at the default 24-round budget, its stops, its recorded plan, and
tables whose columns agree with their ratio."""

from __future__ import annotations

import json
import math
import re

import pytest

from harness.cli import main
from harness.experiments import compare as C
from harness.experiments.replay.h1b import _h1b_row
from harness.experiments.verdicts import load, table
from harness.measure import stats as S

from helpers.compare_dirs import write_rounds


def _head(res: dict) -> dict:
    return next(r for r in res["rows"] if r["boundary"] == "cpu_ready" and r["metric"].startswith("steady"))


@pytest.fixture(scope="module")
def two_rounds(tmp_path_factory):
    """Two rounds with 4–5 % launch spread: the first look of a 24-round plan (level ~1e-11)."""
    return write_rounds(tmp_path_factory.mktemp("seq") / "c", [600, 640], [610, 650])


def test_the_first_look_of_the_default_budget_is_no_verdict_not_a_crash(two_rounds, capsys):
    d = two_rounds
    assert main(["compare", "--reanalyze", "--until-resolved", "--out", str(d)]) == 0
    out = capsys.readouterr().out
    res = json.loads((d / "compare.json").read_text())
    first = S.spending_levels(S.sequential_looks(S.DEFAULT_MAX_ROUNDS))[0]
    assert first < 1e-10 and res["sequential"]["max_rounds"] == S.DEFAULT_MAX_ROUNDS
    assert res["interval"]["level"] == pytest.approx(first)
    head = _head(res)
    assert head["verdict"] == "no verdict" and head["pending"] is True  # more rounds can resolve it
    assert head["ab"]["low"] is None and head["ab"]["high"] is None and head["mde"] is None
    assert head["ab"]["value"] == pytest.approx(math.sqrt(610 * 650 / (600 * 640)))
    assert res["sequential"]["outcome"] == f"unresolved after 2 of {S.DEFAULT_MAX_ROUNDS} rounds"
    # the budget's MDE is a figure (last look's level, 24 launches per arm); the look's own is not
    assert 0 < res["sequential"]["mde_before"] < 0.1 and res["sequential"]["mde_after"] is None
    md = (d / "compare.md").read_text()
    assert "no verdict: interval wider than ×/÷10" in md and "no verdict: beyond ×10" in md
    assert "{" not in md  # no Python dict repr of the window
    # the rounds a 5 % shift needs, from the launches measured, against the budget
    m = re.search(r"a 5 % shift needs (\d+) rounds at 80 % power at launch spread .* measured in these rounds: "
                  r"(within|beyond) the budget of 24 rounds", out)
    assert m, out
    sd = _head(res)["ab"]["sd_log"]
    assert int(m.group(1)) == S.rounds_needed(*sd, budget=S.DEFAULT_MAX_ROUNDS)
    assert out.count("gate (exact): pass") == 1


@pytest.fixture(scope="module")
def recorded(two_rounds):
    """The two rounds judged once with --until-resolved: compare.json records the 24-round plan."""
    if not (two_rounds / "compare.json").is_file():
        assert main(["compare", "--reanalyze", "--until-resolved", "--out", str(two_rounds)]) == 0
    return two_rounds


def test_reanalysis_takes_the_recorded_plan(recorded):
    two_rounds = recorded
    first = json.loads((two_rounds / "compare.json").read_text())
    again = C.reanalyze(two_rounds)  # no --until-resolved: the plan compare.json records
    assert again.sequential["max_rounds"] == S.DEFAULT_MAX_ROUNDS
    assert again.interval["level"] == pytest.approx(first["interval"]["level"])
    with pytest.raises(C.HarnessError, match="records a sequential plan of 24 rounds"):
        C.reanalyze(two_rounds, C.Plan(6, True))


def test_the_loop_stops_at_equivalent(tmp_path):
    # A and B within 0.1 % of each other, launch spread 0.1 %: equivalent within 1 ± 2 % before round 6
    d = write_rounds(tmp_path / "c", [600.0, 600.6, 599.4, 600.3, 599.7, 600.0], [600.3, 599.7, 600.0, 600.6, 599.4, 600.1])
    res = C.reanalyze(d, C.Plan(6, True))
    assert res.verdict == "equivalent" and res.rounds_run < 6
    assert res.sequential["outcome"] == f"equivalent after {res.rounds_run} rounds"
    assert res.stopped_early.startswith(f"resolved after {res.rounds_run} rounds: equivalent")


def test_columns_are_the_sample_the_ratio_reads(tmp_path, capsys):
    # pooled medians would read 1000 → 900 ("faster") while the launch-level ratio is 1.28 (slower)
    d = write_rounds(tmp_path / "c", [1000, 1100], [900, 2000])
    assert main(["compare", "--reanalyze", "--out", str(d)]) == 0
    out = capsys.readouterr().out
    head = _head(json.loads((d / "compare.json").read_text()))
    assert head["candidate_ms"] / head["baseline_ms"] == pytest.approx(head["ab"]["value"], rel=1e-12)
    assert head["baseline_ms"] == pytest.approx(math.sqrt(1000 * 1100))
    # 2 + 2 launches this far apart: an interval of ±t(1 df)·se is no figure, nor is the MDE
    assert head["verdict"] == "no verdict" and head["ab"]["low"] is None and head["mde"] is None
    line = next(x for x in out.splitlines() if "steady interval P50 @ cpu_ready" in x)
    assert "1049 → 1342 ms" in line and "no verdict: interval wider than" in line
    assert not re.search(r"\d+\.\d{4}", line)  # nothing printed to four decimals it cannot support


def test_a_result_without_interval_ends_reads_as_its_verdict_elsewhere(recorded):
    """Readers of compare.json (replay's H1b table, verdicts) take a too-wide interval's missing ends."""
    d = json.loads((recorded / "compare.json").read_text())
    row = _h1b_row("H1b:fa3", recorded / "compare.json", d)
    assert row["ratio"] is None and row["verdict"] == "no verdict"
    line = table([load(recorded)]).splitlines()[2]
    assert "no verdict: too wide to state" in line and "**no verdict" in line
