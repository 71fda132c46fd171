import msgspec
import pytest

from harness.measure.events import (
    BOUNDARIES, ChunkEvent, EventFormatError, encode_line, merge, order_violations,
    read_events, read_run, read_sessions, validate_events, write_events, write_sessions,
)


def test_boundaries_are_the_contract():
    assert BOUNDARIES == (
        "submit", "dit_start", "dit_end", "latent_ready", "decode_submit", "decode_start",
        "decode_end", "gpu_ready", "cpu_ready", "received", "encoded", "delivered",
    )
    fields = set(ChunkEvent.__struct_fields__)
    assert set(BOUNDARIES) <= fields


def test_round_trip_omits_absent_boundaries(tmp_path, tables):
    events, start = tables.session(1, 1, gpu={"dit": 12.5}, blocked={"vae": 3})
    events[3] = msgspec.structs.replace(events[3], delivered=None, cancelled=True)
    path = tmp_path / "events.jsonl"
    write_events(path, events)
    lines = path.read_bytes().splitlines()
    assert len(lines) == len(events)
    assert b"delivered" not in lines[3] and b"delivered" in lines[2]
    assert b"cancelled" not in lines[2]  # defaults are omitted
    assert read_events(path) == events
    write_sessions(tmp_path / "sessions.jsonl", [start])
    assert read_sessions(tmp_path / "sessions.jsonl") == [start]
    assert read_run(tmp_path) == (events, [start])


def test_run_without_sessions_file(tmp_path, tables):
    events, _ = tables.session(1, 1)
    write_events(tmp_path / "events.jsonl", events)
    assert read_run(tmp_path) == (events, [])


def test_unknown_field_and_bad_line_are_errors(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"session":0,"epoch":0,"chunk":0,"frames":9,"dit_stat":5}\n')
    with pytest.raises(EventFormatError, match=":1:"):
        read_events(path)
    path.write_bytes(b'{"session":0,"epoch":0,"chunk":0,"frames":9}\n{"session":0,"epoch":0,"chunk":1,"fra')
    with pytest.raises(EventFormatError, match=":2:"):
        read_events(path)
    # A process killed mid-write leaves an unterminated last line; readers of a crashed run may skip it.
    assert len(read_events(path, tolerate_partial_tail=True)) == 1
    # ... but only the unterminated last line.
    path.write_bytes(b'{"session":0,"epoch":0,"chunk":0,"fra\n{"session":0,"epoch":0,"chunk":1,"frames":9}\n')
    with pytest.raises(EventFormatError, match=":1:"):
        read_events(path, tolerate_partial_tail=True)


def test_encode_line_appends_cleanly(tmp_path):
    path = tmp_path / "events.jsonl"
    e = ChunkEvent(session=2, epoch=1, chunk=0, frames=9, submit=10, dit_start=20)
    with open(path, "ab") as f:
        f.write(encode_line(e))
        f.write(encode_line(msgspec.structs.replace(e, chunk=1, frames=12)))
    assert [x.chunk for x in read_events(path)] == [0, 1]


def test_order_violations_within_a_chunk():
    ok = ChunkEvent(session=0, epoch=1, chunk=0, frames=9, submit=1, dit_start=1, dit_end=5, cpu_ready=9)
    assert order_violations(ok) == []  # equal timestamps allowed, gaps allowed
    bad = ChunkEvent(session=0, epoch=1, chunk=0, frames=9, submit=10, dit_start=5, dit_end=20, cpu_ready=15)
    v = order_violations(bad)
    assert len(v) == 2
    assert "dit_start (5) before submit (10)" in v[0]
    assert "cpu_ready (15) before dit_end (20)" in v[1]


def test_validate_events_table(tables):
    events, start = tables.session(3, 1)
    assert validate_events(events, [start]) == []
    # Chunk 4 delivered before chunk 3: stages are FIFO per session.
    e = list(events)
    e[4] = msgspec.structs.replace(e[4], delivered=e[3].delivered - 1, encoded=None)
    v = validate_events(e, [start])
    assert any("delivered of chunk 4" in x for x in v)
    # Duplicate chunk, non-positive frames, session start after a boundary, start recorded twice.
    dup = events + [events[2], msgspec.structs.replace(events[5], chunk=11, frames=0)]
    late = msgspec.structs.replace(start, start_ns=events[0].submit + 1)
    v = validate_events(dup, [late, late])
    assert any("chunk 2: recorded more than once" in x for x in v)
    assert any("frames must be positive" in x for x in v)
    assert any("before session start" in x for x in v)
    assert any("session start recorded more than once" in x for x in v)


def test_merge_partial_records():
    a = ChunkEvent(session=0, epoch=1, chunk=2, frames=12, submit=1, dit_start=2, gpu_ms={"dit": 1.0})
    b = ChunkEvent(session=0, epoch=1, chunk=2, frames=12, decode_start=5, gpu_ms={"decode": 2.0}, blocked_ns={"vae": 7})
    m = merge(a, b)
    assert (m.submit, m.dit_start, m.decode_start) == (1, 2, 5)
    assert m.gpu_ms == {"dit": 1.0, "decode": 2.0} and m.blocked_ns == {"vae": 7}
    with pytest.raises(ValueError, match="recorded twice"):
        merge(a, msgspec.structs.replace(b, submit=3))
    with pytest.raises(ValueError, match="different chunks"):
        merge(a, msgspec.structs.replace(b, chunk=3))


def test_at_rejects_unknown_boundary():
    e = ChunkEvent(session=0, epoch=0, chunk=0, frames=9, submit=1)
    assert e.at("submit") == 1 and e.at("delivered") is None
    with pytest.raises(KeyError):
        e.at("frames")


def test_zero_frames_only_allowed_for_a_cancelled_chunk_that_never_reached_the_host():
    from harness.measure.events import ChunkEvent, validate_events

    dropped = ChunkEvent(session=0, epoch=1, chunk=3, frames=0, submit=10, dit_start=11, dit_end=12, cancelled=True)
    assert validate_events([dropped]) == []
    live = ChunkEvent(session=0, epoch=1, chunk=3, frames=0, submit=10, dit_start=11, dit_end=12)
    assert any("frames must be positive" in v for v in validate_events([live]))
    decoded = ChunkEvent(session=0, epoch=1, chunk=3, frames=0, submit=10, cpu_ready=20, cancelled=True)
    assert any("frames must be positive" in v for v in validate_events([decoded]))
