"""``serve --listen --api vllm-omni``: the harness's pipeline behind vLLM-Omni's realtime API.

The same machinery as the harness's own endpoint (``serving/server.py``: the driver thread, the
network thread, the connection's outbox and its guards: Origin/Host, connection limit, healthz,
rejected-message and backlog limits); what differs is the wire (``omni_protocol``) and who holds
the actions. A session, as production runs it: one per connection; ``session.start`` within
``start_timeout_s`` (production's 10 s) carries the whole camera script; the server sends
``video.start``, then per chunk its metadata and one binary fragmented-MP4 frame, then
``session.done``, and closes. A start refused closes the connection after its ``error`` (so does
production's handler); a refused control message is answered and the session goes on.

Interactions (two-phase receipt). ``session.interaction.queued`` answers on arrival; everything
queued before chunk k's submit is applied at chunk k (camera: the latest keys win and are held
from k on, over the script) and chunk k's metadata lists those ids in ``applied_event_ids``.
Prompt changes are acknowledged but not rendered (the engine keeps one prompt per session): they
are listed in ``unrendered_event_ids`` of the chunk that took them, never in ``applied``.

Backpressure is production's: none but TCP. A chunk's media is handed to the socket and the
driver goes on while at most ``window`` chunks wait for the socket to take them; beyond that the
driver thread waits (``blocked_ns["client"]``) and the pipeline stops behind it. ``delivered`` is
the server's time that ``send`` of the chunk's media completed (the socket took the bytes): this
API has no acknowledgement, so there is no client receipt time.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass

import msgspec
from aiohttp import WSMsgType, web

from harness.drivers.driver import SessionControl
from harness.errors import HarnessError
from harness.measure.clock import now
from harness.serving import omni_protocol as O
from harness.serving import protocol as W
from harness.serving.guards import MaskedFramesOnly, origin_error
from harness.serving.omni_requests import (InteractionRequest, Refusal, StartPolicy, StartRequest, parse_interaction,
                                           parse_start)
from harness.serving.server import ListenOptions, StreamServer, _Conn, listen_run, listen_setup
from harness.serving.session import Cancellable

#: boundaries of a chunk that exist when its media is sent (``delivered`` comes after)
SENT_BOUNDARIES = ("submit", "dit_start", "dit_end", "latent_ready", "decode_submit", "decode_start", "decode_end",
                   "gpu_ready", "cpu_ready", "received", "encoded")


@dataclass(frozen=True)
class OmniOptions:
    start_timeout_s: float = O.START_TIMEOUT_S
    stall_timeout_s: float = O.STALL_TIMEOUT_S
    policy: StartPolicy = StartPolicy()


class OmniSession(Cancellable):
    """One production-API session shared by both threads; its fields are guarded by ``cond``."""

    def __init__(self, conn: _Conn, req: StartRequest, *, frames_per_chunk: int, window: int,
                 stall_timeout_s: float) -> None:
        self.conn, self.req, self.chunks = conn, req, req.chunks
        self.frames_per_chunk, self.window, self.stall_timeout_s = frames_per_chunk, window, stall_timeout_s
        self.request_id = f"video_stream-{uuid.uuid4().hex}"
        self.boot_id = W.boot_id()
        self.cond = threading.Condition()
        self.index: int | None = None
        self.reason: str | None = None  # set once: why the session is cancelled
        self.stopped = False  # the client sent session.stop
        self.held: str | None = None  # camera keys of the latest applied camera interaction
        self.queued: list[InteractionRequest] = []  # arrived, not yet taken by a chunk
        self.closed = False  # session.done decided: nothing more is queued
        self.event_ids: set[str] = set()
        self.taken: dict[int, tuple[list[str], list[str], int]] = {}  # chunk → (applied, unrendered ids, cutoff ns)
        self.posted: list[int] = []
        self.written_at: dict[int, int] = {}  # chunk → server ns its media send completed
        self.events: dict = {}
        self.next_row = 0
        self.write = None  # events.jsonl writer (driver thread only)
        self.progress = time.monotonic()  # production's stall clock: chunk sent, ping
        self.finished: asyncio.Event | None = None  # set on the network loop once session.done is out

    # ---- network thread -----------------------------------------------------------------------
    def queue(self, it: InteractionRequest) -> str:
        """"queued"; "conflict" when the event id was seen before in this session (production's
        conflict); "closed" once session.done is decided (production has stopped reading then)."""
        with self.cond:
            if self.closed:
                return "closed"
            if it.event_id in self.event_ids:
                return "conflict"
            self.event_ids.add(it.event_id)
            self.queued.append(it)
            return "queued"

    def on_written(self, chunk: int) -> None:
        with self.cond:
            self.written_at[chunk] = now()
            self.progress = time.monotonic()
            self.cond.notify_all()

    def stalled(self) -> bool:
        return time.monotonic() - self.progress > self.stall_timeout_s

    # ---- driver thread ------------------------------------------------------------------------
    def should_cancel(self, _start_ns: int, _stamps) -> bool:
        return self.reason is not None

    def actions_for(self, chunk: int) -> list[str]:
        """Chunk ``chunk``'s keys, taking every interaction queued so far (called just before its submit)."""
        with self.cond:
            taken, self.queued = self.queued, []
            applied = [it.event_id for it in taken if it.keys is not None]
            unrendered = [it.event_id for it in taken if it.prompt is not None]
            for it in taken:
                if it.keys is not None:
                    self.held = it.keys
            self.taken[chunk] = (applied, unrendered, now())
            held = self.held
        if held is not None:
            return [held] * self.frames_per_chunk
        script = self.req.script
        return list(script[chunk]) if chunk < len(script) else [""] * self.frames_per_chunk

    def on_chunk(self, ev, msg) -> None:
        try:
            self._on_chunk(ev, msg)
        except Exception as e:  # this session's own failure cancels this session only
            self.cancel(f"session failed: {W.one_line(f'{type(e).__name__}: {e}')}")
            with self.cond:
                self.events.setdefault(ev.chunk, ev)

    def _on_chunk(self, ev, msg) -> None:
        blocked = 0
        if msg is not None and msg.encoded is not None and msg.media:
            with self.cond:
                self.progress = time.monotonic()  # generation progress, as production's engine outputs
                t0 = now()
                while self.reason is None and len(self.posted) - len(self.written_at) >= self.window:
                    if not self.conn.open:
                        self.reason = "client disconnected"
                        break
                    self.cond.wait(0.05)  # the network thread notifies on every completed send
                blocked = now() - t0
                if self.reason is None and self.conn.open:
                    self.conn.post(O.encode(self.metadata(ev, msg)))
                    self.conn.post((ev.chunk, bytes(msg.media)))
                    self.posted.append(ev.chunk)
        if blocked > 1_000_000:  # under a millisecond is the lock, not the client
            ev = msgspec.structs.replace(ev, blocked_ns={**ev.blocked_ns, "client": blocked})
        with self.cond:
            self.events[ev.chunk] = ev
        self.flush_rows(final=False)

    def metadata(self, ev, msg) -> O.ChunkMetadata:
        applied, unrendered, cutoff = self.taken.get(ev.chunk, ([], [], None))
        stamps = msgspec.to_builtins(ev)
        return O.ChunkMetadata(
            request_id=self.request_id, kind="media", num_frames=ev.frames, byte_length=len(msg.media),
            generation_chunk_index=ev.chunk, transport_chunk_index=len(self.posted), applied_event_ids=applied,
            unrendered_event_ids=unrendered, server_boot_id=self.boot_id,
            server_timestamps={k: stamps[k] for k in SENT_BOUNDARIES if stamps.get(k) is not None},
            frame_sha256=list(msg.frame_sha256), interaction_cutoff_ns=cutoff)

    def wait_sent(self) -> None:
        """After the last chunk: until the socket took every chunk's media (or the client left)."""
        with self.cond:
            while self.reason is None and self.conn.open and len(self.written_at) < len(self.posted):
                if self.stalled():
                    return
                self.cond.wait(0.05)

    def flush_rows(self, final: bool) -> None:
        """events.jsonl rows in chunk order, each once its ``delivered`` is known (or never will be)."""
        if self.write is None:
            return
        with self.cond:
            while self.next_row in self.events:
                c = self.next_row
                if c in self.posted and c not in self.written_at and not final:
                    return
                self.write(msgspec.structs.replace(self.events[c], delivered=self.written_at.get(c)))
                self.next_row += 1


