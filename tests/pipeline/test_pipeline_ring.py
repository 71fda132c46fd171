"""Frame ring: exact transfer between processes, bounded slots in flight, no leaked /dev/shm."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import msgspec
import numpy as np
import pytest

from harness.pipeline.queues import ProcessQueue
from harness.pipeline.ring import (FrameRing, RingClosed, RingSpec, SlotRef, StaleSlot,
                                   leftover_segments)

from helpers.procs import wait_for

CTX = mp.get_context("spawn")
SHAPES = [(9, 32, 48, 3), (12, 32, 48, 3), (12, 32, 48, 3), (5, 32, 48, 3)] * 3


def _chunk(i: int, shape) -> np.ndarray:
    return np.random.default_rng(1000 + i).integers(0, 256, shape, dtype=np.uint8)


def _producer(spec_bytes: bytes, q: ProcessQueue, blocked: ProcessQueue) -> None:
    ring = FrameRing.attach(msgspec.msgpack.decode(spec_bytes, type=RingSpec))
    for i, shape in enumerate(SHAPES):
        ref = ring.acquire(session=7, chunk=i)
        ring.buffer(ref, shape)[...] = _chunk(i, shape)  # the in-place path a D2H copy takes
        q.put(ring.publish(ref, shape))
    blocked.put(ring.blocked_ns)
    ring.close()


def _prefix(request) -> str:
    return f"hnt-{os.getpid()}-{request.node.name[:20]}"


def test_two_process_transfer_exact_and_bounded(request):
    prefix = _prefix(request)
    slots = 3
    ring = FrameRing.create(prefix, slots, 12 * 32 * 48 * 3)
    try:
        q = ProcessQueue(64, "refs", type=SlotRef, ctx=CTX)  # deep: only the ring may bound the producer
        blocked = ProcessQueue(1, "blocked", ctx=CTX)
        p = CTX.Process(target=_producer, args=(msgspec.msgpack.encode(ring.spec), q, blocked))
        p.start()
        # nothing is released before every slot is taken, so the producer's next acquire has to wait
        wait_for(lambda: ring.stats().in_use == slots, 30, "every slot in use")
        max_in_use = 0
        for i, shape in enumerate(SHAPES):
            ref = q.get(timeout=30)
            assert (ref.session, ref.chunk, ref.shape) == (7, i, shape)
            time.sleep(0.03)  # a slow consumer: the producer must run out of slots and wait
            st = ring.stats()
            max_in_use = max(max_in_use, st.in_use)
            assert st.in_use <= slots
            view = ring.claim(ref)
            assert not view.flags.writeable
            np.testing.assert_array_equal(view, _chunk(i, shape))
            del view
            ring.release(ref)
            ring.check()
        producer_blocked = blocked.get(timeout=30)
        p.join(30)
        assert p.exitcode == 0
        st = ring.stats()
        assert max_in_use == slots and st.high_water == slots
        assert st.free == slots and st.acquires == st.releases == len(SHAPES)
        assert producer_blocked > 0 and st.blocked_ns >= producer_blocked and st.blocked_count > 0
    finally:
        ring.close()
    assert leftover_segments(prefix) == []


def _hold_slot(spec_bytes: bytes, ready) -> None:
    ring = FrameRing.attach(msgspec.msgpack.decode(spec_bytes, type=RingSpec))
    ring.acquire(session=3)
    ready.set()
    time.sleep(60)


def test_producer_sigkill_slot_reclaimed_and_segments_freed(request):
    prefix = _prefix(request)
    ring = FrameRing.create(prefix, 2, 4096)
    ready = CTX.Event()
    p = CTX.Process(target=_hold_slot, args=(msgspec.msgpack.encode(ring.spec), ready))
    p.start()
    try:
        assert ready.wait(30)
        assert ring.stats().writing == 1
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert len(ring.reclaim()) == 1
        assert ring.stats().free == 2 and ring.stats().reclaimed == 1
        ring.check()
        ref = ring.put(np.ones((2, 4, 4, 3), np.uint8))  # the lock was not left held
        ring.release(ref)
    finally:
        ring.close()
    assert leftover_segments(prefix) == []


def test_owner_sigkill_resource_tracker_unlinks(tmp_path):
    prefix = f"hnt-{os.getpid()}-ownerkill"
    code = textwrap.dedent(f"""
        import sys, time
        from harness.pipeline.ring import FrameRing
        ring = FrameRing.create({prefix!r}, 2, 4096)
        print("ready", flush=True)
        time.sleep(60)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        assert len(leftover_segments(prefix)) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        while leftover_segments(prefix) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert leftover_segments(prefix) == []
    finally:
        proc.kill()
        for name in leftover_segments(prefix):
            os.unlink(f"/dev/shm/{name}")


