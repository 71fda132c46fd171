"""Socket channel: pipe-like semantics (framing, EOF, wait), authentication, clock offset, and the
ring-to-ring frame path (exact bytes, order, bounded by the rings)."""

from __future__ import annotations

import os
import socket
import threading
import time
from multiprocessing.connection import wait

import msgspec
import numpy as np
import pytest

from harness.errors import HarnessError
from harness.pipeline import channel
from harness.pipeline.channel import Listener, RingReceiver, RingSender, connect
from harness.pipeline.ring import FrameRing, leftover_segments


@pytest.fixture
def pair():
    lst = Listener("127.0.0.1", "secret")
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("srv", lst.accept(timeout=10)))
    t.start()
    client, offset = connect(lst.address, "secret", {"role": "dit", "rank": 1})
    t.join()
    server, hello = out["srv"]
    yield client, server, hello, offset
    client.close()
    server.close()
    lst.close()


def test_messages_keep_their_boundaries_and_bytes(pair):
    client, server, hello, offset = pair
    assert hello == {"role": "dit", "rank": 1, "host": channel.host_id()} and offset == 0
    sizes = [0, 1, 7, 65536, 65537, 3 << 20]
    rng = np.random.default_rng(0)
    msgs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    t = threading.Thread(target=lambda: [client.send_bytes(m) for m in msgs])  # big ones exceed the socket buffer
    t.start()
    got = [server.recv_bytes() for _ in msgs]
    t.join()
    assert got == msgs
    server.send_bytes(memoryview(b"xxhelloxx"), 2, 5)  # Connection's offset/size arguments
    assert client.recv_bytes() == b"hello"
    dst = np.zeros(100, np.uint8)
    client.send_bytes(np.arange(40, dtype=np.uint8))
    assert server.recv_bytes_into(dst) == 40 and dst[:40].tolist() == list(range(40))


def test_wait_poll_and_eof_behave_like_a_pipe(pair):
    client, server, _, _ = pair
    assert wait([server], timeout=0.05) == [] and not server.poll(0)
    client.send_bytes(b"ping")
    assert wait([server], timeout=5) == [server] and server.poll(0)
    assert server.recv_bytes() == b"ping"
    assert not server.at_eof()
    client.close()  # what a killed process's kernel does to its socket
    assert wait([server], timeout=5) == [server] and server.at_eof()
    with pytest.raises(EOFError):
        server.recv_bytes()
    with pytest.raises(BrokenPipeError):
        for _ in range(100):  # the first send may still be buffered; a reset follows
            server.send_bytes(b"x" * 65536)


def test_a_wrong_token_is_refused():
    lst = Listener("127.0.0.1", "right")
    t = threading.Thread(target=lambda: lst.accept(timeout=10))
    t.start()
    with pytest.raises(HarnessError, match="refused"):
        connect(lst.address, "wrong", timeout=5)
    t.join()
    lst.close()


def test_clock_offset_measured_between_hosts(monkeypatch):
    """Two 'hosts' that share one real clock: the measured offset must come out ~0."""
    lst = Listener("127.0.0.1", "s")
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("srv", lst.accept(timeout=10)))
    t.start()
    monkeypatch.setattr(channel, "host_id", lambda: "another-host")  # the client's view only
    client, offset = connect(lst.address, "s")
    t.join()
    assert out["srv"] is not None and abs(offset) < 5_000_000  # within 5 ms on loopback
    client.close()
    out["srv"][0].close()
    lst.close()


def _shrink_buffer(conn, opt: int, size: int) -> None:
    """Pin one kernel socket buffer (no autotuning) so the bytes in flight are bounded by it."""
    dup = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)
    try:
        dup.setsockopt(socket.SOL_SOCKET, opt, size)
    finally:
        dup.close()


def test_ring_to_ring_frames_exact_in_order_and_bounded():
    """Frames arrive exact and in order, and a consumer that holds its slots holds the producer back.

    With the socket buffers pinned far below one frame, at most 2 (receiving ring) + 2 (sending
    ring) frames can be in flight, so while nothing is released the producer must find its ring
    full before chunk 4, and its put of chunk 4 can only return after the consumer's first release:
    causal facts, not timings."""
    prefix = f"hnt-{os.getpid()}-chan"
    shape = (32, 96, 96, 3)  # 0.85 MiB per frame, ~13x the pinned socket buffers
    tx = FrameRing.create(prefix + "-tx", 2, int(np.prod(shape)))
    rx_ring = FrameRing.create(prefix + "-rx", 2, int(np.prod(shape)))
    lst = Listener("127.0.0.1", "t")
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("srv", lst.accept(timeout=10)))
    t.start()
    conn, _ = connect(lst.address, "t")
    t.join()
    _shrink_buffer(conn, socket.SO_SNDBUF, 16384)
    _shrink_buffer(out["srv"][0], socket.SO_RCVBUF, 16384)
    sender, receiver = RingSender(tx, conn), RingReceiver(rx_ring, out["srv"][0])
    chunks = [np.random.default_rng(i).integers(0, 256, shape, dtype=np.uint8) for i in range(8)]
    refs, held = [], 4
    at_held, releasing, seen = threading.Event(), threading.Event(), {}

    def produce():
        for i, c in enumerate(chunks):
            if i == held:
                seen["free_before"] = tx.free_count()
                at_held.set()
            refs.append(tx.put(c, session=3, chunk=i, timeout=30))
            if i == held:
                seen["after_release"] = releasing.is_set()
            sender.submit(refs[-1])

    p = threading.Thread(target=produce)
    p.start()
    try:
        assert at_held.wait(30)  # nothing is taken before the producer reaches chunk 4
        for i, c in enumerate(chunks):
            while len(refs) <= i:
                time.sleep(0.001)
            local = receiver.take(refs[i].slot, refs[i].generation, timeout=30)
            assert (local.session, local.chunk, local.shape) == (3, i, shape)
            view = rx_ring.claim(local)
            np.testing.assert_array_equal(view, c)
            del view
            releasing.set()
            rx_ring.release(local)
        p.join(30)
        assert sender.drain(10)
        assert seen == {"free_before": 0, "after_release": True}  # backpressure reached the producer
        assert tx.free_count() == 2 and rx_ring.free_count() == 2
        assert tx.stats().high_water == rx_ring.stats().high_water == 2
        assert sender.sent_bytes == receiver.received_bytes == len(chunks) * chunks[0].nbytes
    finally:
        sender.close()
        receiver.close()
        lst.close()
        tx.close()
        rx_ring.close()
    assert leftover_segments(prefix) == []


