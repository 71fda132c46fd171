"""What runs inside a Ray actor: one worker rank (DiT, VAE or the encoder stage), unchanged.

``RankActor.run`` connects back to the driver over TCP and calls the worker's ``main(spec, conn)``
with a connection that behaves like the local launcher's pipe. Two jobs are done in that
connection, invisibly to the worker, and only where they are needed:

* clocks — a rank on another host stamps boundaries on its own monotonic clock; its outgoing
  timestamps are shifted by the offset measured when it connected, so ``events.jsonl`` stays on
  the driver's clock (same host: offset 0, nothing is decoded or rewritten);
* frames across hosts — VAE rank 0 then writes into a ring on its own host; every ``FramesReady``
  it sends hands its slot to a ``RingSender``, which ships the bytes to the encoder's host, and
  the encoder side rewrites each ``EncodeChunk`` to point at the local slot the ``RingReceiver``
  filled. An ``EndSession`` reaches VAE rank 0 only after its sender freed every slot, so the
  ``ring_free`` it reports means what it means locally.
"""

from __future__ import annotations

import os
import socket

import msgspec

from harness.drivers.launcher import worker_main
from harness.pipeline import messages as M
from harness.pipeline.channel import Listener, RingReceiver, RingSender, connect, host_id
from harness.pipeline.ring import FrameRing, RingSpec
from harness.workers.common import WorkerSpec

#: outgoing boundary fields that are on the sender's clock (Pong.sent_ns is the driver's own)
_CLOCK_FIELDS = {
    M.LatentReady: ("dit_start", "dit_end"),
    M.FramesReady: ("decode_start", "decode_end", "gpu_ready", "cpu_ready"),
    M.ChunkDelivered: ("received", "encoded", "delivered"),
    M.Pong: ("recv_ns",),
}


def shift_clock(msg, offset_ns: int):
    """``msg`` with its boundary timestamps moved onto the driver's clock."""
    fields = _CLOCK_FIELDS.get(type(msg))
    if not fields or not offset_ns:
        return msg
    moved = {f: getattr(msg, f) + offset_ns for f in fields if getattr(msg, f) is not None}
    if isinstance(msg, M.FramesReady) and msg.ref.ready_ns:
        moved["ref"] = msgspec.structs.replace(msg.ref, ready_ns=msg.ref.ready_ns + offset_ns)
    return msgspec.structs.replace(msg, **moved)


class WorkerConn:
    """The worker's end of the control channel (see the module docstring)."""

    def __init__(self, conn, offset_ns: int = 0, sender=None, receiver=None, wait_s: float = 300.0):
        self.conn, self.offset_ns, self.sender, self.receiver, self.wait_s = conn, offset_ns, sender, receiver, wait_s

    def send_bytes(self, raw) -> None:
        if self.offset_ns or self.sender is not None:
            msg = M.decode(raw)
            if self.sender is not None and isinstance(msg, M.FramesReady):
                self.sender.submit(msg.ref)  # before the driver hears of it: the bytes are on their way first
            if self.offset_ns:
                raw = M.encode(shift_clock(msg, self.offset_ns))
        self.conn.send_bytes(raw)

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        raw = self.conn.recv_bytes(maxlength)
        if self.sender is None and self.receiver is None:
            return raw
        msg = M.decode(raw)
        if self.receiver is not None and isinstance(msg, M.EncodeChunk):
            remote = msg.frames.ref
            local = self.receiver.take(remote.slot, remote.generation, self.wait_s)
            local = msgspec.structs.replace(local, ready_ns=remote.ready_ns)
            return M.encode(msgspec.structs.replace(msg, frames=msgspec.structs.replace(msg.frames, ref=local)))
        if self.sender is not None and isinstance(msg, M.EndSession):
            self.sender.drain(self.wait_s)
        return raw

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()


def _ray():
    # On use: ray is an optional extra, and the connection wrappers above are used without it (it
    # is always there inside an actor).
    import ray

    return ray


class RankActor:
    """A Ray actor hosting one rank. Methods are called in order by ``RayLauncher``: ``describe``,
    then (only where needed) ``free_port``, ``make_ring``, ``listen_frames``, then ``run``, which
    blocks for the rank's whole life; its ObjectRef is how the launcher learns the actor died."""

    def __init__(self) -> None:
        self._ring = None  # a ring this actor owns (VAE rank 0, frames crossing hosts)
        self._frames = None  # Listener for the frame channel (encoder stage, frames crossing hosts)

    def describe(self) -> dict:
        ray = _ray()
        ctx = ray.get_runtime_context()
        try:
            gpus = [str(g) for g in ray.get_gpu_ids()]
        except Exception:
            gpus = []
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "host": host_id(),
                "hostname": socket.gethostname(), "pid": os.getpid(), "gpu_ids": gpus}

    def free_port(self) -> int:
        """A port free on this node now (the torch.distributed rendezvous, when this is rank 0)."""
        with socket.socket() as s:
            s.bind((_ray().util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    def make_ring(self, prefix: str, slots: int, slot_bytes: int) -> dict:
        self._ring = FrameRing.create(prefix, slots, slot_bytes)
        return msgspec.to_builtins(self._ring.spec)

    def listen_frames(self, token: str) -> tuple[str, int]:
        self._frames = Listener(_ray().util.get_node_ip_address(), token)
        return self._frames.address

    def run(self, role: str, spec_raw: bytes, driver: tuple[str, int], token: str,
            frames: dict | None = None) -> int:
        """Connect to the driver and run the worker until it returns; returns its exit status.

        ``frames``: ``{"send": (host, port)}`` for VAE rank 0 or ``{"receive": ring_spec}`` for the
        encoder stage when frames cross hosts, else None."""
        spec = msgspec.msgpack.decode(spec_raw, type=WorkerSpec)
        if spec.run_dir:
            os.makedirs(spec.run_dir, exist_ok=True)  # another host: hook reports land on its disk
        conn, offset = connect(tuple(driver), token, {"role": role, "rank": spec.rank, "pid": os.getpid()})
        sender = receiver = ring = None
        try:
            if frames and "send" in frames:
                fconn, _ = connect(tuple(frames["send"]), token, {"role": "frames", "rank": spec.rank})
                sender = RingSender(self._ring, fconn)
            elif frames and "receive" in frames:
                ring = FrameRing.attach(msgspec.convert(frames["receive"], RingSpec))
                got = self._frames.accept(timeout=spec.cfg.runtime.rank_timeout_s)
                if got is None:
                    raise RuntimeError("VAE rank 0 never opened the frame channel")
                receiver = RingReceiver(ring, got[0])
            wconn = WorkerConn(conn, offset, sender, receiver, wait_s=spec.cfg.runtime.rank_timeout_s)
            try:
                worker_main(role)(spec, wconn)
            except SystemExit as e:  # the worker's "exit 1" after reporting; keep the actor for a clean kill
                return int(e.code or 0) if not isinstance(e.code, str) else 1
            return 0
        finally:
            for part in (sender, receiver):
                if part is not None:
                    part.close()
            if self._frames is not None:
                self._frames.close()
            for r in (ring, self._ring):
                if r is not None:
                    r.close()
            conn.close()