class OmniServer(StreamServer):
    """The session runner of ``serve --listen --api vllm-omni``."""

    ws_path = O.PATH

    def __init__(self, opts: ListenOptions, omni: OmniOptions) -> None:
        super().__init__(opts)
        self.omni = omni

    # ---- driver thread -------------------------------------------------------------------------
    def _run_one(self, ctx, sess: OmniSession) -> None:
        idx = self.router.new_index()
        sess.index = idx
        # an empty prompt means what it means in the harness's own API ("seed {seed}"), never the
        # driver's per-session default: the same request must make the same video in any session
        control = SessionControl(actions=sess.actions_for, should_cancel=sess.should_cancel, poll_s=0.005,
                                 prompt=sess.req.start.prompt or f"seed {sess.req.seed}")
        original = ctx.driver.on_chunk
        ctx.driver.on_chunk = sess.on_chunk
        sess.write = ctx.write_event
        try:
            res = ctx.driver.run_session(session=idx, epoch=idx, seed=sess.req.seed, chunks=sess.chunks, control=control)
        except BaseException:
            sess.flush_rows(final=True)
            raise
        finally:
            ctx.driver.on_chunk = original
        if not res.cancelled:
            sess.wait_sent()
        sess.flush_rows(final=True)
        ctx.add_result(res)
        self._release(ctx, sess)
        with sess.cond:
            sess.closed = True
            done = O.SessionDone(request_id=sess.request_id, chunks=len(sess.written_at),
                                 stopped=res.cancelled or sess.stopped,
                                 unapplied_event_ids=[it.event_id for it in sess.queued])
        sess.conn.post(O.encode(done))
        if self._loop is not None and sess.finished is not None:
            self._loop.call_soon_threadsafe(sess.finished.set)

    # ---- network thread ------------------------------------------------------------------------
    async def _handle(self, request):
        refused = origin_error(request.headers.get("Host"), request.headers.get("Origin"), self.address,
                               self.opts.allow_origins)
        if refused:
            return web.Response(status=403, text=refused + "\n")
        ws = MaskedFramesOnly(max_msg_size=O.MAX_FRAME_BYTES, autoping=True, compress=False,
                              heartbeat=self.opts.heartbeat_s)
        await ws.prepare(request)
        conn = _Conn(ws, asyncio.get_running_loop())
        if len(self._conns) >= self.opts.max_connections:
            await ws.send_str(O.encode(O.Error(message=f"too many connections (limit {self.opts.max_connections})",
                                               code="busy")))
            await ws.close(code=1013, message=b"busy")
            return ws
        if crowded := self._peer_enter(request.remote):
            await ws.send_str(O.encode(O.Error(message=crowded, code="busy")))
            await ws.close(code=1013, message=b"busy")
            return ws
        conn.peer = request.remote
        self._conns.add(conn)
        pump_task = asyncio.create_task(conn.pump())
        try:
            sess = await self._receive_start(conn)
            if sess is not None:
                await self._control(conn, sess)
        finally:
            await self._drop(conn, pump_task)
            await ws.close()
        return ws

    async def _receive_start(self, conn: _Conn) -> OmniSession | None:
        """Production's start: one text message within the start timeout, or an error and the end."""
        try:
            m = await conn.ws.receive(timeout=self.omni.start_timeout_s)
        except asyncio.TimeoutError:
            return await self._refuse(conn, O.START_TIMEOUT)
        if m.type != WSMsgType.TEXT:
            if m.type == WSMsgType.BINARY:
                return await self._refuse(conn, O.START_NOT_OBJECT)
            return None  # closed, or a frame over the transport's limit (closed with 1009)
        req = parse_start(m.data, self.cfg, self.omni.policy)
        if isinstance(req, str):
            return await self._refuse(conn, req)
        sess = OmniSession(conn, req, frames_per_chunk=self.cfg.video.frames_per_chunk, window=self.opts.window,
                           stall_timeout_s=self.omni.stall_timeout_s)
        if self._stop.is_set() or (self.opts.max_sessions is not None and self.router.owed() >= self.opts.max_sessions):
            return await self._refuse(conn, "server is not accepting new sessions (shutting down)", "busy")
        sess.finished = asyncio.Event()
        conn.session = sess
        # production's one session per server: no queue; a start while it runs is refused at once
        outcome, detail = self.router.place(sess, may_queue=False)
        if outcome == "refused":
            conn.session = None
            return await self._refuse(conn, detail.replace("capacity 1", "capacity 1, production's"), "busy")
        conn.on_written = sess.on_written
        conn.post(O.encode(O.VideoStart(request_id=sess.request_id, format=O.FORMAT, config=req.config,
                                        ignored_fields=["image_reference"] if req.image_ignored else [])))
        return sess

    def _end_on_failure(self, sess, reason: str, fatal: bool) -> None:
        """Production's error frame for a session whose engine died (the server goes down with it)."""
        sess.cancel(reason)
        sess.state = "ended"
        sess.conn.post(O.encode(O.Error(message=reason, request_id=sess.request_id)))

    async def _refuse(self, conn: _Conn, message: str, code: str | None = None) -> None:
        conn.post(O.encode(O.Error(message=message, code=code)))
        conn.post(None)
        await asyncio.wait_for(conn.drained.wait(), 5.0)
        return None

    async def _control(self, conn: _Conn, sess: OmniSession) -> None:
        """Control messages until the session is done (production's control loop and its checks)."""
        finished = asyncio.create_task(sess.finished.wait())
        recv: asyncio.Task | None = None
        try:
            while not finished.done():
                recv = recv or asyncio.create_task(conn.ws.receive())
                await asyncio.wait({recv, finished}, timeout=min(1.0, self.omni.stall_timeout_s),
                                   return_when=asyncio.FIRST_COMPLETED)
                if sess.stalled() and sess.cancel(O.STALL):
                    conn.post(O.encode(O.Error(message=O.STALL)))
                if not recv.done():
                    continue
                m, recv = recv.result(), None
                if m.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                    return
                if m.type != WSMsgType.TEXT:
                    self._say(conn, O.CONTROL_NOT_OBJECT)
                else:
                    self._dispatch_control(conn, sess, m.data)
                if conn.errors > self.opts.max_errors or conn.outq.qsize() > self.opts.max_backlog + 2 * self.opts.window:
                    conn.post(O.encode(O.Error(message="too many rejected or unread messages; closing")))
                    return
            await asyncio.wait_for(conn.drained.wait() if not conn.open else _drain(conn), 10.0)
        finally:
            finished.cancel()
            if recv is not None:
                recv.cancel()

    def _say(self, conn: _Conn, message: str, **kw) -> None:
        conn.errors += 1
        conn.post(O.encode(O.Error(message=message, **kw)))

    def _dispatch_control(self, conn: _Conn, sess: OmniSession, text: str) -> None:
        if len(text) > O.MAX_CONTROL_MESSAGE_CHARS:
            return self._say(conn, O.CONTROL_TOO_LARGE)
        try:
            msg = msgspec.json.decode(text)
        except msgspec.DecodeError:
            return self._say(conn, O.CONTROL_BAD_JSON)
        if not isinstance(msg, dict):
            return self._say(conn, O.CONTROL_NOT_OBJECT)
        kind = msg.get("type")
        if kind == "session.stop":
            with sess.cond:
                sess.stopped = True
            sess.cancel("client stopped the session")
        elif kind == "session.ping":
            sess.progress = time.monotonic()
            conn.post(O.encode(O.SessionPong()))
        elif kind == "session.interaction":
            it = parse_interaction(msg)
            if isinstance(it, Refusal):
                return self._say(conn, it.message, code=it.code, event_id=it.event_id,
                                 request_id=sess.request_id if it.code else None)
            state = sess.queue(it)
            if state == "conflict":
                return self._say(conn, O.EVENT_ID_CONFLICT, code="event_id_conflict", request_id=sess.request_id,
                                 event_id=it.event_id)
            if state == "queued":
                conn.post(O.encode(O.InteractionQueued(request_id=sess.request_id, event_id=it.event_id)))
        else:
            self._say(conn, O.UNKNOWN_TYPE.format(kind))


