"""A small fragmented-MP4 writer for one H.264 video track: an init segment, then one movie
fragment (``moof`` + ``mdat``) per chunk.

Why not libavformat's mp4 muxer (what vLLM-Omni uses): with ``frag_every_frame`` it writes a
frame's fragment only when the *next* frame arrives, so every chunk's bytes end one frame short
(that frame leaves with the next chunk, the session's last one with the trailer) and a chunk
boundary on the wire is not a chunk boundary of the video. Here a chunk is written whole when
``write_fragment`` returns: the bytes of chunk k are exactly chunk k's frames, and the first
chunk's bytes start with the init segment (``ftyp`` + ``moov``), so the concatenation in order is
a playable file (ISO BMFF, ``default-base-is-moof`` fragments as MSE and DASH expect).

Timescale: ``fps`` ticks per second, one tick per frame, so decoders report pts = frame index
exactly. Samples are AVCC (4-byte NAL lengths); the encoder's Annex B output is converted here.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

_MATRIX = struct.pack(">9I", 0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000)
SYNC_SAMPLE = 0x02000000  # sample_depends_on = 2: an IDR, decodable alone
NON_SYNC_SAMPLE = 0x01010000  # depends on others, sample_is_non_sync_sample
_HIGH_PROFILES = {100, 110, 122, 144, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135}


def box(kind: bytes, *payload: bytes) -> bytes:
    body = b"".join(payload)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def full_box(kind: bytes, version: int, flags: int, *payload: bytes) -> bytes:
    return box(kind, struct.pack(">I", (version << 24) | flags), *payload)


def nal_units(annexb: bytes) -> list[bytes]:
    """Split an Annex B byte stream at its start codes (00 00 01, 00 00 00 01)."""
    data = bytes(annexb)
    starts, i = [], 0
    while (i := data.find(b"\x00\x00\x01", i)) >= 0:
        starts.append(i + 3)
        i += 3
    units = []
    for k, s in enumerate(starts):
        end = starts[k + 1] - 3 if k + 1 < len(starts) else len(data)
        unit = data[s:end]
        if k + 1 < len(starts) and unit.endswith(b"\x00"):
            unit = unit[:-1]  # the 4-byte start code's leading zero belongs to the next unit
        if unit:
            units.append(unit)
    return units


def avcc_sample(annexb: bytes) -> bytes:
    return b"".join(struct.pack(">I", len(u)) + u for u in nal_units(annexb))


def avc_config(extradata: bytes, chroma_format: int = 1, bit_depth: int = 8) -> bytes:
    """The ``avcC`` record from the encoder's global headers (Annex B SPS and PPS)."""
    units = nal_units(extradata) if extradata[:3] in (b"\x00\x00\x01", b"\x00\x00\x00") else []
    sps = [u for u in units if u[0] & 0x1F == 7]
    pps = [u for u in units if u[0] & 0x1F == 8]
    if not sps or not pps:
        raise ValueError("H.264 extradata holds no SPS/PPS (open the encoder with a global header)")
    profile, compat, level = sps[0][1], sps[0][2], sps[0][3]
    rec = struct.pack(">BBBBB", 1, profile, compat, level, 0xFC | 3) + bytes([0xE0 | len(sps)])
    rec += b"".join(struct.pack(">H", len(u)) + u for u in sps)
    rec += bytes([len(pps)]) + b"".join(struct.pack(">H", len(u)) + u for u in pps)
    if profile in _HIGH_PROFILES:
        rec += bytes([0xFC | chroma_format, 0xF8 | (bit_depth - 8), 0xF8 | (bit_depth - 8), 0])
    return rec


def init_segment(*, width: int, height: int, fps: int, avcc: bytes) -> bytes:
    ftyp = box(b"ftyp", b"isom", struct.pack(">I", 0x200), b"isomiso5iso6avc1mp41")
    mvhd = full_box(b"mvhd", 0, 0, struct.pack(">IIII", 0, 0, 1000, 0), struct.pack(">IH", 0x10000, 0x100),
                    bytes(10), _MATRIX, bytes(24), struct.pack(">I", 2))
    tkhd = full_box(b"tkhd", 0, 3, struct.pack(">IIIII", 0, 0, 1, 0, 0), bytes(8), struct.pack(">hhhH", 0, 0, 0, 0),
                    _MATRIX, struct.pack(">II", width << 16, height << 16))
    mdhd = full_box(b"mdhd", 0, 0, struct.pack(">IIIIHH", 0, 0, fps, 0, 0x55C4, 0))  # language "und"
    hdlr = full_box(b"hdlr", 0, 0, struct.pack(">I4s", 0, b"vide"), bytes(12), b"VideoHandler\x00")
    avc1 = box(b"avc1", bytes(6), struct.pack(">H", 1), bytes(16), struct.pack(">HHII", width, height, 0x480000, 0x480000),
               bytes(4), struct.pack(">H", 1), bytes(32), struct.pack(">Hh", 0x18, -1), box(b"avcC", avcc))
    stbl = box(b"stbl", full_box(b"stsd", 0, 0, struct.pack(">I", 1), avc1),
               full_box(b"stts", 0, 0, struct.pack(">I", 0)), full_box(b"stsc", 0, 0, struct.pack(">I", 0)),
               full_box(b"stsz", 0, 0, struct.pack(">II", 0, 0)), full_box(b"stco", 0, 0, struct.pack(">I", 0)))
    minf = box(b"minf", full_box(b"vmhd", 0, 1, bytes(8)),
               box(b"dinf", full_box(b"dref", 0, 0, struct.pack(">I", 1), full_box(b"url ", 0, 1))), stbl)
    trak = box(b"trak", tkhd, box(b"mdia", mdhd, hdlr, minf))
    mvex = box(b"mvex", full_box(b"trex", 0, 0, struct.pack(">IIIII", 1, 1, 1, 0, 0)))
    return ftyp + box(b"moov", mvhd, trak, mvex)


def fragment(sequence: int, first_frame: int, samples: Iterable[tuple[bytes, bool]]) -> bytes:
    """One ``moof`` + ``mdat`` holding consecutive frames ``(avcc sample, keyframe)``, each one
    tick long, the first at decode time ``first_frame``."""
    samples = list(samples)
    entries = b"".join(struct.pack(">II", len(s), SYNC_SAMPLE if key else NON_SYNC_SAMPLE) for s, key in samples)
    tfhd = full_box(b"tfhd", 0, 0x020008, struct.pack(">II", 1, 1))  # default-base-is-moof, default duration 1

    def moof(data_offset: int) -> bytes:
        trun = full_box(b"trun", 0, 0x000601, struct.pack(">Ii", len(samples), data_offset), entries)
        return box(b"moof", full_box(b"mfhd", 0, 0, struct.pack(">I", sequence)),
                   box(b"traf", tfhd, full_box(b"tfdt", 1, 0, struct.pack(">Q", first_frame)), trun))

    size = len(moof(0))
    return moof(size + 8) + box(b"mdat", *(s for s, _ in samples))
