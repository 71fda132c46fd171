"""``serve --listen``: a WebSocket endpoint in front of the synchronous driver.

Two threads. The *driver thread* is serve's own: it runs one session at a time through
``Driver.run_session`` with a ``SessionControl`` whose callbacks read what the client sent. The
*network thread* runs an aiohttp application on its own event loop. They meet in one ``StreamSession``
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
from harness.drivers.config_options import launcher_options, resolve_config
from harness.drivers.replicas import parse_replica_gpus
from harness.drivers.serve_run import ServeOptions, serve
from harness.drivers.signals import install as install_stop
from harness.errors import HarnessError
from harness.hooks import parse_hooks
from harness.limits import session_frames_error
from harness.measure.headline import run_headline
from harness.serving import protocol as W
from harness.serving.admission import (DEFAULT_PEER_CONNECTIONS, DEFAULT_QUEUE, DEFAULT_QUEUE_TIMEOUT_S, Router,
                                       session_cap_s)
from harness.serving.guards import (DEFAULT_IDLE_TIMEOUT_S, MaskedFramesOnly, hardening_options, origin_error, refusal,
                                    token_matches)
from harness.serving.outcome import as_delivered
from harness.serving.replica_runner import ReplicaRunner
from harness.serving.session import _Conn, StreamSession


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
    replicas: int = 1  # engine groups (serve launches them: ServeOptions.replicas)
    replica_gpus: tuple[tuple[int, ...], ...] = ()
    queue: int = DEFAULT_QUEUE  # sessions that may wait for a free replica
    queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S  # the longest wait, then busy
    session_cap_s: float | None = None  # a session's wall-clock cap (None: admission.session_cap_s's default)
    max_peer_connections: int = DEFAULT_PEER_CONNECTIONS  # connections one remote address may hold
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


class StreamServer(ReplicaRunner):
    """The session runner of ``serve --listen`` (``ServeOptions.session_runner``): the network
    endpoint here, the replicas' driver threads in ReplicaRunner, the routing in admission.Router."""

    ws_path = W.PATH  # the sessions' endpoint (``_handle``); subclasses serve other APIs

    def __init__(self, opts: ListenOptions) -> None:
        self.opts = opts
        self._lock = threading.Lock()
        self._last: W.Ended | None = None
        self._stop = threading.Event()
        self._fatal: BaseException | None = None  # a replica thread's failure that is no rank's death
        self._conns: set[_Conn] = set()
        self._peers: dict[str, int] = {}  # remote address → open connections
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner = None
        self.address: tuple[str, int] | None = None
        self.cfg = None
        self.router: Router | None = None
        self._manifest: dict = {}
        self.operator_token = secrets.token_hex(16)

    @property
    def _served(self) -> int:
        return self.router.served if self.router is not None else 0

    # ---- control from other threads ------------------------------------------------------------
    def stop(self, reason: str = "server shutting down") -> None:
        """Graceful stop (e.g. SIGTERM): the running sessions are cancelled, no new one starts."""
        self._stop.set()
        if self.router is not None:  # no lock: this runs in a signal handler, maybe on the thread that holds it
            self._cancel_running(reason)  # a session's condition is re-entrant

    # ---- driver threads (one per replica) ------------------------------------------------------
    def _run_one(self, ctx, sess: StreamSession) -> None:
        cfg = ctx.cfg
        idx = self.router.new_index()
        sess.index = idx
        sess.stalls, sess.stalls_seen = ctx.driver.stalls, len(ctx.driver.stalls)
        sess.conn.post(W.encode(W.Started(
            session=idx, epoch=idx, seed=sess.start.seed, preset=cfg.name, chunks=sess.chunks,
            latent_frames_per_chunk=cfg.video.frames_per_chunk, fps=cfg.video.fps, width=cfg.video.width,
            height=cfg.video.height, window=sess.window, action_timeout_s=sess.action_timeout_s,
            input=sess.start.input, same_clock=sess.same_clock, replica=sess.replica or 0,
            session_cap_s=sess.cap_s)))
        control = SessionControl(actions=sess.actions_for, should_cancel=sess.should_cancel, poll_s=0.005,
                                 prompt=sess.start.prompt or f"seed {sess.start.seed}")
        original = ctx.driver.on_chunk
        ctx.driver.on_chunk = sess.on_chunk
        sess.write = ctx.write_event
        cap = threading.Timer(sess.cap_s, sess.cancel, (f"session ran past its wall-clock cap ({sess.cap_s:g} s)",))
        cap.daemon = True
        cap.start()
        try:
            res = ctx.driver.run_session(session=idx, epoch=idx, seed=sess.start.seed, chunks=sess.chunks, control=control)
            if not res.cancelled:
                sess.wait_acks()
        except BaseException:
            sess.flush_rows(final=True)  # the run directory keeps what was measured
            raise
        finally:
            cap.cancel()
            ctx.driver.on_chunk = original
        if not res.cancelled:
            res = as_delivered(res, len(sess.acks), lost=not sess.conn.open or sess.reason is not None)
        sess.flush_rows(final=True)
        ctx.add_result(res)
        ended = self._ended(ctx, sess, res)
        with self._lock:
            self._last = ended
        # the replica is free before "ended" goes out, and takes the head of the queue first:
        # its client may start again at once, behind those already waiting (fair admission)
        self._release(ctx, sess)
        sess.conn.post(W.encode(ended))

    def _release(self, ctx, sess) -> None:
        slot = next(s for s in self.router.slots if s.ctx.driver is ctx.driver)
        _placed, moved = self.router.release(slot)
        sess.state = "ended"
        for waiting, pos in moved:
            self._tell_moved(waiting, pos)

    def _ended(self, ctx, sess: StreamSession, res) -> W.Ended:
        with sess.cond:
            return W.Ended(
                session=sess.index, cancelled=res.cancelled, reason=(sess.reason or "") if res.cancelled else "",
                chunks=sess.chunks, chunks_generated=len(res.events), chunks_sent=len(sess.sent),
                chunks_acked=len(sess.acks), frames_sent=sess.frames_sent,
                kv_blocks_used=int(res.kv_after.get("blocks_used", -1)),
                ring_free=-1 if res.ring_free_after is None else int(res.ring_free_after), ring_slots=ctx.ring_slots,
                media_discarded=bool(res.media is not None and res.media.discarded), max_unacked=sess.max_unacked,
                client_blocked_ns=sess.client_blocked_ns, delivered_clock="client" if sess.same_clock else "ack-receipt",
                hashes=[W.ChunkHash(chunk=h["chunk"], latent_sha256=h.get("latent_sha256", ""),
                                    pixels_sha256=h.get("pixels_sha256", "")) for h in res.chunk_hashes],
                applied=[sess.applied.get(c, ([], 0))[0] for c in range(len(res.events))] if sess.player else [],
                replica=sess.replica or 0)

    def _end_on_failure(self, sess, reason: str, fatal: bool) -> None:
        """The session of a replica that died: its client is told why (and, when the server goes
        down with it, that too); with other replicas serving it gets ``ended`` as a cancelled session."""
        sess.cancel(reason)
        sess.state = "ended"
        sess.conn.post(W.encode(W.Error(message=W.one_line(reason), fatal=fatal)))
        if not fatal:
            with sess.cond:
                sess.conn.post(W.encode(W.Ended(
                    session=sess.index if sess.index is not None else -1, cancelled=True, reason=W.one_line(reason),
                    chunks=sess.chunks, chunks_generated=-1, chunks_sent=len(sess.sent), chunks_acked=len(sess.acks),
                    frames_sent=sess.frames_sent, kv_blocks_used=-1, ring_free=-1, ring_slots=-1, media_discarded=False,
                    max_unacked=sess.max_unacked, client_blocked_ns=sess.client_blocked_ns,
                    delivered_clock="client" if sess.same_clock else "ack-receipt", replica=sess.replica or 0)))

    def _refuse_waiting(self, sess, reason: str) -> None:
        sess.state = "ended"
        sess.conn.post(W.encode(W.Busy(message=W.one_line(reason))))

    def _tell_moved(self, sess, position: int) -> None:
        sess.conn.post(W.encode(W.InQueue(position=position, limit=self.opts.queue,
                                          timeout_s=self.opts.queue_timeout_s)))

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
        body = {**self.health(), "preset": self.cfg.name if self.cfg else ""}
        return web.json_response(body, status=200 if body["status"] in ("ready", "degraded") else 503)

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
        if crowded := self._peer_enter(request.remote):
            await ws.send_str(W.encode(W.Busy(message=crowded)))
            await ws.close(code=1013, message=b"busy")
            return ws
        conn = _Conn(ws, asyncio.get_running_loop())
        conn.peer = request.remote
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
            if self.router is not None:
                for waiting, pos in self.router.withdraw(conn.session) or []:  # it left the queue with its client
                    self._tell_moved(waiting, pos)
        conn.post(None)
        if conn in self._conns and conn.peer in self._peers:
            self._peers[conn.peer] = self._peers.get(conn.peer, 1) - 1
        self._conns.discard(conn)
        try:
            await asyncio.wait_for(pump_task, 5.0)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            pump_task.cancel()

    def _peer_enter(self, peer: str | None) -> str | None:
        """Count a new connection of ``peer`` (its remote address); the refusal when it holds its limit."""
        if self._peers.get(peer, 0) >= self.opts.max_peer_connections:
            return f"too many connections from {peer} (limit {self.opts.max_peer_connections} per peer)"
        self._peers[peer] = self._peers.get(peer, 0) + 1
        return None

    def _idle_left(self, conn: _Conn, last: float) -> float | None:
        """Seconds the connection may still stay silent; None while it runs a session (which has its
        own timeouts). Only messages count: pongs to the server's heartbeat do not."""
        if conn.session is not None and conn.session.state in ("queued", "running"):
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
            if s is None or s.state != "running":
                return self._reject(conn, "actions without a running session: send start first")
            if s.player:
                return self._reject(conn, "actions in a player session: send input events")
            err = s.put_actions(msg)
            if err:
                self._reject(conn, err)
        elif isinstance(msg, W.Input):
            if s is None or s.state != "running":
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
            if s is not None and s.state == "queued" and (moved := self.router.withdraw(s)) is not None:
                self._refuse_waiting(s, "left the queue: cancelled before a replica was free")
                for waiting, pos in moved:
                    self._tell_moved(waiting, pos)
            elif s is None or s.state != "running" or not s.cancel("client cancelled"):
                self._reject(conn, "no running session to cancel")
        elif isinstance(msg, W.StatusRequest):
            health = self.health()
            with self._lock:
                busy, last = health["busy"], self._last
            owner = s is not None and last is not None and s.index == last.session
            if not owner and not token_matches(msg.token, self.operator_token):
                last = None  # a session's outcome is its own client's business (and the operator's)
            conn.post(W.encode(W.Status(preset=self.cfg.name, busy=busy, sessions_served=self._served, last=last,
                                        waiting=health["waiting"])))

    def _start(self, conn: _Conn, msg: W.Start) -> None:
        cfg = self.cfg
        if conn.session is not None and conn.session.state in ("queued", "running"):
            return self._reject(conn, f"a session is already {conn.session.state} on this connection; cancel it first")
        if msg.preset != cfg.name:
            return self._reject(conn, f"preset {msg.preset!r} does not match the server's {cfg.name!r}")
        if msg.image is not None:
            return self._reject(conn, "conditioning images from clients are not supported yet "
                                      "(a session is conditioned on the synthetic image of its seed)")

        if err := session_frames_error(msg.chunks or cfg.video.chunks_per_session, cfg.video.frames_per_chunk):
            return self._reject(conn, err)  # refused here, not as a dead DiT rank chunks later
        timeout = min(msg.action_timeout_s or self.opts.action_timeout_s, self.opts.action_timeout_s)
        sess = StreamSession(conn, msg, chunks=msg.chunks or cfg.video.chunks_per_session,
                        frames_per_chunk=cfg.video.frames_per_chunk, window=self.opts.window,
                        action_timeout_s=timeout, stall_timeout_s=self.opts.stall_timeout_s)
        sess.cap_s = min(session_cap_s(sess.chunks, self.opts.session_cap_s), msg.session_cap_s or float("inf"))
        if self._stop.is_set() or (self.opts.max_sessions is not None and self.router.owed() >= self.opts.max_sessions):
            conn.post(W.encode(W.Busy(message="server is not accepting new sessions (shutting down)")))
            return
        conn.session = sess
        outcome, detail = self.router.place(sess)
        if outcome == "refused":
            conn.session = None
            conn.post(W.encode(W.Busy(message=W.one_line(detail))))
        elif outcome == "queued":
            self._tell_moved(sess, detail)


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
                       **hardening_options(args, cfg), **admission_options(args, cfg))
    return cfg, lo


