"""The encoder stage: uint8 RGB chunks (T, H, W, 3) in, lossless video out, written into a sink.
One interface; per container (``runtime.container``) a registry of backends. Matroska carries
FFV1 (level 3):

- ``pyav``: libavcodec's FFV1 in-process through PyAV, muxed by ``mkv.MatroskaWriter`` — one
  Cluster per chunk, written and committed when ``encode`` returns, timestamps exact at 1/fps.
- ``ffmpeg``: an ffmpeg subprocess (ffmpeg-python building the command line, the imageio-ffmpeg
  binary running it), rawvideo rgb24 on stdin, FFV1/Matroska on stdout relayed into the sink by a
  thread. Its muxer is libavformat's: frame times are rounded to 1 ms, and it holds each chunk's
  last frame until the next packet arrives, so a chunk is committed to the sink only when the next
  chunk starts (or at close) — ``exact_chunk_boundaries`` is False and ``ChunkEncoded`` says so.

Pixel format: the codec is fed ``bgr0`` (packed B, G, R, pad). It is the only 8-bit RGB layout
FFV1 accepts (``gbrp`` starts at 9 bits); FFV1 codes it with its reversible colour transform, and
rgb24 ↔ bgr0 is a byte shuffle, so decoding back to rgb24 returns the input bytes exactly.

Fragmented MP4 (``fmp4``, what vLLM-Omni's realtime API sends) carries lossless H.264 from PyAV
(``PyavFmp4Encoder``): one movie fragment per chunk, the first with the init segment.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import ClassVar

import msgspec
import numpy as np

from harness.errors import HarnessError
from harness.pipeline import fmp4
from harness.pipeline.mkv import BlockCounter, MatroskaWriter
from harness.pipeline.sinks import Sink

PIX_FMT = "bgr0"


def default_slices(threads: int) -> int:
    """FFV1 threads work per slice and the encoder's own default is 4 slices (2×2) whatever
    the thread count; give it the smallest legal layout (v×h, v ≤ h < 2v) with a slice per
    thread. More slices cost a little compression (contexts restart per slice)."""
    legal = sorted(v * h for v in range(2, 7) for h in range(v, 2 * v))
    return next((n for n in legal if n >= threads), legal[-1])


class ChunkEncoded(msgspec.Struct, frozen=True):
    """What ``encode`` did for one chunk. ``delivered_ns`` is the sink's acceptance time when the
    chunk was already committed on return (always for ``pyav``); otherwise None and the sink's
    ``records`` get it later."""
    chunk: int
    frames: int
    first_frame: int  # index (= pts at 1/fps) of the chunk's first frame in the file
    packets: int
    bytes: int  # container bytes that reached the sink during this call (chunk 0: header too)
    encoded_ns: int  # all the chunk's FFV1 packets exist
    delivered_ns: int | None


class Encoder(ABC):
    name: ClassVar[str]
    exact_chunk_boundaries: ClassVar[bool]
    SUFFIX: ClassVar[str] = ".mkv"  # the container's file name extension

    def __init__(self, width: int, height: int, fps: int = 16, threads: int = 1, **options) -> None:
        if width <= 0 or height <= 0 or fps <= 0:
            raise HarnessError(f"bad encoder geometry {width}x{height} at {fps} fps")
        self.width, self.height, self.fps = width, height, fps
        self.threads = threads if threads > 0 else (os.cpu_count() or 1)
        self.options = {k: str(v) for k, v in {**self.default_options(), **options}.items()}
        self.sink: Sink | None = None
        self.frames_in = 0
        self.chunks = 0
        self._closed = False

    def _check(self, frames: np.ndarray) -> np.ndarray:
        if self.sink is None:
            raise RuntimeError(f"{self.name} encoder is not open")
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[1:] != (self.height, self.width, 3):
            raise HarnessError(f"encoder expects uint8 (T, {self.height}, {self.width}, 3), "
                               f"got {frames.dtype} {tuple(frames.shape)}")
        return frames

    def default_options(self) -> dict:
        return {"slices": default_slices(self.threads)}

    @abstractmethod
    def open(self, sink: Sink) -> None: ...

    @abstractmethod
    def encode(self, frames: np.ndarray, chunk: int | None = None) -> ChunkEncoded: ...

    @abstractmethod
    def close(self) -> None:
        """Flush, finalise the container. The sink stays open: whoever opened it closes it."""

    def abort(self) -> None:
        """Stop without finalising (cancel): the output is incomplete; abort the sink too."""
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        self.abort() if exc_type else self.close()


class PyavEncoder(Encoder):
    name = "pyav"
    exact_chunk_boundaries = True
    #: the codec's keyframe interval (None: libavcodec's default)
    GOP: int | None = None

    def open(self, sink: Sink) -> None:
        import av  # on open: the command line imports this registry, and hosts without PyAV run everything else

        self._av = av
        cc = self._cc = self._context()
        self.sink = sink
        self._mkv = MatroskaWriter(sink, codec_id="V_FFV1", codec_private=bytes(cc.extradata or b""),
                                   width=self.width, height=self.height, fps=self.fps)
        self._mkv.write_header()
        self._committed = 0

    def _context_threads(self) -> int:
        return self.threads

    def _context(self):
        cc = self._av.CodecContext.create("ffv1", "w")
        cc.width, cc.height, cc.pix_fmt = self.width, self.height, PIX_FMT
        cc.time_base = Fraction(1, self.fps)
        cc.framerate = Fraction(self.fps)
        cc.thread_type = "SLICE"  # FFV1 has only slice threads; no frame delay
        cc.thread_count = self._context_threads()
        if self.GOP is not None:
            cc.gop_size = self.GOP
        cc.options = {"level": "3", **self.options}
        cc.open()
        return cc

    def _frame(self, rgb: np.ndarray):
        # Shuffle straight into the codec frame's plane: no swscale pass, no intermediate array.
        vf = self._av.VideoFrame(self.width, self.height, PIX_FMT)
        plane = vf.planes[0]
        dst = np.frombuffer(plane, np.uint8).reshape(self.height, plane.line_size)[:, :self.width * 4]
        dst = dst.reshape(self.height, self.width, 4)
        dst[..., 0], dst[..., 1], dst[..., 2], dst[..., 3] = rgb[..., 2], rgb[..., 1], rgb[..., 0], 0
        return vf

    def encode(self, frames: np.ndarray, chunk: int | None = None) -> ChunkEncoded:
        frames = self._check(frames)
        chunk = self.chunks if chunk is None else chunk
        first = self.frames_in
        packets = self._packets(frames, first)
        self.frames_in += len(frames)
        if len(packets) != len(frames):
            # An encoder with delay would make the chunk boundary a lie; FFV1 has none.
            raise HarnessError(f"ffv1 returned {len(packets)} packets for {len(frames)} frames")
        encoded = time.monotonic_ns()
        self._mkv.write_cluster(packets, first_frame=first)
        delivered = self.sink.commit(chunk, len(frames))
        nbytes, self._committed = self._mkv.bytes_written - self._committed, self._mkv.bytes_written
        self.chunks += 1
        return ChunkEncoded(chunk, len(frames), first, len(packets), nbytes, encoded, delivered)

    def _packets(self, frames: np.ndarray, first: int) -> list:
        packets = []
        for i, rgb in enumerate(frames):
            vf = self._frame(rgb)
            vf.pts = first + i
            packets += self._cc.encode(vf)
        return packets

    def _flush(self) -> list:
        return self._cc.encode(None)

    def close(self) -> None:
        if self.sink is None or self._closed:
            return
        self._closed = True
        tail = self._flush()
        if tail:
            raise HarnessError(f"ffv1 held back {len(tail)} packets")
        self._mkv.finish()
        self.sink.flush()


class PyavFramesEncoder(PyavEncoder):
    """FFV1 through PyAV with a chunk's frames coded side by side: ``threads`` codec contexts of
    one thread each, every frame a keyframe (GOP 1), so any context can code any frame, and the
    packets muxed in frame order into one stream (the contexts' settings are the same, so is their
    extradata: checked at open). Slice threads share out one frame at a time and meet at every
    frame's end, and the encode lies on a first chunk's path to its delivery. Measured (12-frame
    480×832 chunks, docs/results gpu-batch20): level with 16 slice threads on one H200 host (43.3
    against 44.4 ms a chunk), no resolvable difference served. PyAV releases the GIL while a frame
    is coded, so plain threads run in parallel."""

    name = "pyav-frames"
    GOP = 1

    def default_options(self) -> dict:
        return {"slices": 4}  # one thread a context: slices only cost compression

    def open(self, sink: Sink) -> None:
        super().open(sink)  # the first context: its extradata is the stream's
        self._ccs = [self._cc] + [self._context() for _ in range(self.threads - 1)]
        for cc in self._ccs[1:]:
            if bytes(cc.extradata or b"") != bytes(self._cc.extradata or b""):
                raise HarnessError("ffv1 contexts with the same settings gave different extradata")
        self._pool = ThreadPoolExecutor(len(self._ccs), thread_name_prefix="ffv1")

    def _context_threads(self) -> int:
        return 1  # ``threads`` is the number of contexts

    def _packets(self, frames: np.ndarray, first: int) -> list:
        n = len(self._ccs)

        def code(k: int) -> list:
            out = []
            for i in range(k, len(frames), n):
                vf = self._frame(frames[i])
                vf.pts = first + i
                out += self._ccs[k].encode(vf)
            return out

        packets = [p for ps in self._pool.map(code, range(min(n, len(frames)))) for p in ps]
        return sorted(packets, key=lambda p: p.pts)

    def _flush(self) -> list:
        self._pool.shutdown()
        return [p for cc in self._ccs for p in cc.encode(None)]

    def abort(self) -> None:
        if hasattr(self, "_pool"):
            self._pool.shutdown(wait=True)
        super().abort()


class FfmpegEncoder(Encoder):
    name = "ffmpeg"
    exact_chunk_boundaries = False

    def open(self, sink: Sink) -> None:
        import ffmpeg  # on open: hosts without the ffmpeg packages run everything else
        import imageio_ffmpeg

        out_opts = {"format": "matroska", "vcodec": "ffv1", "level": 3, "pix_fmt": PIX_FMT,
                    "threads": self.threads, "fps_mode": "passthrough", "flush_packets": 1,
                    "cluster_size_limit": 1, **self.options}
        cmd = (ffmpeg.input("pipe:0", format="rawvideo", pix_fmt="rgb24", s=f"{self.width}x{self.height}",
                            framerate=self.fps)
               .output("pipe:1", **out_opts)
               .global_args("-hide_banner", "-nostats", "-loglevel", "error")
               .compile(cmd=imageio_ffmpeg.get_ffmpeg_exe()))
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, bufsize=0)
        self.sink = sink
        self._counter = BlockCounter()
        self._cv = threading.Condition()
        self._pending: list[tuple[int, int, int]] = []  # (chunk, frames, cumulative frames at its end)
        self._relay_error: BaseException | None = None
        self._eof = False
        self._stderr = bytearray()
        self._relay = threading.Thread(target=self._relay_stdout, name="ffmpeg-relay", daemon=True)
        self._errt = threading.Thread(target=self._drain_stderr, name="ffmpeg-stderr", daemon=True)
        self._relay.start()
        self._errt.start()

    def _relay_stdout(self) -> None:
        fd = self.proc.stdout.fileno()
        try:
            while True:
                data = os.read(fd, 1 << 20)
                if not data:
                    break
                self.sink.write(data)
                if self._counter.feed(data):
                    self._commit_ready()
        except BaseException as e:  # surfaced to the caller by encode()/close()
            self._relay_error = e
            # Nobody drains stdout any more: stop ffmpeg so a blocked stdin write fails fast.
            self.proc.kill()
        finally:
            with self._cv:
                self._eof = True
                self._cv.notify_all()

    def _commit_ready(self) -> None:
        with self._cv:
            while self._pending and self._counter.blocks >= self._pending[0][2]:
                chunk, frames, _ = self._pending.pop(0)
                self.sink.commit(chunk, frames)
            self._cv.notify_all()

    def _drain_stderr(self) -> None:
        for line in iter(self.proc.stderr.readline, b""):
            self._stderr += line
            del self._stderr[:-8192]

    def _fail(self, what: str) -> HarnessError:
        tail = self._stderr.decode(errors="replace").strip().splitlines()
        why = tail[-1] if tail else (repr(self._relay_error) if self._relay_error else f"exit {self.proc.poll()}")
        return HarnessError(f"ffmpeg encoder {what}: {why}")

    def encode(self, frames: np.ndarray, chunk: int | None = None, timeout: float = 600.0) -> ChunkEncoded:
        frames = np.ascontiguousarray(self._check(frames))
        chunk = self.chunks if chunk is None else chunk
        first = self.frames_in
        before = self.sink.bytes_written
        with self._cv:
            self._pending.append((chunk, len(frames), first + len(frames)))
        try:
            self.proc.stdin.write(memoryview(frames).cast("B"))  # blocks while ffmpeg lags: backpressure
        except (BrokenPipeError, OSError):
            raise self._fail("died") from None
        self.frames_in += len(frames)
        self.chunks += 1
        # libavformat's Matroska muxer emits frame k only once frame k+1 arrives, so the most we
        # can wait for is all but the chunk's last frame.
        want = self.frames_in - 1
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._counter.blocks < want:
                if self._eof or self._relay_error is not None:
                    raise self._fail("stopped")
                if not self._cv.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
                    if time.monotonic() >= deadline:
                        raise self._fail(f"timed out after {timeout:.0f}s")
                    if self.proc.poll() not in (None, 0):
                        raise self._fail("died")
        encoded = time.monotonic_ns()
        done = next((r.accepted_ns for r in reversed(self.sink.records) if r.chunk == chunk), None)
        return ChunkEncoded(chunk, len(frames), first, len(frames), self.sink.bytes_written - before,
                            encoded, done)

    def close(self, timeout: float = 60.0) -> None:
        if self.sink is None or self._closed:
            return
        self._closed = True
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise self._fail(f"did not finish within {timeout:.0f}s") from None
        self._relay.join()
        self._errt.join()
        if rc != 0 or self._relay_error is not None:
            raise self._fail("failed")
        if self._pending:
            raise HarnessError(f"ffmpeg encoder emitted {self._counter.blocks} of {self.frames_in} frames")
        self.sink.flush()

    def abort(self) -> None:
        if self.sink is None or self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._relay.join()
        self._errt.join()


class PyavFmp4Encoder(Encoder):
    """H.264 in fragmented MP4, the media vLLM-Omni's realtime API sends, made lossless:
    ``libx264rgb`` codes the rgb24 input itself (High 4:4:4 Predictive, no YUV conversion) at
    ``qp 0``, which is x264's lossless mode, so decoding back to rgb24 returns the input bytes
    exactly. ``tune zerolatency`` removes the lookahead and B-frames: one packet per frame on
    return, so a chunk's fragment is complete when ``encode`` returns (``fmp4``'s own muxer writes
    it whole). Production encodes yuv420p at crf 18 instead: lossy by design."""

    name = "pyav"
    exact_chunk_boundaries = True
    CODEC = "libx264rgb"
    SUFFIX = ".mp4"

    def default_options(self) -> dict:
        return {}  # x264 picks its own slicing for zerolatency's slice threads

    def open(self, sink: Sink) -> None:
        import av  # on open: the command line imports this registry, and hosts without PyAV run everything else

        cc = av.CodecContext.create(self.CODEC, "w")
        cc.width, cc.height, cc.pix_fmt = self.width, self.height, "rgb24"
        cc.time_base = Fraction(1, self.fps)
        cc.framerate = Fraction(self.fps)
        cc.flags |= av.codec.context.Flags.global_header  # SPS/PPS in extradata, for the init segment's avcC
        cc.thread_count = self.threads
        cc.options = {"qp": "0", "preset": "ultrafast", "tune": "zerolatency", **self.options}
        cc.open()
        self._cc, self._av = cc, av
        self.sink = sink
        self._head = fmp4.init_segment(width=self.width, height=self.height, fps=self.fps,
                                       avcc=fmp4.avc_config(bytes(cc.extradata or b""), chroma_format=3))

    def encode(self, frames: np.ndarray, chunk: int | None = None) -> ChunkEncoded:
        frames = self._check(frames)
        chunk = self.chunks if chunk is None else chunk
        first = self.frames_in
        samples = []
        for rgb in frames:
            vf = self._av.VideoFrame.from_ndarray(rgb, format="rgb24")
            vf.pts = self.frames_in
            samples += [(fmp4.avcc_sample(bytes(p)), bool(p.is_keyframe)) for p in self._cc.encode(vf)]
            self.frames_in += 1
        if len(samples) != len(frames):
            raise HarnessError(f"{self.CODEC} returned {len(samples)} packets for {len(frames)} frames (encoder delay)")
        encoded = time.monotonic_ns()
        data = self._head + fmp4.fragment(self.chunks + 1, first, samples)
        self._head = b""
        self.sink.write(data)
        delivered = self.sink.commit(chunk, len(frames))
        self.chunks += 1
        return ChunkEncoded(chunk, len(frames), first, len(samples), len(data), encoded, delivered)

    def close(self) -> None:
        if self.sink is None or self._closed:
            return
        self._closed = True
        if self._head:  # no chunk: the file is still a valid, empty movie
            self.sink.write(self._head)
        tail = self._cc.encode(None)
        if tail:
            raise HarnessError(f"{self.CODEC} held back {len(tail)} packets")
        self.sink.flush()


ENCODERS: dict[str, type[Encoder]] = {c.name: c for c in (PyavEncoder, PyavFramesEncoder, FfmpegEncoder)}
#: the container (and its codec) per ``runtime.container``: Matroska carries FFV1 from either
#: backend, fragmented MP4 carries lossless H.264 from PyAV
CONTAINERS: dict[str, dict[str, type[Encoder]]] = {"matroska": ENCODERS, "fmp4": {"pyav": PyavFmp4Encoder}}


def encoder_class(name: str, container: str = "matroska") -> type[Encoder]:
    """The encoder named ``name`` for ``container``, or one line naming the known ones (callable before launch)."""
    known = CONTAINERS.get(container)
    if known is None:
        raise HarnessError(f"unknown container {container!r} (known: {', '.join(sorted(CONTAINERS))})")
    try:
        return known[name]
    except KeyError:
        raise HarnessError(f"unknown encoder {name!r} for {container} (known: {', '.join(sorted(known))})") from None


def make_encoder(name: str, width: int, height: int, fps: int = 16, threads: int = 1, container: str = "matroska",
                 **options) -> Encoder:
    """``options`` are codec options passed through (e.g. FFV1's ``slices=4``, ``context=1``)."""
    return encoder_class(name, container)(width, height, fps, threads, **options)
