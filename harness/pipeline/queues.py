"""Bounded queues between stages: a full queue blocks its producer, nothing is ever dropped, and
the time the producer spent blocked is accumulated — that is the backpressure signal.

Two flavours with one API (``put``, ``get``, ``close``, ``stats``):
- ``BoundedQueue``: threads of one process (a condition variable; close wakes every waiter).
- ``ProcessQueue``: between processes (a pipe, a bounded semaphore and shared counters, so
  ``stats()`` gives the same totals from either side). Given ``type=``, items cross as msgspec
  msgpack and are decoded into that struct on ``get``: typed messages, never unpickled.

``put(timeout=…)`` that runs out raises ``queue.Full`` and the item was *not* enqueued — the
caller still owns it, so nothing is dropped silently. ``close()`` wakes blocked producers with
``QueueClosed``; consumers drain what is left, then get ``QueueClosed``.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import pickle
import queue
import threading
import time
from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")


class QueueClosed(Exception):
    """The queue was closed: no more items will come (get) or be accepted (put)."""


class QueueStats(msgspec.Struct, frozen=True):
    name: str
    maxsize: int
    puts: int
    gets: int
    depth: int
    high_water: int  # deepest the queue has been right after a put
    put_blocked_ns: int  # producers' total time waiting for room
    put_blocked_count: int  # puts that had to wait at all
    get_wait_ns: int  # consumers' total time waiting for an item (starvation, not backpressure)
    put_waiting: int  # producers blocked in put right now (the counts above grow only once a wait ends)


class BoundedQueue(Generic[T]):
    def __init__(self, maxsize: int, name: str = "") -> None:
        if maxsize < 1:
            raise ValueError("a bounded queue needs maxsize ≥ 1")
        self.maxsize, self.name = maxsize, name
        self._items: collections.deque[T] = collections.deque()
        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._not_empty = threading.Condition(self._lock)
        self._closed = False
        self._puts = self._gets = self._high = 0
        self._put_blocked_ns = self._put_blocked_n = self._get_wait_ns = self._put_waiting = 0

    def put(self, item: T, timeout: float | None = None) -> int:
        """Enqueue, waiting for room. Returns the nanoseconds this call was blocked."""
        with self._lock:
            blocked = 0
            if len(self._items) >= self.maxsize and not self._closed:
                t0 = time.monotonic_ns()
                deadline = None if timeout is None else t0 + int(timeout * 1e9)
                self._put_waiting += 1
                try:
                    while len(self._items) >= self.maxsize and not self._closed:
                        left = None if deadline is None else (deadline - time.monotonic_ns()) / 1e9
                        if left is not None and left <= 0:
                            raise queue.Full
                        self._not_full.wait(left)
                finally:
                    self._put_waiting -= 1
                    blocked = time.monotonic_ns() - t0
                    self._account_block(blocked)
            if self._closed:
                raise QueueClosed(self.name)
            self._items.append(item)
            self._puts += 1
            self._high = max(self._high, len(self._items))
            self._not_empty.notify()
            return blocked

    def _account_block(self, ns: int) -> None:
        self._put_blocked_ns += ns
        self._put_blocked_n += 1

    def get(self, timeout: float | None = None) -> T:
        with self._lock:
            if not self._items and not self._closed:
                t0 = time.monotonic_ns()
                deadline = None if timeout is None else t0 + int(timeout * 1e9)
                try:
                    while not self._items and not self._closed:
                        left = None if deadline is None else (deadline - time.monotonic_ns()) / 1e9
                        if left is not None and left <= 0:
                            raise queue.Empty
                        self._not_empty.wait(left)
                finally:
                    self._get_wait_ns += time.monotonic_ns() - t0
            if not self._items:
                raise QueueClosed(self.name)
            item = self._items.popleft()
            self._gets += 1
            self._not_full.notify()
            return item

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._not_full.notify_all()
            self._not_empty.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def qsize(self) -> int:
        return len(self._items)

    def stats(self) -> QueueStats:
        with self._lock:
            return QueueStats(self.name, self.maxsize, self._puts, self._gets, len(self._items), self._high,
                              self._put_blocked_ns, self._put_blocked_n, self._get_wait_ns, self._put_waiting)


# Shared counter slots of ProcessQueue.
_PUTS, _GETS, _HIGH, _BLOCKED_NS, _BLOCKED_N, _GET_WAIT_NS, _WAITING = _SLOTS = range(7)
_COUNTER = {"puts": _PUTS, "gets": _GETS, "blocked_ns": _BLOCKED_NS, "blocked_n": _BLOCKED_N,
            "get_wait_ns": _GET_WAIT_NS, "waiting": _WAITING}


class ProcessQueue(Generic[T]):
    """Create in the parent, hand to child processes as a ``Process`` argument (it pickles with
    its multiprocessing primitives). Closing is seen by the other side within ``poll_s``.

    A pipe plus a bounded semaphore rather than ``multiprocessing.Queue``: the latter sends from
    a feeder thread, and handing the GIL back and forth with it cost ~5 ms per message (the
    interpreter's switch interval) when the main thread is busy copying frames. Here ``put``
    sends synchronously; a semaphore unit is held from ``put`` until the matching ``get``, so at
    most ``maxsize`` items are ever in flight."""

    def __init__(self, maxsize: int, name: str = "", type: Any = None, ctx=None, poll_s: float = 0.05) -> None:
        if maxsize < 1:
            raise ValueError("a bounded queue needs maxsize ≥ 1")
        ctx = ctx or mp.get_context("spawn")
        self.maxsize, self.name, self.type, self.poll_s = maxsize, name, type, poll_s
        self._reader, self._writer = ctx.Pipe(duplex=False)
        self._room = ctx.BoundedSemaphore(maxsize)
        self._rlock, self._wlock = ctx.Lock(), ctx.Lock()
        self._counters = ctx.Array("q", len(_SLOTS))  # int64, with its own lock
        self._closed = ctx.Event()
        self._init_codec()

    def _init_codec(self) -> None:
        if self.type is not None:
            self._encode = msgspec.msgpack.Encoder().encode
            self._decode = msgspec.msgpack.Decoder(self.type).decode
        else:
            self._encode = lambda obj: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            self._decode = pickle.loads

    def __getstate__(self):
        state = self.__dict__.copy()
        del state["_encode"], state["_decode"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_codec()

    def _add(self, **deltas: int) -> None:
        with self._counters.get_lock():
            c = self._counters
            for k, v in deltas.items():
                c[_COUNTER[k]] += v
            if "puts" in deltas:
                c[_HIGH] = max(c[_HIGH], c[_PUTS] - c[_GETS])

    def put(self, item: T, timeout: float | None = None) -> int:
        if self._closed.is_set():
            raise QueueClosed(self.name)
        payload = self._encode(item)
        blocked = 0
        if not self._room.acquire(False):
            t0 = time.monotonic_ns()
            deadline = None if timeout is None else t0 + int(timeout * 1e9)
            self._add(waiting=1)
            try:
                while True:
                    if self._closed.is_set():
                        raise QueueClosed(self.name)
                    left = self.poll_s if deadline is None else min(self.poll_s, (deadline - time.monotonic_ns()) / 1e9)
                    if left <= 0:
                        raise queue.Full
                    if self._room.acquire(True, left):
                        break
            finally:
                blocked = time.monotonic_ns() - t0
                self._add(blocked_ns=blocked, blocked_n=1, waiting=-1)
        try:
            with self._wlock:
                self._writer.send_bytes(payload)
        except BaseException:
            self._room.release()
            raise
        self._add(puts=1)
        return blocked

    def get(self, timeout: float | None = None) -> T:
        t0 = time.monotonic_ns()
        deadline = None if timeout is None else t0 + int(timeout * 1e9)
        try:
            with self._rlock:
                while not self._reader.poll(self.poll_s if deadline is None else
                                            max(0.0, min(self.poll_s, (deadline - time.monotonic_ns()) / 1e9))):
                    if self._closed.is_set():
                        raise QueueClosed(self.name)
                    if deadline is not None and time.monotonic_ns() >= deadline:
                        raise queue.Empty
                payload = self._reader.recv_bytes()
        finally:
            self._add(get_wait_ns=time.monotonic_ns() - t0)
        self._add(gets=1)  # counted before the room is given back, so depth never reads > maxsize
        self._room.release()
        return self._decode(payload)

    def close(self) -> None:
        self._closed.set()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def qsize(self) -> int:
        with self._counters.get_lock():
            return self._counters[_PUTS] - self._counters[_GETS]

    def stats(self) -> QueueStats:
        with self._counters.get_lock():
            c = list(self._counters)
        return QueueStats(self.name, self.maxsize, c[_PUTS], c[_GETS], c[_PUTS] - c[_GETS], c[_HIGH],
                          c[_BLOCKED_NS], c[_BLOCKED_N], c[_GET_WAIT_NS], c[_WAITING])
