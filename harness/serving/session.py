"""One client session of ``serve --listen``, shared by the network thread and the replica's
driver thread (see server.py): the connection's outbox (``_Conn``) and the session's state
(``StreamSession``: actions, input events, acknowledgements, the window, the rows it writes)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

import msgspec

from harness.engine.keys import normalize_action, validate_actions
from harness.errors import HarnessError
from harness.measure.clock import now
from harness.serving import protocol as W
from harness.serving.player import latest_wins


#: input events one player session may send (each is remembered: ids must be unique)
MAX_INPUTS = 100_000


class _Conn:
    """One WebSocket, as the driver thread sees it: a thread-safe outbox."""

    def __init__(self, ws, loop: asyncio.AbstractEventLoop) -> None:
        self.ws, self.loop = ws, loop
        self.outq: asyncio.Queue = asyncio.Queue()
        self.open = True
        self.session: StreamSession | None = None
        self.errors = 0
        self.peer: str | None = None  # the remote address (the per-peer connection limit counts it)
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


class Cancellable:
    """A session's cancel, for either API's session: ``reason`` set once, under ``cond``."""

    reason: str | None
    cond: threading.Condition

    def cancel(self, reason: str) -> bool:
        """True when this call cancelled it (False: already cancelled)."""
        with self.cond:
            if self.reason is not None:
                return False
            self.reason = reason
            self.cond.notify_all()
            return True


class StreamSession(Cancellable):
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
        # admission (serving/admission.py): where it runs, and since when it waits
        self.state = "new"  # "queued", "running" (placed on a replica), "ended"
        self.replica: int | None = None
        self.queued_at = 0.0
        self.cap_s = 0.0  # wall-clock cap (admission.session_cap_s)
        self.stalls: list[dict] = []  # the replica driver's stall records; those past stalls_seen go to the client
        self.stalls_seen = 0

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

    # ---- driver thread ------------------------------------------------------------------------
    def should_cancel(self, _start_ns: int, _stamps) -> bool:
        if len(self.stalls) > self.stalls_seen:  # polled by the driver thread: the stall reaches the client now
            self._tell_stalls()
        return self.reason is not None

    def _tell_stalls(self) -> None:
        for st in self.stalls[self.stalls_seen:]:
            self.stalls_seen += 1
            rank = st.get("rank") or st["stage"]
            self.conn.post(W.encode(W.Stall(
                session=self.index if self.index is not None else -1, stage=st["stage"], rank=rank, chunk=st["chunk"],
                after_s=st["reported_after_s"],
                message=f"{rank} has made no progress for {st['reported_after_s']:g} s (chunk {st['chunk']}); still waiting")))

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
