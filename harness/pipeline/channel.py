"""Byte messages over TCP, for processes that do not share a host.

``SocketConn`` has the part of ``multiprocessing.connection.Connection`` the workers use
(``send_bytes``/``recv_bytes``/``poll``/``fileno``/``close``), so a worker launched as a Ray actor
talks to the driver exactly as a local one does over its pipe, and ``multiprocessing.connection.wait``
works on it. A message is an 8-byte big-endian length and the bytes; nothing is read ahead, so the
kernel buffer is the only buffer and "readable" from ``wait`` means a message (or EOF) is there.

Connections are opened by ``connect`` and accepted by a ``Listener``: the client sends a hello with
a shared secret (a stray connection on a cluster network is refused, not mistaken for a rank) and
the host identity of its clock. When the two ends are on different hosts the client also measures
the offset between the two monotonic clocks (the sample with the smallest round trip of a few
pings), because every boundary timestamp must be on the driver's clock to be comparable.

``RingSender``/``RingReceiver`` carry frames between two frame rings on different hosts: published
slots of the producer's ring go, in order, over one connection into slots of the consumer's ring.
Both ends block when their ring is full, so the ring depths still bound memory end to end and a
slow consumer still holds the producer back (recorded as its ring wait).
"""

from __future__ import annotations

import errno
import hmac
import os
import select
import socket
import struct
import threading
import time
from collections import deque

import msgspec

from harness.errors import HarnessError

_LEN = struct.Struct("!Q")
_COALESCE = 64 * 1024  # below this the length and payload go in one send (one segment per message)
_SYNC_ROUNDS = 16


class ChannelError(HarnessError):
    """The peer spoke something other than this protocol, or authentication failed."""


def host_id() -> str:
    """Identity of this host's monotonic clock: equal ids ⇒ timestamps are directly comparable."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return f"{socket.gethostname()}-{os.getpid()}"  # unknown: never equal, so the offset is measured


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # A peer host that vanishes (power, network) sends no FIN; keepalive turns that into an error
    # within ~15 s instead of a read that never returns.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, val in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 5)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)


class SocketConn:
    """A connected TCP socket carrying length-prefixed messages (see the module docstring)."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(True)
        _tune(sock)
        self._sock: socket.socket | None = sock
        self._send_lock = threading.Lock()
        self.peer = sock.getpeername()

    # ---- Connection-like interface ------------------------------------------------------------
    def fileno(self) -> int:
        if self._sock is None:
            raise OSError(errno.EBADF, "connection is closed")
        return self._sock.fileno()

    @property
    def closed(self) -> bool:
        return self._sock is None

    def send_bytes(self, buf, offset: int = 0, size: int | None = None) -> None:
        m = memoryview(buf).cast("B")
        m = m[offset:] if size is None else m[offset:offset + size]
        sock = self._live()
        try:
            with self._send_lock:
                if len(m) <= _COALESCE:
                    sock.sendall(_LEN.pack(len(m)) + m.tobytes())
                else:
                    sock.sendall(_LEN.pack(len(m)))
                    sock.sendall(m)
        except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError) as e:
            # Workers treat BrokenPipeError as "the driver went away", as on a pipe.
            raise BrokenPipeError(e.errno, f"peer {self.peer} closed the connection") from None

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        n = self._recv_len()
        if maxlength is not None and n > maxlength:
            raise OSError(errno.EMSGSIZE, f"message of {n} bytes exceeds {maxlength}")
        sock = self._live()
        try:
            data = sock.recv(n, socket.MSG_WAITALL) if n else b""
            if len(data) < n:  # interrupted or EOF mid-message: finish or fail explicitly
                rest = bytearray(n - len(data))
                self._fill(memoryview(rest))
                data += rest
        except (ConnectionResetError, ConnectionAbortedError) as e:
            raise EOFError(f"peer {self.peer} reset the connection") from e
        return data

    def recv_bytes_into(self, buf) -> int:
        """Receive one message straight into ``buf`` (e.g. a ring slot); returns its length."""
        n = self._recv_len()
        m = memoryview(buf).cast("B")
        if n > len(m):
            raise OSError(errno.EMSGSIZE, f"message of {n} bytes does not fit a {len(m)}-byte buffer")
        self._fill(m[:n])
        return n

    def poll(self, timeout: float | None = 0.0) -> bool:
        """True when a message (or EOF) can be read without blocking."""
        r, _, _ = select.select([self._live()], [], [], timeout)
        return bool(r)

    def at_eof(self) -> bool:
        """True when the peer has closed and nothing is left to read (a dead process's socket)."""
        if self._sock is None:
            return True
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    # ---- internals --------------------------------------------------------------------------
    def _live(self) -> socket.socket:
        if self._sock is None:
            raise OSError(errno.EBADF, "connection is closed")
        return self._sock

    def _recv_len(self) -> int:
        head = bytearray(_LEN.size)
        self._fill(memoryview(head))
        return _LEN.unpack(head)[0]

    def _fill(self, m: memoryview) -> None:
        sock = self._live()
        got = 0
        try:
            while got < len(m):
                k = sock.recv_into(m[got:], len(m) - got)
                if k == 0:
                    raise EOFError(f"peer {self.peer} closed the connection")
                got += k
        except (ConnectionResetError, ConnectionAbortedError) as e:
            raise EOFError(f"peer {self.peer} reset the connection") from e


