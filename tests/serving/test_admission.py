"""The router of ``serve --listen`` on its own (no processes): placement, the FIFO queue, fairness,
withdrawal, expiry, draining a dead replica; and the session cap's default."""

from __future__ import annotations

from types import SimpleNamespace

from harness.serving.admission import SESSION_CAP_BASE_S, SESSION_CAP_PER_CHUNK_S, Router, Slot, session_cap_s


def _router(n: int = 2, queue: int = 2, timeout_s: float = 10.0) -> Router:
    return Router([Slot(i, ctx=None) for i in range(n)], queue, timeout_s)


def _sess(name: str):
    return SimpleNamespace(name=name, state="new", replica=None, queued_at=0.0)


def test_placement_is_least_loaded_then_fifo_then_refused():
    r = _router()
    r.slots[0].served = 3  # replica 1 has served fewer: it takes the first session
    a, b, c, d, e = (_sess(x) for x in "abcde")
    assert r.place(a) == ("placed", r.slots[1]) and a.replica == 1 and a.state == "running"
    assert r.place(b) == ("placed", r.slots[0])
    assert r.place(c) == ("queued", 1) and c.state == "queued"
    assert r.place(d) == ("queued", 2)
    outcome, why = r.place(e)
    assert outcome == "refused" and "2 sessions already wait" in why
    assert r.slots[1].pending.get_nowait() is a and r.owed() == 4


def test_a_freed_replica_takes_the_head_of_the_queue_before_its_client_can_start_again():
    r = _router(n=1)
    a, b = _sess("a"), _sess("b")
    r.place(a)
    r.place(b)
    r.slots[0].pending.get_nowait()
    placed, moved = r.release(r.slots[0])  # a's session is over
    assert placed == [b] and moved == [] and r.slots[0].active is b
    again = _sess("a2")  # a starts again at once: it waits behind b's session
    assert r.place(again) == ("queued", 1)


def test_leaving_or_expiring_moves_those_behind_up():
    r = _router(n=1, queue=3, timeout_s=5.0)
    r.place(_sess("running"))
    b, c, d = _sess("b"), _sess("c"), _sess("d")
    for s in (b, c, d):
        r.place(s)
    assert r.withdraw(c) == [(d, 2)] and r.withdraw(c) is None
    b.queued_at, d.queued_at = 0.0, 100.0
    assert r.expired(now_s=104.0) == [b] and r.positions() == [(d, 1)]


def test_a_dead_replica_is_drained_and_named_when_none_is_left():
    r = _router()
    a = _sess("a")
    r.place(a)
    assert r.fail(r.slots[0], "encoder (pid 1) died: killed by signal 9 (replica 0)") is a
    assert r.slots[0].state == "dead" and r.place(_sess("b")) == ("placed", r.slots[1])
    r.fail(r.slots[1], "dit rank 1 (pid 2) died: exit code 1 (replica 1)")
    outcome, why = r.place(_sess("c"))
    assert outcome == "refused" and "encoder (pid 1) died" in why and "dit rank 1 (pid 2) died" in why


def test_a_stalled_replica_takes_nothing_new_until_it_runs_again():
    r = _router(n=1)
    r.slots[0].stalled = "vae rank 0 (pid 3) is stopped (replica 0)"
    assert r.place(_sess("a"))[0] == "queued"
    r.slots[0].stalled = None
    placed, _ = r.admit()
    assert [s.name for s in placed] == ["a"]


def test_the_session_cap_is_a_generous_bound_per_chunk_unless_set():
    assert session_cap_s(10, None) == SESSION_CAP_BASE_S + 10 * SESSION_CAP_PER_CHUNK_S
    # the 341-chunk session of a client acking each chunk 50 s late (≈ 4.7 h) is cut well short of that
    assert session_cap_s(341, None) < 341 * 50 / 4
    assert session_cap_s(341, 30.0) == 30.0
