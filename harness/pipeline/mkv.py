"""A small streaming Matroska writer for one intra-only video track.

Why not libavformat's muxer: it keeps the current Cluster in memory until the *next* packet
arrives (or the trailer), so the last frame of every chunk would reach the sink only with the next
chunk, and ``delivered`` would lag by a whole chunk interval. It also fixes the timestamp scale at
1 ms, so 16 fps frame times come back rounded (0, 63, 125 ms…). Here every chunk becomes one
Cluster written in full when the chunk is done, and the timestamp scale is one frame period when
1e9 / fps is an integer, so decoders report pts = frame index in time base 1/fps exactly.

Layout: EBML header, Segment { [SeekHead] Info Tracks Cluster… [Cues] }. A seekable output gets
its Segment size, Duration, SeekHead and Cues patched in by ``finish``; a non-seekable one (a
network stream) is a live-style file with an unknown-size Segment, which every demuxer reads.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Protocol

# Element IDs (Matroska spec, IDs keep their length-marker bits).
EBML = 0x1A45DFA3
EBML_VERSION, EBML_READ_VERSION, EBML_MAX_ID, EBML_MAX_SIZE = 0x4286, 0x42F7, 0x42F2, 0x42F3
DOCTYPE, DOCTYPE_VERSION, DOCTYPE_READ_VERSION = 0x4282, 0x4287, 0x4285
SEGMENT, SEEKHEAD, SEEK, SEEK_ID, SEEK_POSITION = 0x18538067, 0x114D9B74, 0x4DBB, 0x53AB, 0x53AC
INFO, TIMESTAMP_SCALE, DURATION, MUXING_APP, WRITING_APP = 0x1549A966, 0x2AD7B1, 0x4489, 0x4D80, 0x5741
TRACKS, TRACK_ENTRY, TRACK_NUMBER, TRACK_UID, TRACK_TYPE = 0x1654AE6B, 0xAE, 0xD7, 0x73C5, 0x83
FLAG_LACING, CODEC_ID, CODEC_PRIVATE, DEFAULT_DURATION = 0x9C, 0x86, 0x63A2, 0x23E383
VIDEO, PIXEL_WIDTH, PIXEL_HEIGHT = 0xE0, 0xB0, 0xBA
CLUSTER, CLUSTER_TIMESTAMP, SIMPLE_BLOCK, BLOCK_GROUP = 0x1F43B675, 0xE7, 0xA3, 0xA0
CUES, CUE_POINT, CUE_TIME, CUE_TRACK_POSITIONS, CUE_TRACK, CUE_CLUSTER_POSITION = (
    0x1C53BB6B, 0xBB, 0xB3, 0xB7, 0xF7, 0xF1)
VOID = 0xEC

UNKNOWN_SIZE = b"\x01\xff\xff\xff\xff\xff\xff\xff"
_SEEKHEAD_RESERVE = 96  # room for three Seek entries, written over a Void at finish
_INT16 = (-(1 << 15), (1 << 15) - 1)


class Output(Protocol):
    def write(self, data, /) -> int | None: ...


def element_id(eid: int) -> bytes:
    return eid.to_bytes((eid.bit_length() + 7) // 8, "big")


def vint(n: int, length: int | None = None) -> bytes:
    """EBML data size; all-ones is reserved for 'unknown', hence the ``- 1``."""
    if length is None:
        length = 1
        while n >= (1 << (7 * length)) - 1:
            length += 1
    if length > 8 or n >= (1 << (7 * length)) - 1:
        raise ValueError(f"EBML size {n} does not fit {length} bytes")
    return ((1 << (7 * length)) | n).to_bytes(length, "big")


def element(eid: int, payload: bytes) -> bytes:
    return element_id(eid) + vint(len(payload)) + payload


def uint_el(eid: int, v: int) -> bytes:
    return element(eid, v.to_bytes(max(1, (v.bit_length() + 7) // 8), "big"))


def str_el(eid: int, s: str) -> bytes:
    return element(eid, s.encode())


def float_el(eid: int, v: float) -> bytes:
    return element(eid, struct.pack(">d", v))


def void_el(total: int) -> bytes:
    """A Void element occupying exactly ``total`` bytes (≥ 9, 8-byte size field)."""
    return element_id(VOID) + vint(total - 9, 8) + bytes(total - 9)


def timestamp_scale(fps: int) -> tuple[int, int]:
    """(ns per tick, ticks per frame): one tick per frame when exact, else 0.1 ms ticks."""
    if 10**9 % fps == 0:
        return 10**9 // fps, 1
    return 100_000, 0


class MatroskaWriter:
    """Writes the header on ``write_header``, one Cluster per ``write_cluster`` call (a chunk),
    and the index/patches on ``finish``. Frames are numbered by the caller (0, 1, 2… within the
    file); their timestamps follow from the frame rate."""

    def __init__(self, out: Output, *, codec_id: str, width: int, height: int, fps: int,
                 codec_private: bytes = b"", seekable: bool | None = None, app: str = "harness") -> None:
        self.out = out
        self.codec_id, self.codec_private = codec_id, codec_private
        self.width, self.height, self.fps, self.app = width, height, fps, app
        if seekable is None:
            probe = getattr(out, "seekable", None)
            seekable = bool(probe and probe() and hasattr(out, "seek") and hasattr(out, "tell"))
        self.seekable = seekable
        self.scale_ns, self._ticks_per_frame = timestamp_scale(fps)
        self.bytes_written = 0
        self.frames = 0
        self._cues: list[tuple[int, int]] = []  # (cluster timestamp, offset in segment)
        self._pos = 0  # our own count, so the output needs no tell() when it is a stream
        self._segment_size_at = self._segment_data_at = self._seekhead_at = self._duration_at = -1
        self._finished = False

    def ticks(self, frame: int) -> int:
        if self._ticks_per_frame:
            return frame * self._ticks_per_frame
        return (2 * frame * 10**9 + self.fps * self.scale_ns) // (2 * self.fps * self.scale_ns)

    def _write(self, data) -> None:
        self.out.write(data)
        n = memoryview(data).nbytes
        self._pos += n
        self.bytes_written += n

    def write_header(self) -> int:
        start = self.bytes_written
        self._write(element(EBML, b"".join([
            uint_el(EBML_VERSION, 1), uint_el(EBML_READ_VERSION, 1), uint_el(EBML_MAX_ID, 4),
            uint_el(EBML_MAX_SIZE, 8), str_el(DOCTYPE, "matroska"), uint_el(DOCTYPE_VERSION, 4),
            uint_el(DOCTYPE_READ_VERSION, 2)])))
        self._write(element_id(SEGMENT))
        self._segment_size_at = self._pos
        self._write(UNKNOWN_SIZE)  # patched by finish() when the output can seek
        self._segment_data_at = self._pos
        if self.seekable:
            self._seekhead_at = self._pos
            self._write(void_el(_SEEKHEAD_RESERVE))
        info = [uint_el(TIMESTAMP_SCALE, self.scale_ns), str_el(MUXING_APP, self.app), str_el(WRITING_APP, self.app)]
        info_el = element(INFO, b"".join(info + ([float_el(DURATION, 0.0)] if self.seekable else [])))
        self._info_at = self._pos
        if self.seekable:
            # Duration is the last child: its 8 float bytes end the Info element.
            self._duration_at = self._pos + len(info_el) - 8
        self._write(info_el)
        video = element(VIDEO, uint_el(PIXEL_WIDTH, self.width) + uint_el(PIXEL_HEIGHT, self.height))
        entry = [uint_el(TRACK_NUMBER, 1), uint_el(TRACK_UID, 1), uint_el(TRACK_TYPE, 1),
                 uint_el(FLAG_LACING, 0), str_el(CODEC_ID, self.codec_id)]
        if self.codec_private:
            entry.append(element(CODEC_PRIVATE, bytes(self.codec_private)))
        entry += [uint_el(DEFAULT_DURATION, round(1e9 / self.fps)), video]
        self._tracks_at = self._pos
        self._write(element(TRACKS, element(TRACK_ENTRY, b"".join(entry))))
        return self.bytes_written - start

    def write_cluster(self, packets: Iterable, first_frame: int | None = None) -> int:
        """Write consecutive frames' packets (bytes-like, all keyframes) as one Cluster, or as
        several when the relative int16 block timestamps would overflow. Returns bytes written."""
        if self._finished:
            raise RuntimeError("write_cluster after finish")
        if first_frame is not None and first_frame != self.frames:
            raise ValueError(f"frames must be consecutive: expected {self.frames}, got {first_frame}")
        start = self.bytes_written
        pending: list[memoryview] = [memoryview(p).cast("B") for p in packets]
        while pending:
            base = self.ticks(self.frames)
            n = 1
            while n < len(pending) and self.ticks(self.frames + n) - base <= _INT16[1]:
                n += 1
            group, pending = pending[:n], pending[n:]
            heads = []
            for i, data in enumerate(group):
                rel = self.ticks(self.frames + i) - base
                block_head = b"\x81" + struct.pack(">hB", rel, 0x80)
                heads.append(element_id(SIMPLE_BLOCK) + vint(len(block_head) + data.nbytes) + block_head)
            ts = uint_el(CLUSTER_TIMESTAMP, base)
            size = len(ts) + sum(len(h) + d.nbytes for h, d in zip(heads, group))
            if self.seekable:
                self._cues.append((base, self._pos - self._segment_data_at))
            self._write(element_id(CLUSTER) + vint(size) + ts)
            for h, d in zip(heads, group):
                self._write(h)
                self._write(d)
            self.frames += n
        return self.bytes_written - start

    def finish(self) -> int:
        """Write Cues and patch sizes/duration/SeekHead when seekable. Returns bytes appended."""
        if self._finished:
            return 0
        self._finished = True
        if not self.seekable:
            return 0
        start = self.bytes_written
        cues_at = self._pos
        points = [element(CUE_POINT, uint_el(CUE_TIME, t) + element(
            CUE_TRACK_POSITIONS, uint_el(CUE_TRACK, 1) + uint_el(CUE_CLUSTER_POSITION, off)))
            for t, off in self._cues]
        if points:
            self._write(element(CUES, b"".join(points)))
        end = self._pos
        rel = lambda at: at - self._segment_data_at  # noqa: E731
        seeks = [(INFO, self._info_at), (TRACKS, self._tracks_at)] + ([(CUES, cues_at)] if points else [])
        seekhead = element(SEEKHEAD, b"".join(
            element(SEEK, element(SEEK_ID, element_id(eid)) + uint_el(SEEK_POSITION, rel(at)))
            for eid, at in seeks))
        seekhead += void_el(_SEEKHEAD_RESERVE - len(seekhead))
        for at, data in [(self._segment_size_at, vint(end - self._segment_data_at, 8)),
                         (self._seekhead_at, seekhead),
                         (self._duration_at, struct.pack(">d", float(self.ticks(self.frames))))]:
            self.out.seek(at)
            self.out.write(data)
        self.out.seek(end)
        return self.bytes_written - start


class BlockCounter:
    """Counts complete (Simple)Blocks in a Matroska byte stream fed piece by piece, without
    buffering block payloads: used to learn which frames another muxer has emitted so far."""

    _DESCEND = {SEGMENT, CLUSTER}

    def __init__(self) -> None:
        self.blocks = 0
        self._head = bytearray()
        self._skip = 0
        self._in_block = False

    def feed(self, data) -> int:
        mv = memoryview(data).cast("B")
        before = self.blocks
        i, n = 0, mv.nbytes
        while i < n:
            if self._skip:
                take = min(self._skip, n - i)
                self._skip -= take
                i += take
                if not self._skip and self._in_block:
                    self.blocks += 1
                    self._in_block = False
                continue
            self._head.append(mv[i])
            i += 1
            parsed = _parse_header(self._head)
            if parsed is None:
                continue
            eid, size = parsed
            self._head.clear()
            if eid in self._DESCEND:
                continue
            self._in_block = eid in (SIMPLE_BLOCK, BLOCK_GROUP)
            if size is None:
                raise ValueError(f"unknown-size element {eid:#x} outside Segment/Cluster")
            self._skip = size
            if not size and self._in_block:
                self.blocks += 1
                self._in_block = False
        return self.blocks - before


def _vint_len(first: int) -> int:
    for length in range(1, 9):
        if first & (0x80 >> (length - 1)):
            return length
    raise ValueError("invalid EBML variable-length integer")


def _parse_header(buf: bytearray) -> tuple[int, int | None] | None:
    """(id, size or None for unknown) once ``buf`` holds a complete element header."""
    id_len = _vint_len(buf[0])
    if len(buf) < id_len + 1:
        return None
    size_len = _vint_len(buf[id_len])
    if len(buf) < id_len + size_len:
        return None
    eid = int.from_bytes(buf[:id_len], "big")
    raw = int.from_bytes(buf[id_len:id_len + size_len], "big") & ((1 << (7 * size_len)) - 1)
    return eid, None if raw == (1 << (7 * size_len)) - 1 else raw
