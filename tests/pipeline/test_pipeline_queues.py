"""Bounded queues: a full queue blocks the producer, the wait is accounted, nothing is dropped."""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time

import msgspec
import pytest

from harness.pipeline.queues import BoundedQueue, ProcessQueue, QueueClosed

from helpers.procs import wait_for

CTX = mp.get_context("spawn")


class Msg(msgspec.Struct, frozen=True):
    i: int
    tag: str


def _blocked(q) -> tuple[int, int]:
    """(puts that ended a wait, puts waiting now), from one read so the two agree."""
    st = q.stats()
    return st.put_blocked_count, st.put_waiting


def _hold_until_waiting(q, ended: int) -> None:
    """Wait until ``ended`` blocked puts have finished waiting and the next one is blocked: the
    hold that follows is then that put's blocked time."""
    wait_for(lambda: _blocked(q) == (ended, 1), 30, f"put {ended + 2} to block")


def test_thread_queue_blocks_accounts_and_keeps_order():
    """6 puts into 2 places: puts 2..5 each wait for a get, and before each of those gets the
    consumer holds 50 ms once the producer is seen blocked, so ≥ 4 × 50 ms blocked is a fact."""
    q: BoundedQueue[int] = BoundedQueue(2, "t")
    got = []

    def consumer():
        for i in range(6):
            if i < 4:
                _hold_until_waiting(q, ended=i)
                time.sleep(0.05)
            got.append(q.get(timeout=5))

    t = threading.Thread(target=consumer)
    t.start()
    t0 = time.monotonic_ns()
    blocked = sum(q.put(i) for i in range(6))
    elapsed = time.monotonic_ns() - t0
    t.join(5)
    st = q.stats()
    assert got == list(range(6))
    assert st.puts == st.gets == 6 and st.depth == 0 and st.high_water == 2
    assert st.put_blocked_ns == blocked and 4 * 50_000_000 <= blocked <= elapsed
    assert st.put_blocked_count == 4 and st.put_waiting == 0


def test_thread_queue_timeout_close_semantics():
    q: BoundedQueue[str] = BoundedQueue(1)
    q.put("a")
    with pytest.raises(queue.Full):
        q.put("b", timeout=0.05)
    assert q.qsize() == 1 and q.stats().put_blocked_ns >= 50_000_000  # "b" was not enqueued

    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(QueueClosed, q.put, "c")))
    t.start()
    time.sleep(0.05)
    q.close()
    t.join(5)
    assert not t.is_alive() and errors
    assert q.get() == "a"  # consumers drain what was accepted before closing
    with pytest.raises(QueueClosed):
        q.get()
    with pytest.raises(queue.Empty):
        BoundedQueue(1).get(timeout=0.01)


def _mp_producer(q: ProcessQueue, blocked: ProcessQueue) -> None:
    blocked.put(sum(q.put(Msg(i, f"m{i}")) for i in range(6)))


def test_process_queue_typed_blocks_and_shares_stats():
    """As the thread test, across processes: the counts the producer keeps are read here."""
    q: ProcessQueue[Msg] = ProcessQueue(2, "p", type=Msg, ctx=CTX)
    blocked = ProcessQueue(1, "blocked", ctx=CTX)
    p = CTX.Process(target=_mp_producer, args=(q, blocked))
    p.start()
    got = []
    for i in range(6):
        if i < 4:
            _hold_until_waiting(q, ended=i)
            time.sleep(0.05)
        got.append(q.get(timeout=10))
    producer_blocked = blocked.get(timeout=30)
    p.join(10)
    assert p.exitcode == 0
    assert got == [Msg(i, f"m{i}") for i in range(6)]
    st = q.stats()  # counted in the producer process, read here
    assert st.puts == st.gets == 6 and st.high_water == 2
    assert st.put_blocked_ns == producer_blocked >= 4 * 50_000_000
    assert st.put_blocked_count == 4 and st.put_waiting == 0
    q.close()
    with pytest.raises(QueueClosed):
        q.get(timeout=1)
    with pytest.raises(QueueClosed):
        q.put(Msg(9, "late"))
