"""scenario interactive: what it refuses before anything starts, and how it states what overlap
costs a player. (The scenario itself launches three servers; the player it runs is tested end to
end in tests/serving/test_player_session.py.)"""

from __future__ import annotations

import pytest

from harness.cli import build_parser, main
from harness.experiments.scenario.interactive import ARMS, cost_note
from harness.experiments.scenario.params import params_from
from harness.experiments.scenario.scenario_options import ARM_NAMES
from harness.experiments.scenario.server_process import serve_argv
from harness.measure.interaction import A2PSummary


@pytest.mark.parametrize("extra,message", [
    (["--over", "inprocess"], "interactive runs over websocket only"),
    (["--connect", "127.0.0.1:9"], "interactive launches its own servers"),
    (["--scheduler", "case-e"], "interactive sets the scheduler of each arm"),
    (["--candidate", "H5a"], "interactive runs H5a as an arm (--arms h5a)"),
    (["--arms", "case-d,case-x"], "--arms: expected distinct names from case-d, case-e, h5a"),
    (["--arms", "case-d,case-d"], "--arms: expected distinct names"),
    (["--arms", ","], "--arms: expected distinct names"),
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
    assert tuple(ARMS) == ARM_NAMES and [label for label, _ in ARMS.values()] == ["Case D", "Case E", "H5a"]
    note = cost_note({"Case D": _summary(300.0, 200.0), "Case E": _summary(400.0, 150.0), "H5a": _summary(250.0, 150.0)})
    assert note == ("A2P delivery P50 against Case D: Case E +100 ms (+0.50 Case D chunk intervals), "
                    "H5a -50 ms (-0.25 Case D chunk intervals)")
    assert cost_note({"Case E": _summary(400.0, 150.0)}) is None
    assert cost_note({"Case D": _summary(None, 200.0), "Case E": _summary(400.0, 150.0)}) is None


def test_every_arm_gets_the_command_lines_candidates_and_settings(tmp_path):
    """A stack is timed per key press under each schedule: --candidate, --set, --telemetry and the
    weights reach each arm's server; --arms picks and orders the arms."""
    args = build_parser().parse_args(
        ["scenario", "interactive", "--preset", "tiny", "--mode", "compiled", "--candidate", "H2a", "--candidate",
         "H5b", "--set", "runtime.encoder_threads=2", "--set", "model.num_layers=2", "--telemetry", "5",
         "--dit-weights", "w.safetensors", "--arms", "h5a,case-d"])
    argv = serve_argv(args)
    pairs = list(zip(argv[::2], argv[1::2]))
    for pair in [("--preset", "tiny"), ("--mode", "compiled"), ("--candidate", "H2a"), ("--candidate", "H5b"),
                 ("--set", "runtime.encoder_threads=2"), ("--set", "model.num_layers=2"), ("--telemetry", "5.0"),
                 ("--dit-weights", "w.safetensors")]:
        assert pair in pairs, (pair, argv)
    assert "--scheduler" not in argv  # each arm adds its own
    assert params_from(args, tmp_path).arms == ("h5a", "case-d")


def test_an_arm_whose_server_does_not_start_is_a_failed_check_not_a_traceback(tmp_path, monkeypatch):
    from harness.experiments.scenario import interactive
    from harness.experiments.scenario.findings import Report
    from harness.experiments.scenario.params import Params
    from harness.experiments.scenario.server_process import ServerDidNotStart, error_line

    stderr = ("note: dit has not answered for 10.0 s\nTraceback (most recent call last):\n  ...\n"
              "error: dit rank 0 failed: OutOfMemoryError: CUDA out of memory.\n")
    assert error_line(stderr) == "error: dit rank 0 failed: OutOfMemoryError: CUDA out of memory."
    assert error_line("Traceback\nValueError: x\n") == "Traceback\nValueError: x"  # no error line: the tail

    def no_server(*a, **k):
        raise ServerDidNotStart(f"server did not start: {error_line(stderr)}")

    monkeypatch.setattr(interactive, "ServerProcess", no_server)
    report = Report("interactive", "websocket")
    assert interactive._one_arm(report, "Case D", ["--preset", "tiny"], Params(), tmp_path / "case-d") is None
    assert report.checks == [("Case D: the server starts", False,
                              "server did not start: error: dit rank 0 failed: OutOfMemoryError: CUDA out of memory.")]
