"""Both FFV1 backends: files decode (PyAV and the ffmpeg binary) to exactly the input frames,
with the right count and frame times; per-chunk commits; streaming fragments decode."""

from __future__ import annotations

import numpy as np
import pytest

from harness.errors import HarnessError
from harness.pipeline.decode import decode_ffmpeg, decode_pyav
from harness.pipeline.encoder import ENCODERS, make_encoder
from harness.pipeline.mkv import BlockCounter
from harness.pipeline.sinks import make_sink

H, W, FPS = 64, 128, 16
SIZES = (9, 12, 12)


@pytest.fixture(scope="module")
def chunks():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (n, H, W, 3), dtype=np.uint8) for n in SIZES]


def _encode(name, sink, chunks, fps=FPS):
    enc = make_encoder(name, W, H, fps=fps, threads=2)
    enc.open(sink)
    results = [enc.encode(c, chunk=i) for i, c in enumerate(chunks)]
    enc.close()
    return results


@pytest.mark.parametrize("backend", sorted(ENCODERS))
def test_file_roundtrip_exact_with_both_decoders(backend, chunks, tmp_path):
    sink = make_sink("file", directory=tmp_path / "media", session=3)
    results = _encode(backend, sink, chunks)
    sink.close()
    path = tmp_path / "media" / "session3.mkv"
    assert path.is_file() and not (tmp_path / "media" / "session3.mkv.part").exists()
    ref = np.concatenate(chunks)
    n = len(ref)
    for decode in (decode_pyav, decode_ffmpeg):
        d = decode(path)
        assert d.frames.shape == ref.shape, decode.__name__
        np.testing.assert_array_equal(d.frames, ref, err_msg=f"{backend} via {decode.__name__}")
        # Our muxer stores one tick per frame (time base 1/fps exactly); libavformat's stores ms.
        assert np.abs(d.seconds - np.arange(n) / FPS).max() <= (0 if backend == "pyav" else 0.0005 + 1e-9)
        if backend == "pyav":
            assert d.time_base == 1 / FPS and list(d.pts) == list(range(n))
    assert [(r.chunk, r.frames, r.first_frame) for r in results] == [(0, 9, 0), (1, 12, 9), (2, 12, 21)]
    assert [(r.chunk, r.frames) for r in sink.records] == [(0, 9), (1, 12), (2, 12)]
    assert all(r.encoded_ns > 0 for r in results)
    if ENCODERS[backend].exact_chunk_boundaries:
        assert [r.delivered_ns for r in results] == [r.accepted_ns for r in sink.records]
        assert all(r.delivered_ns >= r.encoded_ns for r in results)
        assert [r.bytes for r in results] == [r.bytes for r in sink.records]


def test_pyav_stream_fragments_decode_chunk_by_chunk(chunks, tmp_path):
    sink = make_sink("memory")  # not seekable: a live-style stream with no index
    _encode("pyav", sink, chunks)
    sink.close()
    assert [c for c, _ in sink.fragments] == [0, 1, 2] and sink.tail == b""
    prefix = b""
    for i, (_, frag) in enumerate(sink.fragments):
        prefix += frag
        p = tmp_path / f"upto{i}.mkv"
        p.write_bytes(prefix)
        d = decode_pyav(p)
        np.testing.assert_array_equal(d.frames, np.concatenate(chunks[:i + 1]))
    np.testing.assert_array_equal(decode_ffmpeg(p).frames, np.concatenate(chunks))


@pytest.mark.parametrize("backend", sorted(ENCODERS))
def test_null_sink_counts_and_block_counter(backend, chunks, tmp_path):
    null = make_sink("null")
    _encode(backend, null, chunks)
    mem = make_sink("memory")
    _encode(backend, mem, chunks)
    mem.close()
    data = mem.getvalue()
    assert null.bytes_written == len(data) > 0
    counter = BlockCounter()
    rng = np.random.default_rng(1)
    i = 0
    while i < len(data):  # arbitrary pieces, headers split across them
        step = int(rng.integers(1, 5000))
        counter.feed(data[i:i + step])
        i += step
    assert counter.blocks == sum(SIZES)


def test_non_integer_tick_rate_stays_within_rounding(tmp_path):
    rng = np.random.default_rng(2)
    frames = [rng.integers(0, 256, (12, H, W, 3), dtype=np.uint8) for _ in range(2)]
    sink = make_sink("file", directory=tmp_path, session=0)
    _encode("pyav", sink, frames, fps=24)
    sink.close()
    d = decode_pyav(sink.path)
    np.testing.assert_array_equal(d.frames, np.concatenate(frames))
    assert np.abs(d.seconds - np.arange(24) / 24).max() <= 0.00005


def test_bad_input_and_unknown_backend():
    with pytest.raises(HarnessError, match="unknown encoder"):
        make_encoder("x264", W, H)
    enc = make_encoder("pyav", W, H)
    enc.open(make_sink("null"))
    with pytest.raises(HarnessError, match="expects uint8"):
        enc.encode(np.zeros((2, H, W, 3), np.float32))
    with pytest.raises(HarnessError, match="expects uint8"):
        enc.encode(np.zeros((2, H + 8, W, 3), np.uint8))
    enc.close()


@pytest.mark.parametrize("backend", sorted(ENCODERS))
def test_abort_leaves_no_output_and_no_process(backend, chunks, tmp_path):
    sink = make_sink("file", directory=tmp_path, session=0)
    enc = make_encoder(backend, W, H)
    enc.open(sink)
    enc.encode(chunks[0])
    enc.abort()
    sink.abort()
    assert list(tmp_path.iterdir()) == []
    if backend == "ffmpeg":
        assert enc.proc.poll() is not None


def test_throttled_sink_backpressures_the_encoder(chunks):
    sink = make_sink("throttled", inner=make_sink("null"), frames_per_s=300)
    enc = make_encoder("pyav", W, H)
    enc.open(sink)
    results = [enc.encode(c, chunk=i) for i, c in enumerate(chunks)]
    enc.close()
    # encode() returns only once the slow consumer accepted the chunk: the producer is held back.
    span = (results[-1].delivered_ns - results[0].encoded_ns) / 1e9
    assert span >= sum(SIZES[1:]) / 300 and sink.blocked_ns > 0
