"""``serve --listen``: a WebSocket endpoint in front of the synchronous driver.

Two threads. The *driver thread* is serve's own: it runs one session at a time through
``Driver.run_session`` with a ``SessionControl`` whose callbacks read what the client sent. The
*network thread* runs an aiohttp application on its own event loop. They meet in one ``_Session``
per client session (a condition variable plus plain fields): the network thread records actions,
acknowledgements and cancel requests; the driver thread waits on them and posts outgoing messages
to the connection's queue with ``call_soon_threadsafe``.

Backpressure, end to end: at most ``window`` chunks may be sent and not yet acknowledged. When the
client falls behind, the driver thread waits inside ``on_chunk`` (that wait is recorded per chunk as
``blocked_ns["client"]``), the encoder's reply pipe fills, the ring stops draining and the VAE blocks
on a free slot; nothing is buffered without bound. A client that stops acknowledging altogether is
cancelled after ``stall_timeout_s``.

``delivered`` comes from the client: its acknowledgement carries the moment it read the chunk's
media. When the client runs on this host (same boot id, hence the same monotonic clock) and the
stamp lies between ``encoded`` and the ack's arrival, it is used as is; otherwise the server's
arrival time of the ack is (an upper bound by half a round trip). A chunk never acknowledged has no
``delivered``; nothing is invented.

A player session (``start`` with ``input: "player"``) is driven the other way round: the network
thread queues each ``input`` event and receipts it at once (``queued``); the driver's request for a
chunk's actions is the chunk boundary, where ``player.latest_wins`` turns what arrived into the
chunk's keys, and the chunk's header names the events applied (DESIGN §9).

Capacity is one session: a ``start`` while another is pending or running gets ``busy`` at once.
"""

from __future__ import annotations

import asyncio
import ipaddress
import queue
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

import msgspec
from aiohttp import WSMsgType, web

from harness.config import override
from harness.drivers.driver import SessionControl
from harness.drivers.options import resolve_config
from harness.drivers.serve import ServeOptions, explain_failure, serve
from harness.drivers.signals import install as install_stop
from harness.engine.keys import normalize_action, validate_actions
from harness.errors import HarnessError
from harness.hooks import parse_hooks
from harness.limits import session_frames_error
from harness.measure.clock import now
from harness.measure.headline import run_headline
from harness.serving import protocol as W
from harness.serving.guards import (DEFAULT_IDLE_TIMEOUT_S, MaskedFramesOnly, hardening_options, origin_error, refusal,
                                    token_matches, warm_up, write_token)
from harness.serving.outcome import as_delivered
from harness.serving.player import latest_wins


#: input events one player session may send (each is remembered: ids must be unique)
MAX_INPUTS = 100_000


#: how often a connection's receive wakes to look at its idle deadline (and at the end of its session)
IDLE_POLL_S = 1.0


@dataclass
class ListenOptions:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (announced through on_listening)
    window: int = 2  # chunks sent and not yet acknowledged
    action_timeout_s: float = 10.0
    stall_timeout_s: float = 60.0  # no acknowledgement for this long: cancelled (or, after the last chunk, given up)
    max_sessions: int | None = None  # stop serving after this many sessions (None: until stopped)
    max_connections: int = 8
    max_message_bytes: int = W.MAX_CONTROL_BYTES
    max_errors: int = 32  # rejected messages before a connection is closed (policy violation)
    max_backlog: int = 64  # answers queued to a client that does not read them before it is closed
    #: a connection without a running session that sends nothing for this long is closed; so is a
    #: TCP connection that sends no complete HTTP request within it (aiohttp's keep-alive timer)
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    heartbeat_s: float = 10.0  # WebSocket ping period; no pong within half of it closes a half-open peer
    allow_origins: tuple[str, ...] = ()  # Origins accepted besides the listen address ("*": any Origin and Host)
    warmup_chunks: int = 0  # chunks generated before "listening" (compilation, allocator, autotuning)
    on_listening: Callable[[str, int], None] | None = None


