"""Encoder stage process: ring slot → one container per session (FFV1/Matroska, or lossless
H.264 in fragmented MP4: ``runtime.container``) → sink.

``received`` is stamped when this process holds the slot metadata (the frames crossed a process
boundary), ``encoded`` once the chunk's packets exist, ``delivered`` when the sink accepted the
bytes. Per-frame SHA-256 digests are taken here, off the critical path, so that scenarios can
prove every frame arrived exactly once and in order.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec

from harness.errors import HarnessError
from harness.hooks import context as hctx
from harness.measure.clock import now
from harness.measure.gates import save_pixels
from harness.pipeline import messages as M
from harness.pipeline.encoder import make_encoder
from harness.pipeline.ring import FrameRing, RingSpec
from harness.pipeline.sinks import MAX_THROTTLE_FPS, MIN_THROTTLE_FPS, make_sink, throttle_fps_ok
from harness.workers.common import WorkerSpec, hooks_on, process_setup, reported_errors


def main(spec: WorkerSpec, conn) -> None:
    process_setup(spec)
    ring = None
    try:
        with reported_errors("encoder", 0, conn):
            ring = FrameRing.attach(msgspec.convert(spec.ring, RingSpec))
            with hooks_on(spec, "encoder"):
                _serve(spec, conn, ring)
    finally:
        if ring is not None:
            ring.close()


class _Open:
    def __init__(self, encoder, sink, path: Path | None):
        self.encoder, self.sink, self.path = encoder, sink, path

    def take_fragment(self) -> bytes:
        """The stream sink's bytes committed since the last call (b"" for the other sinks)."""
        frags = getattr(self.sink, "fragments", None)
        if not frags:
            return b""
        data = b"".join(d for _, d in frags)
        frags.clear()
        return data


SINK_SPECS = ("file", "null", "stream", "throttled:FPS")


def check_sink_spec(spec: str) -> str:
    """One-line HarnessError for a sink spec the encoder stage would refuse — callable before
    launch, so a typo fails in the driver rather than as a dead encoder process."""
    name, _, arg = spec.partition(":")
    if name in ("file", "null", "stream") and not arg:
        return spec
    if name == "throttled":
        try:
            fps = float(arg)
        except ValueError:
            fps = float("nan")
        if throttle_fps_ok(fps):
            return spec
        raise HarnessError(f"sink {spec!r}: throttled needs a frames/s in {MIN_THROTTLE_FPS:g}-{MAX_THROTTLE_FPS:g}, "
                           "e.g. throttled:8")
    raise HarnessError(f"unknown sink {spec!r} (known: {', '.join(SINK_SPECS)})")


def open_sink(spec: str, media_dir: Path, session: int, suffix: str = ".mkv"):
    """``file`` | ``null`` | ``throttled:FPS`` (a file sink that accepts at most FPS frames/s) |
    ``stream`` (each chunk's container fragment goes back to the driver in ``ChunkDelivered.media``).
    ``suffix``: the container's file name extension."""
    name, _, arg = check_sink_spec(spec).partition(":")
    path = media_dir / f"session{session}{suffix}"
    if name == "file":
        return make_sink("file", path=path)
    if name == "null":
        return make_sink("null")
    if name == "stream":
        return make_sink("memory")  # fragments kept until _Open.take_fragment hands them on
    return make_sink("throttled", inner=make_sink("file", path=path), frames_per_s=float(arg))


def _serve(spec: WorkerSpec, conn, ring) -> None:
    open_: dict[int, _Open] = {}
    try:
        _loop(spec, conn, ring, open_)
    except BaseException:  # e.g. a full disk: no session's partial media file is left behind
        for o in open_.values():
            o.encoder.abort()
            o.sink.abort()
        raise


def _loop(spec: WorkerSpec, conn, ring, open_: dict[int, _Open]) -> None:
    cfg = spec.cfg
    run_dir = Path(spec.run_dir)
    sink_for: dict[int, str] = {}  # per-session overrides (SetSink) waiting for their OpenSession
    M.send(conn, M.Ready(role="encoder", rank=0, device="cpu", device_name="cpu", info={"encoder": cfg.runtime.encoder}))
    while True:
        msg = M.recv(conn)
        if isinstance(msg, M.EncodeChunk):
            fr = msg.frames
            received = now()
            if msg.discard:
                ring.claim(fr.ref)
                ring.release(fr.ref)
                M.send(conn, M.ChunkDelivered(session=fr.session, chunk=fr.chunk, received=received, encoded=None,
                                              delivered=None, nbytes=0, pixel_sha256="", frame_sha256=[]))
                continue
            view = ring.claim(fr.ref)
            try:
                o = open_[fr.session]
                before = o.sink.bytes_accepted
                with hctx.phase(session=fr.session, epoch=fr.epoch, chunk=fr.chunk, stage="encode"):
                    res = o.encoder.encode(view, chunk=fr.chunk)
                # The harness's own records of the frames (hashes, saved pixels) are not serving:
                # taken once the chunk is encoded and delivered, they stay out of both stamps
                # (on an H200 host they cost a 480×832 first chunk ≈ 40 ms before it was encoded).
                frame_sha = [hashlib.sha256(view[i]).hexdigest() for i in range(fr.frames)]
                chunk_sha = hashlib.sha256(view).hexdigest()
                if msg.save_pixels:
                    save_pixels(run_dir, fr.epoch, fr.chunk, view)
            finally:
                ring.release(fr.ref)
            M.send(conn, M.ChunkDelivered(
                session=fr.session, chunk=fr.chunk, received=received, encoded=res.encoded_ns,
                delivered=res.delivered_ns, nbytes=o.sink.bytes_accepted - before, pixel_sha256=chunk_sha,
                frame_sha256=frame_sha, blocked_ns={"sink": o.sink.take_blocked_ns()}, media=o.take_fragment(),
            ))
        elif isinstance(msg, M.SetSink):
            sink_for[msg.session] = msg.sink
        elif isinstance(msg, M.OpenSession):
            enc = make_encoder(cfg.runtime.encoder, width=cfg.video.width, height=cfg.video.height, fps=cfg.video.fps,
                               threads=cfg.runtime.encoder_threads, container=cfg.runtime.container)
            sink = open_sink(sink_for.pop(msg.session, cfg.runtime.sink), run_dir / "media", msg.session, enc.SUFFIX)
            enc.open(sink)
            open_[msg.session] = _Open(enc, sink, getattr(sink, "path", None))
        elif isinstance(msg, M.CloseSession):
            o = open_.pop(msg.session, None)
            if o is None:
                continue
            if msg.discard:
                o.encoder.abort()
                o.sink.abort()
            else:
                o.encoder.close()
                o.sink.close()
            M.send(conn, M.MediaClosed(session=msg.session, path=str(o.path or ""), bytes=o.sink.bytes_accepted,
                                       discarded=msg.discard))
        elif isinstance(msg, M.Shutdown):
            for o in open_.values():
                o.encoder.abort()
                o.sink.abort()
            return
