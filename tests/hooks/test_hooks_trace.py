"""trace.json from a hand-made event table: tracks, one slice per present stage, times, flows."""

import json

import pytest

from harness.hooks import trace as tr
from harness.measure.events import ChunkEvent

MS = 1_000_000
T0 = 5_000_000_000

# The stages the brief names, with their boundaries, written out here independently of trace.py.
BRIEF_STAGES = {
    "dit": ("dit_start", "dit_end"),
    "decode": ("decode_start", "decode_end"),
    "convert": ("decode_end", "gpu_ready"),
    "d2h": ("gpu_ready", "cpu_ready"),
    "ipc": ("cpu_ready", "received"),
    "encode": ("received", "encoded"),
    "sink": ("encoded", "delivered"),
}
PROCESS = {"dit": "dit rank 0", "decode": "vae rank 0", "convert": "vae rank 0", "d2h": "vae rank 0",
           "ipc": "driver", "encode": "encoder", "sink": "encoder", "dit_queue": "driver", "handoff": "driver"}


def chunk_events(session, epoch, n, start, ipc_delay=None, drop=None):
    """Case D timing: each chunk starts 10 ms after the previous one's frames are in host memory."""
    out, t = [], start
    for c in range(n):
        e = {"session": session, "epoch": epoch, "chunk": c, "frames": 9 if c == 0 else 12}
        e["submit"] = t
        e["dit_start"] = t + 1 * MS
        e["dit_end"] = e["dit_start"] + 100 * MS
        e["latent_ready"] = e["dit_end"] + 2 * MS
        e["decode_submit"] = e["latent_ready"] + MS // 2
        e["decode_start"] = e["decode_submit"] + MS
        e["decode_end"] = e["decode_start"] + 40 * MS
        e["gpu_ready"] = e["decode_end"] + 3 * MS
        e["cpu_ready"] = e["gpu_ready"] + 2 * MS
        delay = (ipc_delay or {}).get(c, 5 * MS)
        e["received"] = e["cpu_ready"] + delay
        e["encoded"] = e["received"] + 20 * MS
        e["delivered"] = e["encoded"] + 1 * MS
        t = e["cpu_ready"] + 10 * MS
        for b in (drop or {}).get(c, ()):
            del e[b]
        out.append(e)
    return out


def table():
    # session 0: chunk 1's frames wait 200 ms to cross to the encoder → its ipc overlaps chunk 2's
    s0 = chunk_events(0, 0, 3, T0, ipc_delay={1: 200 * MS, 2: 250 * MS})
    # session 1: chunk 1 lost decode_end; chunk 2 cancelled after the DiT
    s1 = chunk_events(1, 1, 3, T0 + 2_000 * MS, drop={
        1: ("decode_end",),
        2: ("latent_ready", "decode_submit", "decode_start", "decode_end", "gpu_ready", "cpu_ready",
            "received", "encoded", "delivered"),
    })
    s1[2]["cancelled"] = True
    s0[0]["gpu_ms"] = {"dit": 97.5, "decode": 38.0}
    s0[0]["blocked_ns"] = {"encode": 1234}
    return s0 + s1