# ---- opening connections ----------------------------------------------------------------------
def _check_token(got: object, want: str) -> bool:
    return isinstance(got, str) and hmac.compare_digest(got.encode(), want.encode())


def connect(address: tuple[str, int], token: str, hello: dict | None = None,
            timeout: float = 30.0) -> tuple[SocketConn, int]:
    """Connect to a ``Listener``; returns the connection and ``offset_ns`` to add to this host's
    ``time.monotonic_ns()`` to get the listener host's (0 when both are the same host)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection(tuple(address), timeout=max(0.1, deadline - time.monotonic()))
            break
        except OSError as e:  # the listener may not be up yet; retry until the deadline
            if time.monotonic() >= deadline:
                raise HarnessError(f"cannot connect to {address[0]}:{address[1]}: {e}") from None
            time.sleep(0.05)
    sock.settimeout(None)
    conn = SocketConn(sock)
    try:
        mine = host_id()
        conn.send_bytes(msgspec.msgpack.encode({**(hello or {}), "token": token, "host": mine}))
        reply = msgspec.msgpack.decode(conn.recv_bytes())
        if not isinstance(reply, dict) or not reply.get("ok"):
            raise ChannelError(f"{address[0]}:{address[1]} refused the connection: {reply!r}")
        offset = 0 if reply.get("host") == mine else _measure_offset(conn)
    except BaseException:
        conn.close()
        raise
    return conn, offset


def _measure_offset(conn: SocketConn) -> int:
    best = None
    for _ in range(_SYNC_ROUNDS):
        t0 = time.monotonic_ns()
        conn.send_bytes(b"t")
        remote = _LEN.unpack(conn.recv_bytes())[0]
        t1 = time.monotonic_ns()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, remote - (t0 + t1) // 2)
    conn.send_bytes(b"done")
    return best[1]


class Listener:
    """Accepts authenticated ``connect``s on ``host`` (port 0: any free port)."""

    def __init__(self, host: str, token: str, port: int = 0, backlog: int = 64):
        self.token = token
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(backlog)
        self.address: tuple[str, int] = (host, self._sock.getsockname()[1])

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept(self, timeout: float | None = None, handshake_s: float = 10.0) -> tuple[SocketConn, dict] | None:
        """The next authenticated connection and its hello, or None (nothing within ``timeout``,
        or a connection that failed the handshake and was dropped)."""
        r, _, _ = select.select([self._sock], [], [], timeout)
        if not r:
            return None
        sock, _ = self._sock.accept()
        conn = SocketConn(sock)
        sock.settimeout(handshake_s)  # a silent stranger must not stall the accepting loop
        try:
            hello = msgspec.msgpack.decode(conn.recv_bytes(maxlength=1 << 16))
            if not isinstance(hello, dict) or not _check_token(hello.get("token"), self.token):
                conn.send_bytes(msgspec.msgpack.encode({"ok": False, "why": "bad token"}))
                conn.close()
                return None
            mine = host_id()
            conn.send_bytes(msgspec.msgpack.encode({"ok": True, "host": mine}))
            if hello.get("host") != mine:
                while (req := conn.recv_bytes(maxlength=8)) == b"t":
                    conn.send_bytes(_LEN.pack(time.monotonic_ns()))
                if req != b"done":
                    raise ChannelError("clock sync: unexpected message")
        except (OSError, EOFError, ChannelError, msgspec.DecodeError):
            conn.close()
            return None
        sock.settimeout(None)
        hello.pop("token", None)
        return conn, hello

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


# ---- frames between two rings on different hosts ---------------------------------------------
class _Meta(msgspec.Struct, frozen=True, array_like=True):
    slot: int
    generation: int
    session: int
    chunk: int
    shape: tuple[int, ...]


class RingSender:
    """Producer-host side: ``submit(ref)`` hands over a published slot of ``ring``; a thread sends
    its bytes to the ``RingReceiver`` and then frees the slot. Slots go in submission order."""

    def __init__(self, ring, conn: SocketConn):
        self.ring, self.conn = ring, conn
        self.error: BaseException | None = None
        self.sent_bytes = 0
        self.send_ns = 0  # time spent in sendall (includes waiting for the receiver: backpressure)
        self._q: deque = deque()
        self._cv = threading.Condition()
        self._busy = 0  # submitted and not yet freed
        self._thread = threading.Thread(target=self._pump, name="ring-sender", daemon=True)
        self._thread.start()

    def submit(self, ref) -> None:
        if self.error is not None:
            raise HarnessError(f"frame channel to the encoder stage is broken: {self.error}")
        with self._cv:
            self._q.append(ref)
            self._busy += 1
            self._cv.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until every submitted slot was sent and freed (False on timeout or error)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._busy and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return self.error is None

    def close(self) -> None:
        with self._cv:
            self._q.append(None)
            self._cv.notify_all()
        self.conn.close()  # unblocks a send stuck on a receiver that is gone
        self._thread.join(timeout=5)

    def _pump(self) -> None:
        while True:
            with self._cv:
                while not self._q:
                    self._cv.wait()
                ref = self._q.popleft()
            if ref is None:
                return
            try:
                if self.error is None:
                    view = self.ring.claim(ref)
                    try:
                        meta = _Meta(ref.slot, ref.generation, ref.session, ref.chunk, tuple(ref.shape))
                        t0 = time.monotonic_ns()
                        self.conn.send_bytes(msgspec.msgpack.encode(meta))
                        self.conn.send_bytes(view)
                        self.send_ns += time.monotonic_ns() - t0
                        self.sent_bytes += view.nbytes
                    finally:
                        del view
                self.ring.release(ref)
            except BaseException as e:  # noqa: BLE001 - reported through submit/drain
                self.error = e
                try:
                    self.ring.release(ref)
                except Exception:
                    pass
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()


class RingReceiver:
    """Consumer-host side: a thread receives frames into newly acquired slots of ``ring`` (blocking
    while it is full) and publishes them; ``take(remote_ref)`` returns the local ``SlotRef`` that
    holds the frames the producer published as ``remote_ref``."""

    def __init__(self, ring, conn: SocketConn):
        self.ring, self.conn = ring, conn
        self.error: BaseException | None = None
        self.received_bytes = 0
        self._arrived: dict[tuple[int, int], object] = {}  # insertion order = arrival order
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._pump, name="ring-receiver", daemon=True)
        self._thread.start()

    def take(self, slot: int, generation: int, timeout: float):
        """The local slot holding what the producer published as (``slot``, ``generation``)."""
        key = (slot, generation)
        return self._wait(lambda: key in self._arrived, lambda: self._arrived.pop(key), timeout,
                          f"frames of producer slot {slot} (generation {generation})")

    def take_next(self, timeout: float):
        """The oldest arrived slot not yet taken (a consumer that follows the producer's order)."""
        return self._wait(lambda: bool(self._arrived), lambda: self._arrived.pop(next(iter(self._arrived))),
                          timeout, "the next frames")

    def _wait(self, ready, pop, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        with self._cv:
            while not ready():
                if self.error is not None:
                    raise HarnessError(f"frame channel from VAE rank 0 is broken: {self.error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HarnessError(f"{what} did not arrive over the frame channel within {timeout:.0f} s")
                self._cv.wait(min(left, 1.0))
            return pop()

    def close(self) -> None:
        self._stop = True
        self.conn.close()
        self._thread.join(timeout=5)

    def _pump(self) -> None:
        try:
            while not self._stop:
                meta = msgspec.msgpack.decode(self.conn.recv_bytes(maxlength=1 << 12), type=_Meta)
                ref = self.ring.acquire(meta.session, meta.chunk)
                try:
                    n = self.conn.recv_bytes_into(self.ring.buffer(ref, meta.shape))
                    if n != self.ring.buffer(ref, meta.shape).nbytes:
                        raise ChannelError(f"frame message of {n} bytes for shape {meta.shape}")
                    local = self.ring.publish(ref, meta.shape)
                except BaseException:
                    self.ring.release(ref)
                    raise
                self.received_bytes += n
                with self._cv:
                    self._arrived[(meta.slot, meta.generation)] = local
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - surfaced by take()
            with self._cv:
                self.error = e if not self._stop else None
                self._cv.notify_all()
