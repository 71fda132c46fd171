"""Typed control messages between the driver, the worker ranks and the encoder stage.

Every message is a tagged msgspec struct sent as msgpack bytes over a local pipe; nothing is
pickled. Pixel frames never travel here: VAE rank 0 writes them into a shared-memory ring slot
and only the slot's metadata crosses the pipe. Latents are small (≈1.2 MB at 480×832) and travel
inline as raw float32 bytes.
"""

from __future__ import annotations

from typing import Union

import msgspec
import numpy as np

from harness.pipeline.ring import SlotRef


class _Msg(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    pass


class Tensor(msgspec.Struct, frozen=True):
    """A dense array as raw bytes (C order) — the wire form of latents."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @staticmethod
    def of(a: np.ndarray) -> "Tensor":
        a = np.ascontiguousarray(a)
        return Tensor(str(a.dtype), tuple(a.shape), a.tobytes())

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)


# ---- driver → workers ------------------------------------------------------------------
class StartSession(_Msg):
    session: int
    epoch: int
    seed: int
    prompt: str = ""
    #: the session's conditioning picture, (H, W, 3) uint8 RGB: made before the session starts, as a
    #: client's upload is (the driver's stand-in synthesises it from the seed); to the DiT ranks only
    image: Tensor | None = None


class GenerateChunk(_Msg):
    session: int
    chunk: int
    actions: list[str]


class DecodeChunk(_Msg):
    session: int
    epoch: int
    chunk: int
    latent: Tensor


class EndSession(_Msg):
    session: int


class Shutdown(_Msg):
    pass


class Ping(_Msg):
    sent_ns: int


# ---- workers → driver ------------------------------------------------------------------
class Ready(_Msg):
    role: str
    rank: int
    device: str
    device_name: str
    info: dict[str, str | int | float] = {}


class LatentReady(_Msg):
    session: int
    chunk: int
    latent: Tensor
    dit_start: int
    dit_end: int
    gpu_ms: dict[str, float] = {}


class FramesReady(_Msg):
    """VAE rank 0 published the chunk's uint8 frames (T,H,W,3) in the ring slot ``ref``."""

    session: int
    epoch: int
    chunk: int
    ref: SlotRef
    frames: int
    decode_start: int
    decode_end: int
    gpu_ready: int
    cpu_ready: int
    gpu_ms: dict[str, float] = {}
    blocked_ns: dict[str, int] = {}


class SessionEnded(_Msg):
    role: str
    session: int
    stats: dict[str, int] = {}


class Pong(_Msg):
    sent_ns: int
    recv_ns: int


class WorkerError(_Msg):
    role: str
    rank: int
    message: str


# ---- driver ↔ encoder stage ------------------------------------------------------------
class EncodeChunk(_Msg):
    frames: FramesReady
    save_pixels: bool
    discard: bool = False  # cancelled session: free the slot, encode nothing


class OpenSession(_Msg):
    session: int
    epoch: int


class SetSink(_Msg):
    """Sink for the next ``OpenSession`` of ``session`` instead of ``runtime.sink``: lets one
    launched topology serve a slow consumer for some sessions and a fast one for others."""

    session: int
    sink: str


class CloseSession(_Msg):
    session: int
    discard: bool = False  # cancelled sessions: remove the partial file rather than claim it valid


class ChunkDelivered(_Msg):
    session: int
    chunk: int
    received: int
    encoded: int | None  # None: discarded (cancelled session)
    delivered: int | None  # None when discarded, or when the backend commits a chunk only with the next one (ffmpeg)
    nbytes: int
    pixel_sha256: str
    frame_sha256: list[str]
    blocked_ns: dict[str, int] = {}
    media: bytes = b""  # the chunk's Matroska bytes, only when the sink streams them back (network)


class MediaClosed(_Msg):
    session: int
    path: str
    bytes: int
    discarded: bool


Message = Union[
    StartSession, GenerateChunk, DecodeChunk, EndSession, Shutdown, Ping,
    Ready, LatentReady, FramesReady, SessionEnded, Pong, WorkerError,
    EncodeChunk, OpenSession, CloseSession, ChunkDelivered, MediaClosed, SetSink,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode(raw: bytes) -> Message:
    return _decoder.decode(raw)


def send(conn, msg: _Msg) -> None:
    conn.send_bytes(_encoder.encode(msg))


def recv(conn) -> Message:
    return _decoder.decode(conn.recv_bytes())
