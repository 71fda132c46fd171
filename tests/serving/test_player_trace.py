"""The player's traces: files (JSON lines, CSV) and built-ins, and every bad file refused with one
line that says where; and the rule, ``latest_wins``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.errors import HarnessError
from harness.serving.player import TraceEvent, hold_and_turn, latest_wins, parse_trace, random_trace, taps

from helpers import REPO


def test_json_lines_and_csv_files(tmp_path):
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"t": 0, "keys": "W"}\n\n{"t": 0.5, "keys": ["w", "J"], "id": "turn"}\n{"t": 0.5, "keys": ""}\n')
    assert parse_trace(str(jl)) == [TraceEvent(0.0, "w", "e0"), TraceEvent(0.5, "wj", "turn"), TraceEvent(0.5, "", "e2")]
    csv = tmp_path / "t.csv"
    csv.write_text("t,keys\n0.25,jw\n1,\n")
    assert parse_trace(str(csv)) == [TraceEvent(0.25, "wj", "e0"), TraceEvent(1.0, "", "e1")]
    ids = tmp_path / "ids.csv"
    ids.write_text("t,keys,id\n0,w,go\n")
    assert parse_trace(str(ids)) == [TraceEvent(0.0, "w", "go")]


@pytest.mark.parametrize("name,text,message", [
    ("a.jsonl", '{"t": 0, "keys": "w"}\n{"t": 1, "keys": "x"}\n', "a.jsonl:2: action 1 'x' has invalid key(s) 'x'"),
    ("a.jsonl", '{"t": 0, "keys": "w"\n', "a.jsonl:1: not JSON"),
    ("a.jsonl", '{"t": 0}\n', "a.jsonl:1: expected an object with t, keys"),
    ("a.jsonl", '{"t": 0, "keys": "w", "extra": 1}\n', "a.jsonl:1: expected an object with t, keys"),
    ("a.jsonl", '{"t": -1, "keys": "w"}\n', "a.jsonl:1: t must be a number of seconds in [0, 3600]"),
    ("a.jsonl", '{"t": true, "keys": "w"}\n', "a.jsonl:1: t must be a number"),
    ("a.jsonl", '{"t": 2, "keys": "w"}\n{"t": 1, "keys": ""}\n', "comes before the previous one"),
    ("a.jsonl", '{"t": 0, "keys": "w", "id": "x"}\n{"t": 1, "keys": "", "id": "x"}\n', "event id 'x' is used twice"),
    ("a.jsonl", "\n", "the trace has no events"),
    ("a.csv", "time,keys\n0,w\n", "a.csv:1: expected the header t,keys"),
    ("a.csv", "t,keys\n0,w,extra\n", "a.csv:2: expected 2 columns, got 3"),
    ("a.csv", "t,keys\nsoon,w\n", "a.csv:2: t must be a number of seconds, got 'soon'"),
])
def test_bad_trace_files_are_refused_with_one_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(HarnessError) as e:
        parse_trace(str(path))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_traces_are_refused():
    with pytest.raises(HarnessError, match="neither a built-in trace"):
        parse_trace("no-such-trace")
    with pytest.raises(HarnessError, match="random:SEED needs a non-negative integer"):
        parse_trace("random:x")


@pytest.mark.parametrize("trace", [hold_and_turn(), taps(), random_trace(3)])
def test_built_in_traces_are_valid_traces(trace):
    times = [e.t_s for e in trace]
    assert times == sorted(times) and len({e.event_id for e in trace}) == len(trace) > 10
    assert {e.keys for e in trace} > {""}  # they press keys and release them


def test_the_random_trace_is_its_seed():
    assert random_trace(7) == random_trace(7) != random_trace(8)
    assert parse_trace("random:7") == random_trace(7)


def test_latest_wins_holds_the_state_and_applies_every_arrival():
    assert latest_wins("w", []) == ("w", [])  # nothing arrived: the held keys stay
    assert latest_wins("w", [("a", "j"), ("b", ""), ("c", "wl")]) == ("wl", ["a", "b", "c"])


def test_client_refuses_a_bad_trace_before_connecting(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0, "keys": "q"}\n')
    # port 9 (discard) on loopback: were the trace not checked first, the client would report a connection error
    r = subprocess.run([sys.executable, "-m", "harness", "client", "--connect", "127.0.0.1:9", "--player", str(bad)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode != 0 and "bad.jsonl:1: action 0 'q' has invalid key(s) 'q'" in r.stderr
    assert "connect" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
