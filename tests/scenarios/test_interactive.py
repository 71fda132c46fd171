"""scenario interactive: what it refuses before anything starts, and how it states what overlap
costs a player. (The scenario itself launches three servers; the player it runs is tested end to
end in tests/serving/test_player_session.py.)"""

from __future__ import annotations

import pytest

from harness.cli import main
from harness.experiments.scenario.interactive import ARMS, cost_note
from harness.measure.interaction import A2PSummary


@pytest.mark.parametrize("extra,message", [
    (["--over", "inprocess"], "interactive runs over websocket only"),
    (["--connect", "127.0.0.1:9"], "interactive launches its own servers"),
    (["--scheduler", "case-e"], "interactive sets the scheduler and candidate of each arm"),
    (["--player", "random:x"], "random:SEED needs a non-negative integer seed"),
])
def test_bad_arguments_are_refused_before_anything_starts(extra, message, tmp_path, capsys):
    rc = main(["scenario", "interactive", "--out", str(tmp_path / "o"), *extra])
    err = capsys.readouterr().err
    assert rc != 0 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def _summary(p50: float | None, interval: float | None) -> A2PSummary:
    return A2PSummary(events=1, applied=1, late=0, delivery_ms={"p50": p50, "p95": p50, "p99": p50},
                      playout_ms={"p50": p50, "p95": p50, "p99": p50}, next_share=1.0, parts_ms={}, interval_ms=interval,
                      pipeline_ms=None, floor_ms=None)


def test_the_cost_of_overlap_is_stated_in_case_d_chunk_intervals():
    assert [a for a, _ in ARMS] == ["Case D", "Case E", "H5a"]
    note = cost_note({"Case D": _summary(300.0, 200.0), "Case E": _summary(400.0, 150.0), "H5a": _summary(250.0, 150.0)})
    assert note == ("A2P delivery P50 against Case D: Case E +100 ms (+0.50 Case D chunk intervals), "
                    "H5a -50 ms (-0.25 Case D chunk intervals)")
    assert cost_note({"Case E": _summary(400.0, 150.0)}) is None
    assert cost_note({"Case D": _summary(None, 200.0), "Case E": _summary(400.0, 150.0)}) is None
