"""Encoder stage process: ring slot → FFV1/Matroska per session → sink.

``received`` is stamped when this process holds the slot metadata (the frames crossed a process
boundary), ``encoded`` once the chunk's packets exist, ``delivered`` when the sink accepted the
bytes. Per-frame SHA-256 digests are taken here, off the critical path, so that scenarios can
prove every frame arrived exactly once and in order.
"""

from __future__ import annotations

import hashlib
import traceback
from pathlib import Path

import msgspec
import numpy as np

from harness.hooks import context as hctx
from harness.pipeline import messages as M
from harness.workers.common import WorkerSpec, now, process_setup


def main(spec: WorkerSpec, conn) -> None:
    process_setup(spec)
    ring = None
    try:
        from harness.pipeline.ring import FrameRing, RingSpec

        ring = FrameRing.attach(msgspec.convert(spec.ring, RingSpec))
        from harness.hooks import activate
        from harness.workers.common import write_hook_report

        hooks = activate(spec.hooks, out_dir=spec.run_dir, label="encoder")
        try:
            with hooks:
                _serve(spec, conn, ring)
        finally:
            write_hook_report(spec, hooks)  # after exit: the recorder's totals exist only then
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except BaseException as e:
        try:
            M.send(conn, M.WorkerError(role="encoder", rank=0, message=f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:
            pass
        raise SystemExit(1)
    finally:
        if ring is not None:
            ring.close()


class _Open:
    def __init__(self, encoder, sink, path: Path | None):
        self.encoder, self.sink, self.path = encoder, sink, path


def open_sink(spec: str, media_dir: Path, session: int):
    """``file`` | ``null`` | ``throttled:FPS`` (a file sink that accepts at most FPS frames/s)."""
    from harness.pipeline.sinks import make_sink

    name, _, arg = spec.partition(":")
    if name == "file":
        return make_sink("file", directory=media_dir, session=session)
    if name == "null":
        return make_sink("null")
    if name == "throttled":
        return make_sink("throttled", inner=make_sink("file", directory=media_dir, session=session), frames_per_s=float(arg))
    return make_sink(name)  # unknown names get the registry's one-line error


def _serve(spec: WorkerSpec, conn, ring) -> None:
    from harness.measure.gates import save_pixels
    from harness.pipeline.encoder import make_encoder

    cfg = spec.cfg
    run_dir = Path(spec.run_dir)
    open_: dict[int, _Open] = {}
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
                frame_sha = [hashlib.sha256(view[i].tobytes()).hexdigest() for i in range(fr.frames)]
                chunk_sha = hashlib.sha256(view.tobytes()).hexdigest()
                if msg.save_pixels:
                    save_pixels(run_dir, fr.epoch, fr.chunk, view)
                o = open_[fr.session]
                before = o.sink.bytes_accepted
                with hctx.phase(session=fr.session, epoch=fr.epoch, chunk=fr.chunk, stage="encode"):
                    res = o.encoder.encode(view, chunk=fr.chunk)
            finally:
                ring.release(fr.ref)
            M.send(conn, M.ChunkDelivered(
                session=fr.session, chunk=fr.chunk, received=received, encoded=res.encoded_ns,
                delivered=res.delivered_ns, nbytes=o.sink.bytes_accepted - before, pixel_sha256=chunk_sha,
                frame_sha256=frame_sha, blocked_ns={"sink": o.sink.take_blocked_ns()},
            ))
        elif isinstance(msg, M.OpenSession):
            sink = open_sink(cfg.runtime.sink, run_dir / "media", msg.session)
            enc = make_encoder(cfg.runtime.encoder, width=cfg.video.width, height=cfg.video.height, fps=cfg.video.fps,
                               threads=cfg.runtime.encoder_threads)
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