def test_shift_clock_moves_only_the_senders_timestamps():
    from harness.drivers.ray_actor import shift_clock
    from harness.pipeline import messages as M
    from harness.pipeline.ring import SlotRef

    fr = M.FramesReady(session=0, epoch=0, chunk=1, ref=SlotRef(0, 1, 0, 1, (1, 2, 2, 3), ready_ns=50), frames=1,
                       decode_start=10, decode_end=20, gpu_ready=30, cpu_ready=40)
    s = shift_clock(fr, 1000)
    assert (s.decode_start, s.decode_end, s.gpu_ready, s.cpu_ready, s.ref.ready_ns) == (1010, 1020, 1030, 1040, 1050)
    d = shift_clock(M.ChunkDelivered(session=0, chunk=0, received=1, encoded=2, delivered=None, nbytes=0,
                                     pixel_sha256="", frame_sha256=[]), -1)
    assert (d.received, d.encoded, d.delivered) == (0, 1, None)
    p = shift_clock(M.Pong(sent_ns=5, recv_ns=6), 100)
    assert (p.sent_ns, p.recv_ns) == (5, 106)  # sent_ns is the driver's own clock
    assert shift_clock(fr, 0) is fr
    assert msgspec.msgpack.decode(M.encode(s), type=M.Message) == s


def test_worker_conn_shifts_clocks_and_reroutes_frames():
    """The actor-side connection: outgoing boundaries moved by the offset, FramesReady handed to the
    sender first, EncodeChunk pointed at the receiver's local slot, EndSession after the drain."""
    from harness.drivers.ray_actor import WorkerConn
    from harness.pipeline import messages as M
    from harness.pipeline.ring import SlotRef

    class Pipe:
        def __init__(self, inbox=()):
            self.sent, self.inbox = [], list(inbox)

        def send_bytes(self, raw):
            self.sent.append(M.decode(raw))

        def recv_bytes(self, maxlength=None):
            return M.encode(self.inbox.pop(0))

    class Sender:
        def __init__(self):
            self.log = []

        def submit(self, ref):
            self.log.append(("submit", ref.slot))

        def drain(self, timeout):
            self.log.append(("drain",))
            return True

    class Receiver:
        def take(self, slot, generation, timeout):
            assert (slot, generation) == (2, 9)
            return SlotRef(0, 1, 5, 3, (1, 2, 2, 3), ready_ns=77)

    ref = SlotRef(2, 9, 5, 3, (1, 2, 2, 3), ready_ns=40)
    fr = M.FramesReady(session=5, epoch=0, chunk=3, ref=ref, frames=1, decode_start=10, decode_end=20,
                       gpu_ready=30, cpu_ready=40)
    pipe, sender = Pipe([M.EndSession(session=5)]), Sender()
    w = WorkerConn(pipe, offset_ns=1000, sender=sender)
    w.send_bytes(M.encode(fr))
    assert sender.log == [("submit", 2)] and pipe.sent[0].cpu_ready == 1040 and pipe.sent[0].ref.slot == 2
    assert isinstance(M.decode(w.recv_bytes()), M.EndSession) and sender.log[-1] == ("drain",)

    enc = WorkerConn(Pipe([M.EncodeChunk(frames=fr, save_pixels=True)]), receiver=Receiver())
    got = M.decode(enc.recv_bytes())
    assert got.frames.ref == SlotRef(0, 1, 5, 3, (1, 2, 2, 3), ready_ns=40) and got.save_pixels and got.frames.chunk == 3
    plain = Pipe([M.Ping(sent_ns=1)])
    assert WorkerConn(plain).recv_bytes() == M.encode(M.Ping(sent_ns=1))  # nothing to do: bytes pass untouched


def test_a_silent_stranger_does_not_stall_the_listener():
    import socket

    lst = Listener("127.0.0.1", "s")
    stranger = socket.create_connection(lst.address)  # connects, never says hello
    t0 = time.monotonic()
    assert lst.accept(timeout=5, handshake_s=0.3) is None
    assert time.monotonic() - t0 < 3
    stranger.close()
    lst.close()