def test_full_ring_blocks_times_out_and_records_wait(request):
    prefix = _prefix(request)
    with FrameRing.create(prefix, 2, 1024) as ring:
        a = ring.acquire()
        b = ring.acquire()
        assert ring.try_acquire() is None
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            ring.acquire(timeout=0.1)
        assert time.monotonic() - t0 >= 0.1
        assert ring.blocked_ns >= 100_000_000 and ring.stats().blocked_count == 1
        ring.release(a)
        c = ring.acquire(timeout=1)
        assert c.slot == a.slot and c.generation > b.generation
        with pytest.raises(StaleSlot):
            ring.release(a)  # a's slot now belongs to c
        ring.release(b)
        ring.release(c)
        ring.check()
    assert leftover_segments(prefix) == []


def test_cancel_reclaims_session_and_owner_close_wakes_producer(request):
    prefix = _prefix(request)
    ring = FrameRing.create(prefix, 2, 1024)
    other = FrameRing.attach(ring.spec)
    r1 = other.put(np.zeros((1, 8, 8, 3), np.uint8), session=5, chunk=0)
    r2 = other.put(np.zeros((1, 8, 8, 3), np.uint8), session=6, chunk=0)
    assert sorted(ring.reclaim(session=5)) == [r1.slot]
    with pytest.raises(StaleSlot):
        ring.claim(r1)  # the message in flight for a cancelled chunk fails loudly
    ring.claim(r2)
    other.acquire()  # takes the reclaimed slot; the ring is full again
    errors = []

    def blocked():
        try:
            other.acquire(timeout=10)
        except RingClosed as e:
            errors.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.05)
    ring.close()
    t.join(5)
    assert not t.is_alive() and len(errors) == 1
    other.close()
    assert leftover_segments(prefix) == []


def test_spec_roundtrip_and_ring_not_picklable(request):
    prefix = _prefix(request)
    with FrameRing.create(prefix, 1, 100) as ring:
        spec = msgspec.msgpack.decode(msgspec.msgpack.encode(ring.spec), type=RingSpec)
        assert spec == ring.spec and spec.slot_bytes % 4096 == 0
        with pytest.raises(TypeError):
            pickle.dumps(ring)
        with pytest.raises(Exception):
            ring.buffer(ring.acquire(), (2, 4096))  # larger than a slot
    assert leftover_segments(prefix) == []


@pytest.mark.parametrize("where", ["segments", "tracking", "finalizer", "header"])
def test_a_signal_during_creation_leaves_no_segments(where, request, monkeypatch):
    """serve's SIGTERM handler raises wherever the main thread is: one that lands while the ring is
    being made (its segments exist, their finalizer not yet) must not leave them behind, nor tell
    the resource tracker to forget a name it was never told (its process prints a KeyError)."""
    from harness.pipeline import ring as R

    told: list[tuple[str, bool]] = []
    real_track = R._track

    def interrupted(*a, **k):
        raise KeyboardInterrupt("stopped by SIGTERM")

    def track(name: str, register: bool) -> None:
        if where == "tracking" and register and told:  # the second name's registration
            interrupted()
        told.append((name, register))
        real_track(name, register)

    monkeypatch.setattr(R, "_track", track)
    if where != "tracking":
        target = {"segments": (R.np, "frombuffer"), "finalizer": (R.weakref, "finalize"), "header": (R.np, "arange")}
        monkeypatch.setattr(*target[where], interrupted)
    prefix = _prefix(request)
    with pytest.raises(KeyboardInterrupt):
        FrameRing.create(prefix, 2, 100)
    assert leftover_segments(prefix) == []
    registered = [n for n, r in told if r]
    untold = [n for n, r in told if not r]
    assert sorted(untold) == sorted(registered)  # each name told is untold once, and no other
    assert len(registered) == {"segments": 0, "tracking": 1, "finalizer": 2, "header": 2}[where]
