"""Admission and routing of ``serve --listen``: which replica serves a session, and who waits.

Every replica (engine group) serves one session at a time; a session stays on the replica it was
placed on for its whole life (session-affine). A ``start`` goes to a free live replica — the one
that has served the fewest sessions, so load spreads — or, when every live one is busy, into a
bounded FIFO queue (the client is told its position) until a replica frees, its wait times out
or it leaves. A freed replica takes the head of the queue *before* its own client hears
``ended``, so a peer that just finished cannot jump ahead of peers already waiting (fair
admission). A replica whose rank died is drained: nothing new is routed to it; one with a
stopped rank (SIGSTOP) takes nothing new until the rank runs again.

Pure bookkeeping under one lock: no messages are sent here; the server posts what the results say.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

#: sessions that may wait for a replica (``--queue``), and how long each may wait (``--queue-timeout``)
DEFAULT_QUEUE = 4
DEFAULT_QUEUE_TIMEOUT_S = 60.0
#: a session's wall-clock cap by default: this much, plus a generous bound per chunk requested
#: (a chunk takes well under a second at the target rate; a client acking each one 50 s late is capped)
SESSION_CAP_BASE_S = 120.0
SESSION_CAP_PER_CHUNK_S = 10.0
#: WebSocket connections one peer (remote address) may hold at once (``--max-peer-connections``)
DEFAULT_PEER_CONNECTIONS = 4


def session_cap_s(chunks: int, fixed_s: float | None) -> float:
    """The wall-clock cap of a session of ``chunks`` chunks (``fixed_s`` when the operator set one)."""
    return fixed_s if fixed_s is not None else SESSION_CAP_BASE_S + chunks * SESSION_CAP_PER_CHUNK_S


@dataclass(eq=False)
class Slot:
    """One replica as the router sees it. ``ctx``: its ServeContext (its own driver and launcher)."""

    index: int
    ctx: Any
    active: Any = None  # the session it runs
    dead: str | None = None  # why it was drained (the rank named)
    stalled: str | None = None  # a stopped rank seen while idle
    served: int = 0
    pending: queue.Queue = field(default_factory=queue.Queue)  # the session placed on it, for its thread

    @property
    def state(self) -> str:
        return "dead" if self.dead else "stalled" if self.stalled else "busy" if self.active is not None else "ready"

    def health(self) -> dict:
        return {"replica": self.index, "state": self.state, "sessions_served": self.served,
                "reason": self.dead or self.stalled or ""}


class Router:
    """Placement, the waiting queue and the counts behind ``busy``; ``lock`` guards everything."""

    def __init__(self, slots: list[Slot], queue_limit: int = DEFAULT_QUEUE,
                 queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S) -> None:
        self.lock = threading.RLock()
        self.slots, self.queue_limit, self.queue_timeout_s = slots, queue_limit, queue_timeout_s
        self.waiting: deque = deque()  # sessions, each with ``queued_at`` (monotonic s)
        self.served = 0
        self.next_index = 0
        self.deaths: list[str] = []  # why each drained replica was drained, in the order they died

    # ---- placement ------------------------------------------------------------------------------
    def place(self, sess, may_queue: bool = True) -> tuple[str, Any]:
        """``("placed", slot)``, ``("queued", position)`` (1: next) or ``("refused", reason)``."""
        with self.lock:
            slot = self._free()
            if slot is not None:
                self._assign(slot, sess)
                return "placed", slot
            if not self.live():
                return "refused", "no replica can serve: " + "; ".join(s.dead or "" for s in self.slots)
            busy = f"{self.running()} sessions running on {len(self.live())} replicas"
            if not may_queue:
                return "refused", f"server is busy ({busy}; capacity {len(self.live())}); try again later"
            if len(self.waiting) >= self.queue_limit:
                return "refused", (f"server is busy ({busy}) and {self.queue_limit} sessions already wait for a replica "
                                   "(the most it holds); try again later")
            sess.queued_at, sess.state = time.monotonic(), "queued"
            self.waiting.append(sess)
            return "queued", len(self.waiting)

    def _free(self) -> Slot | None:
        free = [s for s in self.slots if s.state == "ready"]
        return min(free, key=lambda s: (s.served, s.index)) if free else None

    def _assign(self, slot: Slot, sess) -> None:
        slot.active = sess
        sess.replica, sess.state = slot.index, "running"
        slot.pending.put(sess)

    def admit(self) -> tuple[list, list]:
        """Waiting sessions onto free replicas, in arrival order: (placed sessions, (session,
        new position) of those still waiting when the queue moved)."""
        with self.lock:
            placed = []
            while self.waiting and (slot := self._free()) is not None:
                sess = self.waiting.popleft()
                self._assign(slot, sess)
                placed.append(sess)
            moved = [(s, i + 1) for i, s in enumerate(self.waiting)] if placed else []
            return placed, moved

    def new_index(self) -> int:
        with self.lock:
            self.next_index += 1
            return self.next_index - 1

    def release(self, slot: Slot) -> tuple[list, list]:
        """``slot``'s session is over: the replica is free and takes the head of the queue first."""
        with self.lock:
            slot.active = None
            slot.served += 1
            self.served += 1
            return self.admit()

    def withdraw(self, sess) -> list | None:
        """A waiting session leaves the queue (its client left or cancelled): the (session, new
        position) of those behind it; None if it was not waiting."""
        with self.lock:
            try:
                i = list(self.waiting).index(sess)
            except ValueError:
                return None
            del self.waiting[i]
            return [(s, j + 1) for j, s in enumerate(self.waiting) if j >= i]

    def expired(self, now_s: float) -> list:
        """Waiting sessions whose wait passed ``queue_timeout_s``, taken out of the queue."""
        with self.lock:
            out = [s for s in self.waiting if now_s - s.queued_at >= self.queue_timeout_s]
            for s in out:
                self.waiting.remove(s)
            return out

    def positions(self) -> list:
        """(session, position) of every waiting session, 1 being next."""
        with self.lock:
            return [(s, j + 1) for j, s in enumerate(self.waiting)]

    def fail(self, slot: Slot, reason: str) -> Any:
        """Drain ``slot`` (its rank died): nothing more is routed to it; returns the session it ran."""
        with self.lock:
            slot.dead = reason
            self.deaths.append(reason)
            sess, slot.active = slot.active, None
            return sess

    # ---- counts ---------------------------------------------------------------------------------
    def live(self) -> list[Slot]:
        return [s for s in self.slots if not s.dead]

    def running(self) -> int:
        return sum(s.active is not None for s in self.slots)

    def owed(self) -> int:
        """Sessions served, running or waiting (``--sessions`` caps this)."""
        with self.lock:
            return self.served + self.running() + len(self.waiting)