def admission_options(args, cfg) -> dict:
    """ListenOptions fields from --replicas, --replica-gpus, --queue, --queue-timeout, --session-cap and
    --max-peer-connections, each checked here (before anything starts)."""
    replicas = getattr(args, "replicas", None)
    gpus = parse_replica_gpus(getattr(args, "replica_gpus", None), 1 if replicas is None else replicas, cfg.runtime.device)
    out = {"replicas": 1 if replicas is None else replicas, "replica_gpus": gpus}
    for flag, name, lo, hi, key in (("--queue", "queue", 1, 1000, "queue"),
                                    ("--max-peer-connections", "max_peer_connections", 1, ListenOptions.max_connections,
                                     "max_peer_connections")):
        v = getattr(args, name, None)
        if v is not None and not lo <= v <= hi:
            raise HarnessError(f"{flag} must be in {lo}-{hi}, got {v}")
        if v is not None:
            out[key] = v
    for flag, name, hi, key in (("--queue-timeout", "queue_timeout", 3600, "queue_timeout_s"),
                                ("--session-cap", "session_cap", 7 * 86400, "session_cap_s")):
        v = getattr(args, name, None)
        if v is not None and not 0 < v <= hi:  # also refuses nan
            raise HarnessError(f"{flag} must be in (0, {hi}] s, got {v}")
        if v is not None:
            out[key] = v
    return out


def listen_run(args, cfg, server: "StreamServer", protocol: dict) -> int:
    """Serve ``server``'s sessions on the launched topology; the manifest's ``protocol`` is ``protocol``."""
    faults = dict(parse_fault(f) for f in args.fault)
    server.opts.on_listening = lambda h, p: print(f"listening on ws://{h}:{p}{server.ws_path}", flush=True)
    install_stop(on_stop=server.stop)  # SIGINT and SIGTERM alike: the running session is cancelled, then teardown
    protocol = {**protocol, "replicas": server.opts.replicas, "queue": server.opts.queue,
                "queue_timeout_s": server.opts.queue_timeout_s, "session_cap_s": server.opts.session_cap_s,
                "max_peer_connections": server.opts.max_peer_connections}
    res = serve(cfg, ServeOptions(out=args.out, overwrite=getattr(args, "overwrite", False), candidates=tuple(args.candidate),
                                  hooks=parse_hooks(args.hooks), progress=False, faults=faults, probes=False,
                                  session_runner=server, protocol=protocol, replicas=server.opts.replicas,
                                  replica_gpus=server.opts.replica_gpus, **launcher_options(args)))
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
