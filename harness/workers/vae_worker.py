"""VAE rank process: streaming, width-sharded decode; rank 0 converts to uint8 and fills a ring slot.

Rank 0's path per chunk: decode (all ranks, halo exchange) → gather → uint8 on the device
(``gpu_ready``) → acquire a free ring slot (blocks when the encoder is behind: that wait is the
backpressure signal, recorded) → copy into the slot (``cpu_ready``) → slot metadata to the driver.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from harness.engine.convert import to_uint8
from harness.engine.vae_engine import VaeEngine
from harness.errors import HarnessError
from harness.hooks import context as hctx
from harness.measure.clock import now
from harness.pipeline import messages as M
from harness.pipeline.ring import FrameRing, RingSpec
from harness.workers.common import (
    GpuTimer, WorkerSpec, apply_for_good, device_name, end_session, init_groups, maybe_fault, process_setup,
    hooks_on, reported_errors, shutdown_groups, synchronize,
)


def main(spec: WorkerSpec, conn) -> None:
    process_setup(spec)
    ring = None
    try:
        with reported_errors("vae", spec.rank, conn):
            ring = _attach_ring(spec)
            _serve(spec, conn, ring)
    finally:
        if ring is not None:
            ring.close()
        shutdown_groups()


def _attach_ring(spec: WorkerSpec):
    if spec.rank != 0 or spec.ring is None:
        return None
    return FrameRing.attach(msgspec.convert(spec.ring, RingSpec))


class OutputPath:
    """Float frames on the device → uint8 THWC in a host ring slot. Candidates (fused
    conversion, pinned staging) replace ``convert``/``copy_out``; the reference is exact."""

    def __init__(self, device: torch.device):
        self.device = device
        self.convert = to_uint8
        #: run by ``close``: what a candidate must release before the ring is unmapped
        #: (host memory it registered with the driver)
        self.finalizers: list = []

    def copy_out(self, frames_u8: torch.Tensor, dst) -> None:
        torch.from_numpy(dst).copy_(frames_u8)

    def close(self) -> None:
        while self.finalizers:
            self.finalizers.pop()()


def _serve(spec: WorkerSpec, conn, ring) -> None:
    group = init_groups(spec)
    device = torch.device(spec.device)
    cfg = spec.cfg
    engine = VaeEngine(cfg, group=group, device=device, seed=cfg.runtime.seed)
    out = OutputPath(device)
    applied = apply_for_good(spec.candidates, device, vae=engine, output=out)
    lead = spec.rank == 0
    timer = GpuTimer(device)
    M.send(conn, M.Ready(role="vae", rank=spec.rank, device=str(device), device_name=device_name(device),
                         info={"candidates": ",".join(applied)}))
    sessions: dict[int, object] = {}
    try:
        with hooks_on(spec, f"vae{spec.rank}"):
            _loop(spec, conn, ring, engine, out, sessions, timer, lead, device)
    finally:
        out.close()  # before main() unmaps the ring


def _check_finite(latent, session: int, chunk: int) -> None:
    """A NaN/Inf latent would decode to garbage that still converts to valid-looking uint8 frames,
    so it is refused here, on the small host copy (one pass over ~1 MB at 480×832, well under a
    millisecond) before it costs a decode or reaches the encoder."""
    finite = np.isfinite(latent)
    if not finite.all():
        bad = int(latent.size - np.count_nonzero(finite))
        raise HarnessError(f"latent of session {session} chunk {chunk} has {bad} non-finite values (NaN/Inf); refusing to decode")


def _loop(spec, conn, ring, engine, out, sessions, timer, lead, device) -> None:
    while True:
        msg = M.recv(conn)
        if isinstance(msg, M.DecodeChunk):
            maybe_fault(spec, msg.chunk)
            host = msg.latent.array()
            _check_finite(host, msg.session, msg.chunk)
            latent = torch.from_numpy(host.copy()).to(device)
            t_start = now()
            timer.start("decode")
            with hctx.phase(session=msg.session, epoch=msg.epoch, chunk=msg.chunk, stage="decode"):
                frames = engine.decode_chunk(sessions[msg.session], latent)
            timer.stop("decode")
            if not lead:
                continue
            synchronize(device)
            t_dec = now()
            timer.start("convert")
            with hctx.phase(stage="convert"):
                u8 = out.convert(frames)
            timer.stop("convert")
            synchronize(device)
            t_gpu = now()
            shape = tuple(u8.shape)
            blocked0 = ring.blocked_ns
            ref = ring.acquire(msg.session, msg.chunk)
            blocked = ring.blocked_ns - blocked0
            timer.start("d2h")
            with hctx.phase(stage="d2h"):
                out.copy_out(u8, ring.buffer(ref, shape))
            timer.stop("d2h")
            synchronize(device)
            ref = ring.publish(ref, shape)
            t_cpu = now()
            M.send(conn, M.FramesReady(
                session=msg.session, epoch=msg.epoch, chunk=msg.chunk, ref=ref, frames=shape[0],
                decode_start=t_start, decode_end=t_dec, gpu_ready=t_gpu, cpu_ready=t_cpu,
                gpu_ms=timer.collect(), blocked_ns={"ring": blocked} if blocked else {},
            ))
        elif isinstance(msg, M.StartSession):
            sessions[msg.session] = engine.start_session()
        elif isinstance(msg, M.EndSession):
            end_session(engine, sessions, msg.session)
            if lead:
                M.send(conn, M.SessionEnded(role="vae", session=msg.session,
                                            stats={"ring_free": ring.free_count() if ring else 0}))
        elif isinstance(msg, M.Ping):
            M.send(conn, M.Pong(sent_ns=msg.sent_ns, recv_ns=now()))
        elif isinstance(msg, M.Shutdown):
            return
