"""The fragmented-MP4 container (``runtime.container fmp4``): lossless H.264 (libx264rgb, qp 0),
one movie fragment per chunk written whole when ``encode`` returns, the init segment first."""

from __future__ import annotations

import io
import subprocess

import av
import imageio_ffmpeg
import numpy as np
import pytest

from harness.errors import HarnessError
from harness.pipeline import fmp4
from harness.pipeline.encoder import make_encoder
from harness.pipeline.sinks import make_sink
from harness.workers.encoder_worker import open_sink

H, W, FPS = 64, 96, 16
CHUNKS = (9, 12, 12)


def _chunks(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for n in CHUNKS:  # noise (the hardest case for a codec) with a flat frame among it
        a = rng.integers(0, 256, (n, H, W, 3), dtype=np.uint8)
        a[1] = 200
        out.append(a)
    return out


def _decode(data: bytes):
    with av.open(io.BytesIO(data), format="mp4") as c:
        frames = list(c.decode(video=0))
        return [f.to_ndarray(format="rgb24") for f in frames], [f.pts for f in frames]


@pytest.fixture(scope="module")
def encoded():
    sink = make_sink("memory")
    enc = make_encoder("pyav", W, H, FPS, threads=2, container="fmp4")
    enc.open(sink)
    results = [enc.encode(c) for c in _chunks()]
    enc.close()
    sink.close()
    return results, [d for _, d in sink.fragments], sink.tail


def test_each_chunk_is_one_whole_fragment_committed_on_return(encoded):
    results, frags, tail = encoded
    assert [r.frames for r in results] == list(CHUNKS) and [r.packets for r in results] == list(CHUNKS)
    assert [r.bytes for r in results] == [len(f) for f in frags] and tail == b""
    assert all(r.delivered_ns is not None and r.delivered_ns >= r.encoded_ns for r in results)
    assert frags[0][4:8] == b"ftyp" and all(f[4:8] == b"moof" for f in frags[1:])
    ends = np.cumsum(CHUNKS)
    for k in range(1, len(CHUNKS) + 1):  # a prefix of fragments is a playable file of exactly its chunks
        assert len(_decode(b"".join(frags[:k]))[0]) == ends[k - 1]


def test_decoding_returns_the_input_bytes_and_frame_indices(encoded):
    _, frags, _ = encoded
    frames, pts = _decode(b"".join(frags))
    np.testing.assert_array_equal(np.stack(frames), np.concatenate(_chunks()))
    assert pts == list(range(sum(CHUNKS)))


def test_ffmpeg_reads_the_file_without_complaint(encoded, tmp_path):
    path = tmp_path / "s.mp4"
    path.write_bytes(b"".join(encoded[1]))
    run = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(path), "-f", "null", "-"],
                         capture_output=True, text=True)
    assert run.returncode == 0 and run.stderr == ""


def test_the_file_sink_names_the_container(tmp_path):
    enc = make_encoder("pyav", W, H, FPS, container="fmp4")
    sink = open_sink("file", tmp_path, 3, enc.SUFFIX)
    enc.open(sink)
    enc.encode(_chunks()[0])
    enc.close()
    sink.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["session3.mp4"]
    assert len(_decode((tmp_path / "session3.mp4").read_bytes())[0]) == CHUNKS[0]


def test_annex_b_start_codes_of_both_lengths_split_exactly():
    assert fmp4.nal_units(b"\x00\x00\x00\x01\x67\x01\x02\x00\x00\x01\x68\x03\x00\x00\x00\x01\x65\x04") == [
        b"\x67\x01\x02", b"\x68\x03", b"\x65\x04"]
    assert fmp4.avcc_sample(b"\x00\x00\x01\x65\xaa") == b"\x00\x00\x00\x02\x65\xaa"


def test_fmp4_is_pyavs_only():
    with pytest.raises(HarnessError, match="unknown encoder 'ffmpeg' for fmp4"):
        make_encoder("ffmpeg", W, H, container="fmp4")
    with pytest.raises(HarnessError, match="unknown container"):
        make_encoder("pyav", W, H, container="webm")
