"""Sinks: throttling limits the rate by blocking the writer; unwritable output is a clear error;
a file only appears under its final name once finished."""

from __future__ import annotations

import time

import pytest

from harness.errors import HarnessError
from harness.pipeline.sinks import ensure_writable_dir, make_sink


def test_throttled_frames_per_second():
    sink = make_sink("throttled", inner=make_sink("null"), frames_per_s=200)
    t0 = time.monotonic_ns()
    for chunk in range(5):
        sink.write(b"x" * 100)
        sink.commit(chunk, 12)
    elapsed = (time.monotonic_ns() - t0) / 1e9
    assert elapsed >= 60 / 200  # never faster than the limit
    stamps = [r.accepted_ns for r in sink.records]
    rates = [12 / ((b - a) / 1e9) for a, b in zip(stamps, stamps[1:])]
    assert max(rates) <= 200 * 1.001
    assert sink.blocked_ns > 0.25e9
    assert [r.frames for r in sink.inner.records] == [12] * 5


def test_throttled_bytes_per_second(tmp_path):
    inner = make_sink("file", directory=tmp_path, session=0)
    sink = make_sink("throttled", inner=inner, bytes_per_s=2_000_000)
    t0 = time.monotonic()
    for chunk in range(4):
        sink.write(b"\0" * 100_000)
        sink.commit(chunk, 1)
    elapsed = time.monotonic() - t0
    sink.close()
    assert elapsed >= 400_000 / 2_000_000
    assert (tmp_path / "session0.mkv").stat().st_size == 400_000
    assert sum(r.bytes for r in sink.records) == 400_000


def test_throttled_needs_a_rate():
    with pytest.raises(HarnessError):
        make_sink("throttled", inner=make_sink("null"))


def test_unwritable_directory_is_one_line_error(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    with pytest.raises(HarnessError) as e:
        make_sink("file", directory=blocker / "media", session=0)
    msg = str(e.value)
    assert "not writable" in msg and "\n" not in msg and str(blocker) in msg
    with pytest.raises(HarnessError):
        ensure_writable_dir("/proc/harness-test")


def test_file_sink_commit_close_and_abort(tmp_path):
    sink = make_sink("file", directory=tmp_path, session=1)
    sink.write(b"abc")
    t = sink.commit(0, 3)
    assert sink.records[0].accepted_ns == t and sink.records[0].bytes == 3
    assert sink.part_path.read_bytes() == b"abc"  # flushed to the OS at commit
    assert not sink.path.exists()
    sink.close()
    assert sink.path.read_bytes() == b"abc" and not sink.part_path.exists()

    aborted = make_sink("file", directory=tmp_path, session=2)
    aborted.write(b"half")
    aborted.abort()
    assert not aborted.path.exists() and not aborted.part_path.exists()


def test_unknown_sink():
    with pytest.raises(HarnessError, match="unknown sink"):
        make_sink("websocket")