@pytest.mark.parametrize("as_struct", [False, True])
def test_trace_matches_the_event_table(tmp_path, as_struct):
    events = table()
    inp = [ChunkEvent(**e) for e in events] if as_struct else events
    path = tmp_path / "trace.json"
    tr.write_trace(inp, path)
    trace = json.loads(path.read_text())
    assert tr.validate_trace(trace) == []
    assert tr.validate_trace(path) == []
    assert trace["otherData"]["t0_ns"] == T0

    procs = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {"driver", "dit rank 0", "vae rank 0", "encoder"}

    sl = tr.slices(trace)
    for e in events:
        mine = [s for s in sl if (s["args"]["session"], s["args"]["chunk"]) == (e["session"], e["chunk"])]
        for stage, (a, z) in BRIEF_STAGES.items():
            got = [s for s in mine if s["name"] == stage]
            if a in e and z in e:
                assert len(got) == 1, (e["session"], e["chunk"], stage)
                s = got[0]
                assert s["process"] == PROCESS[stage]
                assert s["thread"].split(" #")[0] == stage
                assert s["ts"] * 1000 + T0 == pytest.approx(e[a], abs=0.5)
                assert s["dur"] * 1000 == pytest.approx(e[z] - e[a], abs=0.5)
                assert (s["args"]["start_ns"], s["args"]["end_ns"]) == (e[a], e[z])
                assert s["args"]["frames"] == e["frames"]
            else:
                assert got == [], (e["session"], e["chunk"], stage)  # never faked
    # session 1 chunk 1 lost decode_end: no decode, no convert, but d2h is there
    s1c1 = {s["name"] for s in sl if (s["args"]["session"], s["args"]["chunk"]) == (1, 1)}
    assert {"dit", "d2h", "ipc", "encode", "sink"} <= s1c1 and not {"decode", "convert"} & s1c1
    cancelled = [s for s in sl if (s["args"]["session"], s["args"]["chunk"]) == (1, 2)]
    assert {s["name"] for s in cancelled} == {"handoff", "dit_queue", "dit"} and all(s["args"]["cancelled"] for s in cancelled)

    first = {s["name"]: s["args"] for s in sl if (s["args"]["session"], s["args"]["chunk"]) == (0, 0)}
    assert first["dit"]["gpu_ms"] == 97.5 and first["decode"]["gpu_ms"] == 38.0
    assert first["encode"]["blocked_ns"] == 1234 and "gpu_ms" not in first["encode"]

    # the overlapping ipc of session 0 went to a second lane of the driver
    ipc_threads = {s["thread"] for s in sl if s["name"] == "ipc"}
    assert ipc_threads == {"ipc", "ipc #2"}

    # Case D handoff: cpu_ready(i-1) → dit_start(i), 11 ms here
    hand = [s for s in sl if s["name"] == "handoff"]
    assert len(hand) == 2 + 2 and all(s["dur"] == pytest.approx(11_000) for s in hand)

    # flows: one per chunk with at least two of dit/decode/encode, in that order
    flows = [e for e in trace["traceEvents"] if e["ph"] in ("s", "t", "f")]
    by_id = {}
    for f in flows:
        by_id.setdefault(f["id"], []).append(f)
    chains = sorted(tuple(p["ph"] for p in v) for v in by_id.values())
    assert chains.count(("s", "t", "f")) == 4  # full chunks: s0 c0-2, s1 c0
    assert chains.count(("s", "f")) == 1  # s1 c1: dit → encode (no decode slice)
    assert len(by_id) == 5  # the cancelled chunk has only dit: no flow
    dit_pid = next(s["pid"] for s in sl if s["name"] == "dit")
    assert all(v[0]["pid"] == dit_pid for v in by_id.values())


def test_custom_process_map_and_empty_table():
    trace = tr.build_trace(table(), {"ipc": "encoder", "submit": None, "handoff": None})
    assert tr.validate_trace(trace) == []
    sl = tr.slices(trace)
    assert {s["process"] for s in sl if s["name"] == "ipc"} == {"encoder"}
    assert not [s for s in sl if s["name"] in ("submit", "handoff")]
    empty = tr.build_trace([])
    assert tr.validate_trace(empty) == [] and tr.slices(empty) == []


def test_validator_catches_broken_traces():
    good = tr.build_trace(table())
    evs = good["traceEvents"]
    no_proc = {"traceEvents": [e for e in evs if not (e["ph"] == "M" and e["name"] == "process_name")]}
    assert any("process_name" in p for p in tr.validate_trace(no_proc))
    x = next(e for e in evs if e["ph"] == "X" and e["name"] == "dit")
    overlap = dict(x, ts=x["ts"] + x["dur"] / 2)
    assert any("partially overlaps" in p for p in tr.validate_trace({"traceEvents": evs + [overlap]}))
    no_finish = [e for e in evs if e["ph"] != "f"]
    assert any("expected s" in p for p in tr.validate_trace({"traceEvents": no_finish}))
    neg = [dict(e, dur=-1.0) if e is x else e for e in evs]
    assert any("dur" in p for p in tr.validate_trace({"traceEvents": neg}))
    assert tr.validate_trace({"foo": 1}) == ["traceEvents missing or not a list"]
    assert tr.validate_trace({"traceEvents": [{"ph": "X", "pid": 1, "tid": 1, "name": "a", "ts": 0, "dur": 1, "args": {1, 2}}]})


def test_load_events_reads_the_run_file(tmp_path):
    from harness.measure.events import write_events

    write_events(tmp_path / "events.jsonl", [ChunkEvent(**e) for e in table()])
    evs = tr.load_events(tmp_path / "events.jsonl")
    assert tr.build_trace(evs) == tr.build_trace(table())