def parse_listen(text: str, allow_remote: bool = False) -> tuple[str, int]:
    """``PORT`` or ``HOST:PORT`` (IPv6 as ``[::1]:PORT``); loopback unless ``allow_remote``."""
    host, sep, port_s = text.rpartition(":")
    if not sep:
        host, port_s = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_s)
    except ValueError:
        raise HarnessError(f"--listen {text!r}: port {port_s!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise HarnessError(f"--listen {text!r}: port {port} is out of range 0-65535")
    if host != "localhost":
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            raise HarnessError(f"--listen {text!r}: {host!r} is not an IP address (or localhost)") from None
        if not addr.is_loopback and not allow_remote:
            raise HarnessError(f"--listen {text!r}: {host} is not a loopback address; add --allow-remote to expose the endpoint")
    return host, port


class _Conn:
    """One WebSocket, as the driver thread sees it: a thread-safe outbox."""

    def __init__(self, ws, loop: asyncio.AbstractEventLoop) -> None:
        self.ws, self.loop = ws, loop
        self.outq: asyncio.Queue = asyncio.Queue()
        self.open = True
        self.session: _Session | None = None
        self.errors = 0
        self.drained = asyncio.Event()  # the pump has sent everything queued before its None
        #: chunks whose media the transport has taken (written to the socket, or below its high-water
        #: mark): only these may be acknowledged, so the window bounds bytes in flight, not promises
        self.written: set[int] = set()
        self.on_written: Callable[[int], None] | None = None  # called (network thread) once chunk c's media is written

    def post(self, item: str | tuple[int, bytes] | None) -> None:
        """Queue a text frame (str) or chunk c's media ((c, bytes)); None ends the pump. Any thread."""
        if not self.open and item is not None:
            return
        try:
            self.loop.call_soon_threadsafe(self.outq.put_nowait, item)
        except RuntimeError:  # the loop is gone: the server is shutting down
            self.open = False

    async def pump(self) -> None:
        try:
            while True:
                item = await self.outq.get()
                if item is None:
                    return
                try:
                    if isinstance(item, tuple):
                        await self.ws.send_bytes(item[1])  # awaits the socket draining: TCP backpressure
                        self.written.add(item[0])
                        if self.on_written is not None:
                            self.on_written(item[0])
                    else:
                        await self.ws.send_str(item)
                except (ConnectionError, RuntimeError):
                    self.open = False
                    return
        finally:
            self.drained.set()


class _Session:
    """One client session shared by both threads; every field is guarded by ``cond``."""

    def __init__(self, conn: _Conn, start: W.Start, *, chunks: int, frames_per_chunk: int, window: int,
                 action_timeout_s: float, stall_timeout_s: float) -> None:
        self.conn, self.start, self.chunks = conn, start, chunks
        self.frames_per_chunk, self.window = frames_per_chunk, window
        self.action_timeout_s, self.stall_timeout_s = action_timeout_s, stall_timeout_s
        self.same_clock = bool(start.boot_id) and start.boot_id == W.boot_id()
        self.cond = threading.Condition()
        self.index: int | None = None
        self.actions: dict[int, list[str]] = {}
        self.consumed = -1  # highest chunk whose actions the driver has taken
        self.reason: str | None = None  # set once: why the session is cancelled
        self.acks: dict[int, tuple[int, int]] = {}  # chunk → (client receipt ns, server arrival ns)
        self.sent: list[int] = []
        self.frames_sent = 0
        self.max_unacked = 0
        self.client_blocked_ns = 0
        self.events: dict = {}  # chunk → ChunkEvent as the driver reported it
        self.next_row = 0
        self.write: Callable | None = None  # events.jsonl writer (driver thread only)
        # a player session (DESIGN §9): input events arrive at any time, each boundary applies them
        self.player = start.input == "player"
        self.held = ""  # the keys in force (latest_wins)
        self.inbox: list[tuple[str, str]] = []  # (event id, keys) received since the last boundary
        self.input_ids: set[str] = set()
        self.applied: dict[int, tuple[list[str], int]] = {}  # chunk → (ids applied, boundary ns)

    # ---- network thread -----------------------------------------------------------------------
    def put_actions(self, msg: W.Actions) -> str | None:
        if msg.chunk >= self.chunks:
            return f"actions for chunk {msg.chunk}, but the session has {self.chunks} chunks (0-{self.chunks - 1})"
        try:
            acts = validate_actions(msg.actions, self.frames_per_chunk)
        except HarnessError as e:
            return f"chunk {msg.chunk}: {W.one_line(e)}"
        with self.cond:
            if msg.chunk <= self.consumed:
                return f"actions for chunk {msg.chunk} arrived after it was generated"
            if msg.chunk in self.actions:
                return f"actions for chunk {msg.chunk} were already received"
            self.actions[msg.chunk] = acts
            self.cond.notify_all()
        return None

    def put_input(self, msg: W.Input) -> str | None:
        """A player's event: queued for the next boundary and receipted at once (``late`` when the
        last boundary has passed, or the session is cancelled: no chunk will apply it)."""
        try:
            keys = normalize_action(msg.keys)
        except HarnessError as e:
            return f"input {msg.event_id!r}: {W.one_line(e)}"
        with self.cond:
            if self.index is None:
                return "input before the session started: wait for started"
            if msg.event_id in self.input_ids:
                return f"input event id {msg.event_id!r} was already used in this session"
            if len(self.input_ids) >= MAX_INPUTS:
                return f"more than {MAX_INPUTS} input events in one session"
            t = now()
            late = self.reason is not None or self.consumed >= self.chunks - 1
            self.input_ids.add(msg.event_id)
            if not late:
                self.inbox.append((msg.event_id, keys))
            # posted under the lock: the boundary that applies it cannot announce it before this receipt
            self.conn.post(W.encode(W.Queued(session=self.index, event_id=msg.event_id, received_ns=t, late=late)))
        return None

    def ack(self, msg: W.Ack) -> str | None:
        t = now()
        with self.cond:
            if msg.chunk not in self.sent:
                return f"ack for chunk {msg.chunk}, which was not sent"
            if msg.chunk not in self.conn.written:
                return f"ack for chunk {msg.chunk} before its media left the server (acknowledge what you have read)"
            if msg.chunk in self.acks:
                return f"chunk {msg.chunk} was already acknowledged"
            self.acks[msg.chunk] = (msg.received_ns, t)
            self.cond.notify_all()
        return None

    def cancel(self, reason: str) -> bool:
        """True when this call cancelled it (False: already cancelled)."""
        with self.cond:
            if self.reason is not None:
                return False
            self.reason = reason
            self.cond.notify_all()
            return True

    # ---- driver thread ------------------------------------------------------------------------
    def should_cancel(self, _start_ns: int, _stamps) -> bool:
        return self.reason is not None

    def contain(self, err: Exception) -> None:
        """A failure in this session's own code (its client, its messages) cancels this session
        only: the driver then ends it through the ordinary cancel path, which frees its KV blocks,
        ring slots and media, and the server goes on serving."""
        self.cancel(f"session failed: {W.one_line(f'{type(err).__name__}: {err}')}")

    def actions_for(self, chunk: int) -> list[str]:
        try:
            return self._actions_for(chunk)
        except Exception as e:
            self.contain(e)
            return [""] * self.frames_per_chunk  # generated and discarded, like any cancelled chunk

    def on_chunk(self, ev, msg) -> None:
        try:
            self._on_chunk(ev, msg)
        except Exception as e:
            self.contain(e)
            with self.cond:
                self.events.setdefault(ev.chunk, ev)  # its row is still written

    def _boundary(self, chunk: int) -> list[str]:
        """A player session's chunk boundary: what has arrived is applied (latest_wins)."""
        with self.cond:
            self.held, ids = latest_wins(self.held, self.inbox)
            self.inbox = []
            self.applied[chunk] = (ids, now())
            self.consumed = max(self.consumed, chunk)
            return [self.held] * self.frames_per_chunk

    def _actions_for(self, chunk: int) -> list[str]:
        if self.player:
            return self._boundary(chunk)
        with self.cond:
            if chunk not in self.actions and self.reason is None:
                self.conn.post(W.encode(W.NeedActions(session=self.index, chunk=chunk)))
            deadline = time.monotonic() + self.action_timeout_s
            while chunk not in self.actions and self.reason is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.reason = f"no actions for chunk {chunk} within {self.action_timeout_s:g} s"
                    break
                self.cond.wait(min(left, 0.05))
            acts = self.actions.pop(chunk, None)
            self.consumed = max(self.consumed, chunk)
        # A cancelled session's chunk is generated and discarded by the driver: any valid actions do.
        return acts if acts is not None else [""] * self.frames_per_chunk

    def _on_chunk(self, ev, msg) -> None:
        """Driver callback per chunk: forward its media within the window, keep its event."""
        blocked = 0
        if msg is not None and msg.encoded is not None and msg.media:
            with self.cond:
                t0 = now()
                while self.reason is None and len(self.sent) - len(self.acks) >= self.window:
                    if not self.conn.open:
                        self.reason = "client disconnected"
                        break
                    if now() - t0 > self.stall_timeout_s * 1e9:
                        self.reason = f"client stalled: no acknowledgement for {self.stall_timeout_s:g} s"
                        break
                    self.cond.wait(0.05)
                blocked = now() - t0
                if self.reason is None and self.conn.open:
                    ids, boundary = self.applied.get(ev.chunk, ([], None))
                    self.conn.post(W.encode(W.ChunkHeader(
                        session=ev.session, chunk=ev.chunk, frames=ev.frames, nbytes=len(msg.media),
                        pixel_sha256=msg.pixel_sha256, frame_sha256=list(msg.frame_sha256),
                        event={k: v for k, v in msgspec.to_builtins(ev).items() if k not in ("delivered",)},
                        applied=ids, boundary_ns=boundary)))
                    self.conn.post((ev.chunk, bytes(msg.media)))
                    self.sent.append(ev.chunk)
                    self.frames_sent += ev.frames
                    self.max_unacked = max(self.max_unacked, len(self.sent) - len(self.acks))
                self.client_blocked_ns += blocked
        if blocked > 1_000_000:  # under a millisecond is the lock, not the client
            ev = msgspec.structs.replace(ev, blocked_ns={**ev.blocked_ns, "client": blocked})
        with self.cond:
            self.events[ev.chunk] = ev
        self.flush_rows(final=False)  # rows of acknowledged chunks now, so a crash keeps them

    def wait_acks(self) -> None:
        """After the last chunk: wait for the outstanding acknowledgements while they keep coming
        (a slow consumer acknowledges late, but it does), at most ``stall_timeout_s`` between two."""
        with self.cond:
            acked, since = len(self.acks), time.monotonic()
            while self.reason is None and self.conn.open and len(self.acks) < len(self.sent):
                if len(self.acks) > acked:
                    acked, since = len(self.acks), time.monotonic()
                if time.monotonic() - since > self.stall_timeout_s:
                    return
                self.cond.wait(0.05)

    def flush_rows(self, final: bool) -> None:
        """events.jsonl rows in chunk order, each once its ``delivered`` is known (or never will be)."""
        write = self.write
        if write is None:
            return
        with self.cond:
            while self.next_row in self.events:
                c = self.next_row
                ev = self.events[c]
                if c in self.sent and c not in self.acks and not final:
                    return
                write(msgspec.structs.replace(ev, delivered=self._delivered(ev)))
                self.next_row += 1

    def _delivered(self, ev) -> int | None:
        if ev.chunk not in self.acks:
            return None
        client_ns, arrival_ns = self.acks[ev.chunk]
        if self.same_clock and (ev.encoded or 0) <= client_ns <= arrival_ns:
            return client_ns
        return arrival_ns


class StreamServer:
    """The session runner of ``serve --listen`` (``ServeOptions.session_runner``)."""

    ws_path = W.PATH  # the sessions' endpoint (``_handle``); subclasses serve other APIs

    def __init__(self, opts: ListenOptions) -> None:
        self.opts = opts
        self._lock = threading.Lock()
        self._pending: queue.Queue[_Session] = queue.Queue()
        self._active: _Session | None = None
        self._last: W.Ended | None = None
        self._served = 0
        self._stop = threading.Event()
        self._conns: set[_Conn] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner = None
        self.address: tuple[str, int] | None = None
        self.cfg = None
        self.operator_token = secrets.token_hex(16)

    # ---- control from other threads ------------------------------------------------------------
    def stop(self, reason: str = "server shutting down") -> None:
        """Graceful stop (e.g. SIGTERM): the running session is cancelled, no new one starts."""
        self._stop.set()
        active = self._active  # no lock: this runs in a signal handler, maybe on the thread that holds it
        if active is not None:
            active.cancel(reason)  # the session's condition is re-entrant

    # ---- driver thread -------------------------------------------------------------------------
    def __call__(self, ctx) -> None:
        self.cfg = ctx.cfg
        write_token(ctx.run_dir / "operator.token", self.operator_token)
        if self.opts.warmup_chunks and not self._stop.is_set():
            warm_up(ctx, self.opts.warmup_chunks)
        if self._stop.is_set():
            return
        self._start_network()
        try:
            while not self._stop.is_set():
                if self.opts.max_sessions is not None and self._served >= self.opts.max_sessions:
                    break
                try:
                    sess = self._pending.get(timeout=0.1)
                except queue.Empty:
                    continue
                self._run_one(ctx, sess)
        except BaseException as e:
            cause = explain_failure(ctx.launcher, e)
            why = "server interrupted" if isinstance(e, KeyboardInterrupt) else (
                cause if isinstance(cause, HarnessError) else f"{type(cause).__name__}: {cause}")
            self._close_all(W.encode(W.Error(message=W.one_line(why), fatal=True)), code=1011)
            if cause is not e:
                raise cause from e
            raise
        finally:
            self._stop.set()
            self._stop_network()

    def _run_one(self, ctx, sess: _Session) -> None:
        cfg = ctx.cfg
        idx = self._served
        sess.index = idx
        sess.conn.post(W.encode(W.Started(
            session=idx, epoch=idx, seed=sess.start.seed, preset=cfg.name, chunks=sess.chunks,
            latent_frames_per_chunk=cfg.video.frames_per_chunk, fps=cfg.video.fps, width=cfg.video.width,
            height=cfg.video.height, window=sess.window, action_timeout_s=sess.action_timeout_s,
            input=sess.start.input, same_clock=sess.same_clock)))
        control = SessionControl(actions=sess.actions_for, should_cancel=sess.should_cancel, poll_s=0.005,
                                 prompt=sess.start.prompt or f"seed {sess.start.seed}")
        original = ctx.driver.on_chunk
        ctx.driver.on_chunk = sess.on_chunk
        sess.write = ctx.write_event
        try:
            res = ctx.driver.run_session(session=idx, epoch=idx, seed=sess.start.seed, chunks=sess.chunks, control=control)
        except BaseException:
            sess.flush_rows(final=True)  # the run directory keeps what was measured
            raise
        finally:
            ctx.driver.on_chunk = original
        if not res.cancelled:
            sess.wait_acks()
            res = as_delivered(res, len(sess.acks), lost=not sess.conn.open or sess.reason is not None)
        sess.flush_rows(final=True)
        ctx.add_result(res)
        with sess.cond:
            ended = W.Ended(
                session=idx, cancelled=res.cancelled, reason=(sess.reason or "") if res.cancelled else "",
                chunks=sess.chunks, chunks_generated=len(res.events), chunks_sent=len(sess.sent),
                chunks_acked=len(sess.acks), frames_sent=sess.frames_sent,
                kv_blocks_used=int(res.kv_after.get("blocks_used", -1)),
                ring_free=-1 if res.ring_free_after is None else int(res.ring_free_after), ring_slots=ctx.ring_slots,
                media_discarded=bool(res.media is not None and res.media.discarded), max_unacked=sess.max_unacked,
                client_blocked_ns=sess.client_blocked_ns, delivered_clock="client" if sess.same_clock else "ack-receipt",
                hashes=[W.ChunkHash(chunk=h["chunk"], latent_sha256=h.get("latent_sha256", ""),
                                    pixels_sha256=h.get("pixels_sha256", "")) for h in res.chunk_hashes],
                applied=[sess.applied.get(c, ([], 0))[0] for c in range(len(res.events))] if sess.player else [])
        self._served += 1
        with self._lock:
            self._active = None  # before "ended" goes out: the client may start again at once
            self._last = ended
        sess.conn.post(W.encode(ended))

    # ---- network thread ------------------------------------------------------------------------
    def _start_network(self) -> None:
        ready = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                loop.run_until_complete(self._bind())
            except BaseException as e:
                failure.append(e)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._unbind())
                loop.close()

        self._thread = threading.Thread(target=main, name="ws-server", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            e = failure[0]
            raise HarnessError(f"cannot listen on {self.opts.host}:{self.opts.port}: {getattr(e, 'strerror', None) or e}")
        if self.opts.on_listening is not None:
            self.opts.on_listening(*self.address)

    async def _bind(self) -> None:
        app = web.Application()
        app.router.add_get(self.ws_path, self._handle)
        app.router.add_get(W.HEALTH_PATH, self._health)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, keepalive_timeout=self.opts.idle_timeout_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.opts.host, self.opts.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.address = (host, port)

    async def _unbind(self) -> None:
        for c in list(self._conns):
            c.post(None)
            await c.ws.close(code=1001, message=b"server shutting down")
        if self._runner is not None:
            await self._runner.cleanup()

    def _close_all(self, final_text: str | None, code: int) -> None:
        """From the driver thread: last words to every client, then close (bounded wait)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        async def close() -> None:
            for c in list(self._conns):
                if final_text is not None:
                    c.post(final_text)
                c.post(None)
            for c in list(self._conns):
                try:
                    await asyncio.wait_for(c.drained.wait(), 5.0)
                except asyncio.TimeoutError:
                    pass
                await c.ws.close(code=code)

        try:
            asyncio.run_coroutine_threadsafe(close(), loop).result(10)
        except Exception:
            pass

    def _stop_network(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(15)

    async def _health(self, request):
        """Readiness for load balancers: 200 once warm and serving (the port is bound only then), 503 when stopping."""
        if (refused := refusal(request, self.address, self.opts.allow_origins)) is not None:
            return refused  # the WebSocket's rules: no foreign page or rebound name may read it either
        stopping = self._stop.is_set()
        body = {"status": "stopping" if stopping else "ready", "busy": self._active is not None,
                "sessions_served": self._served, "preset": self.cfg.name if self.cfg else ""}
        return web.json_response(body, status=503 if stopping else 200)

    async def _handle(self, request):
        refused = origin_error(request.headers.get("Host"), request.headers.get("Origin"), self.address,
                               self.opts.allow_origins)
        if refused:
            return web.Response(status=403, text=refused + "\n")
        ws = MaskedFramesOnly(max_msg_size=self.opts.max_message_bytes, autoping=True, compress=False,
                              heartbeat=self.opts.heartbeat_s)
        await ws.prepare(request)
        if len(self._conns) >= self.opts.max_connections:
            await ws.send_str(W.encode(W.Busy(message=f"too many connections (limit {self.opts.max_connections})")))
            await ws.close(code=1013, message=b"busy")
            return ws
        conn = _Conn(ws, asyncio.get_running_loop())
        self._conns.add(conn)
        pump_task = asyncio.create_task(conn.pump())
        try:
            last = time.monotonic()  # the connection's last message, or the end of its running session
            while True:
                left = self._idle_left(conn, last)
                if left is None:
                    last = time.monotonic()
                elif left <= 0:
                    conn.post(W.encode(W.Error(message=f"no message for {self.opts.idle_timeout_s:g} s "
                                                       "without a running session; closing")))
                    conn.post(None)
                    await asyncio.wait_for(conn.drained.wait(), 5.0)
                    await ws.close(code=1001, message=b"idle timeout")
                    break
                # One deadline around the whole receive: aiohttp restarts its own receive timeout at
                # every pong it swallows, so a peer that only answers the heartbeat was never idle.
                try:
                    m = await asyncio.wait_for(ws.receive(), min(IDLE_POLL_S, left if left is not None else IDLE_POLL_S))
                except asyncio.TimeoutError:
                    continue
                if m.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    last = time.monotonic()
                if m.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                    break
                if m.type == WSMsgType.TEXT:
                    self._dispatch(conn, m.data)
                elif m.type == WSMsgType.BINARY:
                    self._reject(conn, "binary messages are not accepted: send JSON text messages")
                elif m.type == WSMsgType.ERROR:
                    break
                if conn.errors > self.opts.max_errors:
                    conn.post(W.encode(W.Error(message=f"too many rejected messages ({conn.errors}); closing")))
                    conn.post(None)
                    await asyncio.wait_for(conn.drained.wait(), 5.0)
                    await ws.close(code=1008, message=b"too many rejected messages")
                    break
                if conn.outq.qsize() > self.opts.max_backlog + 2 * self.opts.window:  # asks but never reads: memory is not free
                    await ws.close(code=1008, message=b"client does not read its messages")
                    break
        finally:
            await self._drop(conn, pump_task)
        return ws

    async def _drop(self, conn: _Conn, pump_task: asyncio.Task) -> None:
        """A connection is over (closed, timed out or refused): its session is cancelled, its pump
        drained (bounded), its slot freed."""
        conn.open = False
        if conn.session is not None:
            conn.session.cancel("client disconnected")
        conn.post(None)
        self._conns.discard(conn)
        try:
            await asyncio.wait_for(pump_task, 5.0)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            pump_task.cancel()

    def _idle_left(self, conn: _Conn, last: float) -> float | None:
        """Seconds the connection may still stay silent; None while it runs a session (which has its
        own timeouts). Only messages count: pongs to the server's heartbeat do not."""
        if conn.session is not None and self._active is conn.session:
            return None
        return self.opts.idle_timeout_s - (time.monotonic() - last)

    def _reject(self, conn: _Conn, message: str) -> None:
        conn.errors += 1
        conn.post(W.encode(W.Error(message=W.one_line(message))))

    def _dispatch(self, conn: _Conn, text: str) -> None:
        try:
            msg = W.decode_client(text)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return self._reject(conn, f"bad message: {W.one_line(e)}")
        s = conn.session
        if isinstance(msg, W.Start):
            self._start(conn, msg)
        elif isinstance(msg, W.Actions):
            if s is None or self._active is not s:
                return self._reject(conn, "actions without a running session: send start first")
            if s.player:
                return self._reject(conn, "actions in a player session: send input events")
            err = s.put_actions(msg)
            if err:
                self._reject(conn, err)
        elif isinstance(msg, W.Input):
            if s is None or self._active is not s:
                return self._reject(conn, "input without a running session: send start first")
            if not s.player:
                return self._reject(conn, 'input in a script session: start it with input "player" (or send actions)')
            err = s.put_input(msg)
            if err:
                self._reject(conn, err)
        elif isinstance(msg, W.Ack):
            if s is None:
                return self._reject(conn, "ack without a session")
            err = s.ack(msg)
            if err:
                self._reject(conn, err)
        elif isinstance(msg, W.Cancel):
            if s is None or self._active is not s or not s.cancel("client cancelled"):
                self._reject(conn, "no running session to cancel")
        elif isinstance(msg, W.StatusRequest):
            with self._lock:
                busy, last = self._active is not None, self._last
            owner = s is not None and last is not None and s.index == last.session
            if not owner and not token_matches(msg.token, self.operator_token):
                last = None  # a session's outcome is its own client's business (and the operator's)
            conn.post(W.encode(W.Status(preset=self.cfg.name, busy=busy, sessions_served=self._served, last=last)))

    def _start(self, conn: _Conn, msg: W.Start) -> None:
        cfg = self.cfg
        if conn.session is not None and self._active is conn.session:
            return self._reject(conn, "a session is already running on this connection; cancel it first")
        if msg.preset != cfg.name:
            return self._reject(conn, f"preset {msg.preset!r} does not match the server's {cfg.name!r}")
        if msg.image is not None:
            return self._reject(conn, "conditioning images from clients are not supported yet "
                                      "(a session is conditioned on the synthetic image of its seed)")

        if err := session_frames_error(msg.chunks or cfg.video.chunks_per_session, cfg.video.frames_per_chunk):
            return self._reject(conn, err)  # refused here, not as a dead DiT rank chunks later
        timeout = min(msg.action_timeout_s or self.opts.action_timeout_s, self.opts.action_timeout_s)
        sess = _Session(conn, msg, chunks=msg.chunks or cfg.video.chunks_per_session,
                        frames_per_chunk=cfg.video.frames_per_chunk, window=self.opts.window,
                        action_timeout_s=timeout, stall_timeout_s=self.opts.stall_timeout_s)
        with self._lock:
            if self._stop.is_set() or (self.opts.max_sessions is not None
                                       and self._served + (self._active is not None) >= self.opts.max_sessions):
                conn.post(W.encode(W.Busy(message="server is not accepting new sessions (shutting down)")))
                return
            if self._active is not None:
                conn.post(W.encode(W.Busy(message="server is busy with another session (capacity 1); try again later")))
                return
            self._active = sess
        conn.session = sess
        self._pending.put(sess)


def listen_main(args) -> int:
    """``serve --listen``: launch the topology, serve clients until stopped (SIGTERM/SIGINT) or
    ``--sessions`` sessions have been served, then tear down like any serve."""
    cfg, lo = listen_setup(args)
    if args.action_timeout is not None and not 0 < args.action_timeout <= 3600:
        raise HarnessError(f"--action-timeout must be in (0, 3600] s, got {args.action_timeout}")
    lo.action_timeout_s = args.action_timeout or ListenOptions.action_timeout_s
    server = StreamServer(lo)
    return listen_run(args, cfg, server, {"name": "websocket", "listen": args.listen, "window": lo.window,
                                          "warmup_chunks": lo.warmup_chunks, "idle_timeout_s": lo.idle_timeout_s,
                                          # the media went to the clients (DESIGN §10): media/ stays empty
                                          "media": "client"})


def listen_setup(args, runtime: dict | None = None) -> tuple:
    """The run's config (``runtime`` overrides on top) and the endpoint's ListenOptions from the
    command line, every option checked before anything starts."""
    cfg = resolve_config(args)
    if args.sink not in (None, "stream"):
        raise HarnessError(f"--listen streams each chunk to its client; --sink {args.sink} cannot be used with it")
    cfg = override(cfg, runtime={"sink": "stream", **(runtime or {})})
    host, port = parse_listen(args.listen, allow_remote=args.allow_remote)
    check_port_free(host, port)
    if args.window is not None and not 1 <= args.window <= 256:
        raise HarnessError(f"--window must be in 1-256 chunks, got {args.window}")
    lo = ListenOptions(host=host, port=port, max_sessions=args.sessions, window=args.window or ListenOptions.window,
                       **hardening_options(args, cfg))
    return cfg, lo


def listen_run(args, cfg, server: "StreamServer", protocol: dict) -> int:
    """Serve ``server``'s sessions on the launched topology; the manifest's ``protocol`` is ``protocol``."""
    faults = dict(parse_fault(f) for f in args.fault)
    server.opts.on_listening = lambda h, p: print(f"listening on ws://{h}:{p}{server.ws_path}", flush=True)
    install_stop(on_stop=server.stop)  # SIGINT and SIGTERM alike: the running session is cancelled, then teardown
    res = serve(cfg, ServeOptions(out=args.out, overwrite=getattr(args, "overwrite", False), candidates=tuple(args.candidate),
                                  hooks=parse_hooks(args.hooks).items(), progress=False, faults=faults, probes=False,
                                  session_runner=server, protocol=protocol))
    print("\n".join(run_headline(res.run_dir, res.summary)))
    print(f"  sessions served: {len(res.sessions)} ({sum(r.cancelled for r in res.sessions)} cancelled); "
          "media: with the client (python -m harness client --out DIR), not in media/")
    return 0


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another process listens on now, before any rank starts (the bind itself
    comes only after the warm-up, minutes later on a GPU). Port 0 asks for any free port."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as e:
            raise HarnessError(f"--listen {host}:{port}: cannot listen there: {e.strerror or e}") from None


def parse_fault(text: str) -> tuple[str, str]:
    """``ROLE:RANK=SPEC`` (scenarios and tests: e.g. ``dit:1=die-at-chunk:2``)."""
    key, sep, spec = text.partition("=")
    role, _, rank = key.partition(":")
    if not sep or role not in ("dit", "vae") or not rank.isdigit() or not spec.startswith("die-at-chunk:") \
            or not spec.split(":", 1)[1].isdigit():
        raise HarnessError(f"--fault {text!r}: expected ROLE:RANK=die-at-chunk:N with ROLE dit or vae")
    return f"{role}:{rank}", spec
