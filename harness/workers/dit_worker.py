"""DiT rank process: runs the chunk loop for the driver.

Every DiT rank receives the same messages in the same order (the driver fans them out), so the
ranks enter their collectives together; only rank 0 answers. ``dit_start``/``dit_end`` are
stamped on rank 0 around the chunk's five forwards, ``dit_end`` after the device finished.
"""

from __future__ import annotations

import numpy as np
import torch

from harness.engine.backends import build_dit_engine
from harness.engine.conditions import SessionConditions
from harness.engine.image import picture_condition
from harness.hooks import context as hctx
from harness.measure.clock import now
from harness.pipeline import messages as M
from harness.workers.common import (
    GpuTimer, WorkerSpec, apply_for_good, device_name, end_session, init_groups, maybe_fault, process_setup,
    hooks_on, reported_errors, shutdown_groups, synchronize,
)


def main(spec: WorkerSpec, conn) -> None:
    process_setup(spec)
    try:
        with reported_errors("dit", spec.rank, conn):
            _serve(spec, conn)
    finally:
        shutdown_groups()


def _serve(spec: WorkerSpec, conn) -> None:
    group = init_groups(spec)
    device = torch.device(spec.device)
    cfg = spec.cfg
    engine = build_dit_engine(cfg, group=group, device=device, seed=cfg.runtime.seed)
    applied = apply_for_good(spec.candidates, device, dit=engine)
    lead = spec.rank == 0
    timer = GpuTimer(device)
    M.send(conn, M.Ready(role="dit", rank=spec.rank, device=str(device), device_name=device_name(device),
                         info={"candidates": ",".join(applied)}))
    sessions: dict[int, object] = {}
    epochs: dict[int, int] = {}
    with hooks_on(spec, f"dit{spec.rank}"):
        _loop(spec, conn, engine, sessions, epochs, timer, lead, cfg, device)


def _loop(spec, conn, engine, sessions, epochs, timer, lead, cfg, device) -> None:
    while True:
        msg = M.recv(conn)
        if isinstance(msg, M.GenerateChunk):
            maybe_fault(spec, msg.chunk)
            t0 = now()
            timer.start("dit")
            with hctx.phase(session=msg.session, epoch=epochs.get(msg.session), chunk=msg.chunk, stage="dit"):
                latent = engine.generate_chunk(sessions[msg.session], msg.actions)
            timer.stop("dit")
            host = latent.detach().to("cpu", torch.float32).numpy()  # synchronises with the device
            synchronize(device)
            t1 = now()
            if lead:
                M.send(conn, M.LatentReady(session=msg.session, chunk=msg.chunk, latent=M.Tensor.of(np.ascontiguousarray(host)),
                                           dit_start=t0, dit_end=t1, gpu_ms=timer.collect()))
        elif isinstance(msg, M.StartSession):
            epochs[msg.session] = msg.epoch
            image = picture_condition(cfg, msg.image.array(), device) if msg.image is not None else None
            sessions[msg.session] = engine.start_session(SessionConditions(prompt=msg.prompt, seed=msg.seed, image_condition=image))
        elif isinstance(msg, M.EndSession):
            epochs.pop(msg.session, None)
            end_session(engine, sessions, msg.session)
            if lead:
                stats = {k: int(v) for k, v in engine.kv_stats().items() if isinstance(v, (int, np.integer))}
                M.send(conn, M.SessionEnded(role="dit", session=msg.session, stats=stats))
        elif isinstance(msg, M.Ping):
            M.send(conn, M.Pong(sent_ns=msg.sent_ns, recv_ns=now()))
        elif isinstance(msg, M.Shutdown):
            return