async def _drain(conn: _Conn) -> None:
    """Until the pump has sent everything queued (session.done included), then end it."""
    conn.post(None)
    await conn.drained.wait()


def omni_listen_main(args) -> int:
    """``serve --listen --api vllm-omni``: the options checked, then served like ``--api harness``."""
    if args.action_timeout is not None:
        raise HarnessError("--action-timeout is for --api harness: a vllm-omni session carries its actions in session.start")
    for flag, v in (("--start-timeout", args.start_timeout), ("--stall-timeout", args.stall_timeout)):
        if v is not None and not 0 < v <= 3600:
            raise HarnessError(f"{flag} must be in (0, 3600] s, got {v}")
    if (getattr(args, "replicas", None) or 1) > 1 or getattr(args, "queue", None) is not None:
        raise HarnessError("--api vllm-omni serves one session per server, as production does: "
                           "--replicas and --queue are for --api harness")
    cfg, lo = listen_setup(args, runtime={"container": "fmp4"})
    omni = OmniOptions(start_timeout_s=args.start_timeout or O.START_TIMEOUT_S,
                       stall_timeout_s=args.stall_timeout or O.STALL_TIMEOUT_S,
                       policy=StartPolicy(model=args.served_model_name, image_reference=args.image_reference))
    lo.stall_timeout_s = omni.stall_timeout_s
    return listen_run(args, cfg, OmniServer(lo, omni), {
        "name": "websocket", "api": "vllm-omni", "path": O.PATH, "listen": args.listen,
        "send_window": lo.window,  # chunks handed to the socket and not yet taken by it ("window" is the measurement's)
        "warmup_chunks": lo.warmup_chunks, "start_timeout_s": omni.start_timeout_s,
        "stall_timeout_s": omni.stall_timeout_s, "served_model_name": omni.policy.model,
        "image_reference": omni.policy.image_reference, "media": "client", "container": "fmp4",
        "codec": "libx264rgb qp 0 (lossless RGB)",
        # no acknowledgement in this API: the server's time the socket took the chunk's bytes
        "delivered": "server-send-completed"})
