"""``serve --listen --replicas 2`` with real processes (tiny preset, CPU): two sessions at once, one
replica each; the admission queue (positions, a full queue, its timeout, fairness); a session's
wall-clock cap; the per-peer connection limit; a stopped encoder's stall reaching the client named;
a rank killed mid-session ends that session named and the other replica serves a newcomer; the
last replica's rank killed while idle takes the server down, named, leaving nothing behind.
One module-scoped server; the tests run in file order (the last ones take a replica down)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request

import aiohttp
import pytest

from harness.experiments.scenario import ServerProcess
from harness.measure.events import read_events, read_sessions
from harness.serving import protocol as W
from harness.serving.client import run_session
from tests.helpers.procs import wait_for

QUEUE, QUEUE_TIMEOUT_S, PEER_LIMIT = 2, 20, 6
GUARD_S = 120  # a hang guard, never a figure under test


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # SP 2 (a follower DiT rank is killed below), one VAE rank: 4 processes a replica instead of 5
    srv = ServerProcess(["--preset", "tiny", "--replicas", "2", "--vae-ranks", "1", "--warmup-chunks", "0", "--window", "1",
                         "--queue", str(QUEUE), "--queue-timeout", str(QUEUE_TIMEOUT_S), "--action-timeout", "120",
                         "--max-peer-connections", str(PEER_LIMIT), "--set", "runtime.stall_report_s=1.0"],
                        tmp_path_factory.mktemp("replicas") / "run")
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def _health(srv) -> dict:
    url = srv.url.replace("ws://", "http://").replace(W.PATH, W.HEALTH_PATH)
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503: still a body
        return json.loads(e.read())


def _pids(srv) -> dict[int, dict[str, int]]:
    man = json.loads((srv.out / "manifest.json").read_text())
    return {r["replica"]: r["pids"] for r in man["replicas"]}


class Raw:
    """A WebSocket client that records every message and acts only when told (holds a replica).
    A reader task takes every frame as it comes, so the heartbeat's pings are answered even while
    the test attends to another client."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http, self.url, self.msgs = http, url, []
        self.ws = None
        self.inbox: asyncio.Queue = asyncio.Queue()

    async def open(self) -> "Raw":
        self.ws = await self.http.ws_connect(self.url)
        self.reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        while True:
            m = await self.ws.receive()
            await self.inbox.put(m)
            if m.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                return

    async def send(self, msg) -> None:
        await self.ws.send_str(W.encode(msg))

    async def frame(self, timeout: float = GUARD_S):
        m = await asyncio.wait_for(self.inbox.get(), timeout)
        assert m.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY), f"connection ended: {m}; had {self.msgs}"
        return m

    async def next(self, *types, timeout: float = GUARD_S):
        """The next text message of one of ``types`` (media frames and others are kept, skipped)."""
        while True:
            m = await self.frame(timeout)
            if m.type == aiohttp.WSMsgType.BINARY:
                continue
            msg = W.decode_server(m.data)
            self.msgs.append(msg)
            if isinstance(msg, types):
                return msg

    async def play(self, until=(W.Ended,), acts: int = 3):
        """Answer need_actions and ack every chunk until a message of ``until`` arrives (returned)."""
        while True:
            msg = await self.next(W.NeedActions, W.ChunkHeader, *until)
            if isinstance(msg, W.NeedActions):
                await self.send(W.Actions(chunk=msg.chunk, actions=[""] * acts))
            elif isinstance(msg, W.ChunkHeader):
                await self.frame()  # its media frame
                await self.send(W.Ack(chunk=msg.chunk, received_ns=0))
            else:
                return msg


def _start(seed: int, chunks: int = 2, **kw) -> W.Start:
    return W.Start(preset="tiny", seed=seed, chunks=chunks, **kw)


def test_two_sessions_run_at_once_each_on_one_replica(server):
    async def two():
        return await asyncio.gather(*(run_session(server.url, preset="tiny", seed=s, chunks=2) for s in (1, 2)))

    reps = asyncio.run(two())
    assert all(r.outcome == "complete" for r in reps), [r.error for r in reps]
    ids = {r.started.session for r in reps}
    assert {r.started.replica for r in reps} == {0, 1}  # least-loaded: the second went to the free replica
    events = [e for e in read_events(server.out / "events.jsonl") if e.session in ids]
    by = {s: [e for e in events if e.session == s] for s in ids}
    # session-affine: every chunk of a session on the replica it started on, and its sessions row says so
    for r in reps:
        assert {e.replica for e in by[r.started.session]} == {r.started.replica}
    a, b = (by[s] for s in sorted(ids))
    # overlap from the server's own boundaries: each began before the other's last chunk was encoded
    assert min(e.submit for e in a) < max(e.encoded for e in b) and min(e.submit for e in b) < max(e.encoded for e in a)


def test_the_queue_is_fifo_bounded_and_fair(server):
    async def go():
        async with aiohttp.ClientSession() as http:
            a, b, c, d, e = [await Raw(http, server.url).open() for _ in range(5)]
            for i, cl in enumerate((a, b)):  # both replicas held: each waits for its first actions
                await cl.send(_start(20 + i))
                await cl.next(W.Started)
            await c.send(_start(22))
            qc = await c.next(W.InQueue)
            await d.send(_start(23))
            qd = await d.next(W.InQueue)
            await e.send(_start(24))
            full = await e.next(W.Busy)
            await a.send(W.Cancel())  # a's replica frees: the head of the queue (c) takes it …
            ended_a = await a.next(W.Ended)
            await a.send(_start(25))  # … and a, starting again at once, waits behind d
            qa = await a.next(W.InQueue, W.Started)
            started_c = await c.next(W.Started)
            qd2 = await d.next(W.InQueue)
            await d.send(W.Cancel())  # leaving the queue is answered, and a moves up
            left_d = await d.next(W.Busy)
            qa2 = await a.next(W.InQueue)
            for cl in (b, c):
                await cl.send(W.Cancel())
                await cl.next(W.Ended)
            started_a = await a.next(W.Started)
            await a.send(W.Cancel())
            await a.next(W.Ended)
            return qc, qd, full, ended_a, qa, started_c, qd2, left_d, qa2, started_a

    qc, qd, full, ended_a, qa, started_c, qd2, left_d, qa2, started_a = asyncio.run(go())
    assert (qc.position, qd.position, qc.limit, qc.timeout_s) == (1, 2, QUEUE, QUEUE_TIMEOUT_S)
    assert "already wait for a replica" in full.message
    assert ended_a.cancelled and started_c.replica == ended_a.replica  # c took a's replica
    assert isinstance(qa, W.InQueue) and qa.position == 2, qa  # a did not jump ahead of d
    assert qd2.position == 1 and "left the queue" in left_d.message and qa2.position == 1
    assert started_a.session > started_c.session


def test_a_queued_session_times_out_with_busy(server):
    async def go():
        async with aiohttp.ClientSession() as http:
            a, b, c = [await Raw(http, server.url).open() for _ in range(3)]
            for i, cl in enumerate((a, b)):
                await cl.send(_start(30 + i))
                await cl.next(W.Started)
            await c.send(_start(32))
            await c.next(W.InQueue)
            busy = await c.next(W.Busy, timeout=QUEUE_TIMEOUT_S + GUARD_S)
            for cl in (a, b):
                await cl.send(W.Cancel())
                await cl.next(W.Ended)
            return busy

    busy = asyncio.run(go())
    assert "queue timeout" in busy.message


def test_a_late_acking_client_is_ended_by_the_wall_clock_cap(server):
    async def go():
        async with aiohttp.ClientSession() as http:
            late = await Raw(http, server.url).open()
            await late.send(_start(40, chunks=4, session_cap_s=2.0))
            started = await late.next(W.Started)
            while True:  # actions whenever asked, but never an ack: the window of 1 stays full
                msg = await late.next(W.NeedActions, W.Ended)
                if isinstance(msg, W.Ended):
                    return started, msg
                await late.send(W.Actions(chunk=msg.chunk, actions=[""] * 3))

    started, ended = asyncio.run(go())
    assert started.session_cap_s == 2.0
    assert ended.cancelled and "wall-clock cap (2 s)" in ended.reason and ended.chunks_acked == 0
    assert _health(server)["busy"] is False  # its replica is free again


def test_one_peer_is_held_to_its_connection_limit(server):
    async def go():
        async with aiohttp.ClientSession() as http:
            socks = [await http.ws_connect(server.url) for _ in range(PEER_LIMIT)]
            extra = await http.ws_connect(server.url)
            m = await extra.receive(timeout=GUARD_S)
            for ws in socks:
                await ws.close()
            return W.decode_server(m.data)

    busy = asyncio.run(go())
    assert isinstance(busy, W.Busy) and f"limit {PEER_LIMIT} per peer" in busy.message


async def _started_on(http, srv, seed: int, rank: str):
    """A 3-chunk session, started: its client, ``started``, and the pid of ``rank`` on its replica."""
    cl = await Raw(http, srv.url).open()
    await cl.send(_start(seed, chunks=3))
    started = await cl.next(W.Started)
    return cl, started, _pids(srv)[started.replica][rank]


def test_a_stopped_encoder_reaches_the_client_named_then_the_session_goes_on(server):
    async def go():
        async with aiohttp.ClientSession() as http:
            cl, _started, enc = await _started_on(http, server, 50, "encoder")
            os.kill(enc, signal.SIGSTOP)
            try:
                stall = await cl.play(until=(W.Stall, W.Ended))
            finally:
                os.kill(enc, signal.SIGCONT)
            return enc, stall, await cl.play()

    enc, stall, ended = asyncio.run(go())
    assert isinstance(stall, W.Stall), stall
    assert stall.rank.startswith(f"encoder (pid {enc}, stopped)") and "no progress" in stall.message
    assert not ended.cancelled and ended.chunks_acked == 3  # SIGCONT: it went on to the end


def test_a_rank_stopped_while_idle_shows_in_healthz(server):
    vae = _pids(server)[1]["vae rank 0"]
    os.kill(vae, signal.SIGSTOP)
    try:
        wait_for(lambda: _health(server)["replicas"][1]["state"] == "stalled", GUARD_S, "the stall in /healthz")
        row = _health(server)["replicas"][1]
        assert row["reason"] == f"vae rank 0 (pid {vae}) is stopped (replica 1)"
    finally:
        os.kill(vae, signal.SIGCONT)
    wait_for(lambda: _health(server)["replicas"][1]["state"] == "ready", GUARD_S, "the replica ready again")


def test_a_rank_killed_mid_session_ends_that_session_named_and_the_other_replica_serves(server):
    async def go():
        async with aiohttp.ClientSession() as http:
            cl, started, dit = await _started_on(http, server, 60, "dit rank 1")
            os.kill(dit, signal.SIGKILL)  # before its first chunk: the next write to it finds it dead
            ended = await cl.play()
            return started, dit, ended, [m for m in cl.msgs if isinstance(m, W.Error)]

    started, dit, ended, errors = asyncio.run(go())
    named = f"dit rank 1 (pid {dit}) died"
    assert ended.cancelled and ended.reason.startswith(named) and f"(replica {started.replica})" in ended.reason and errors and named in errors[0].message and not errors[0].fatal
    health = _health(server)
    assert health["status"] == "degraded" and named in health["replicas"][started.replica]["reason"]
    other = 1 - started.replica
    rep = asyncio.run(run_session(server.url, preset="tiny", seed=61, chunks=2))  # a newcomer
    assert rep.outcome == "complete" and rep.started.replica == other, rep.error
    server.dead_first = (started.replica, named)


def test_the_last_replica_killed_while_idle_takes_the_server_down_named(server):
    gone, _ = server.dead_first
    last = 1 - gone
    enc = _pids(server)[last]["encoder"]

    async def go():
        async with aiohttp.ClientSession() as http:
            idle = await Raw(http, server.url).open()
            os.kill(enc, signal.SIGKILL)
            return await idle.next(W.Error)

    err = asyncio.run(go())
    named = f"encoder (pid {enc}) died"
    assert err.fatal and err.message.startswith(named) and err.message.endswith(f"(replica {last})")
    assert server.wait(GUARD_S) == 1
    err_lines = [ln for ln in server.stderr().splitlines() if ln.startswith("error:")]
    assert err_lines and named in err_lines[-1] and "Traceback" not in server.stderr()


def test_the_run_directory_records_each_replica_and_nothing_is_left(server):
    man = json.loads((server.out / "manifest.json").read_text())
    assert man["status"] == "failed" and "encoder" in man["error"]
    gone, named = server.dead_first
    states = {r["replica"]: (r["state"], r["reason"]) for r in man["replicas"]}
    assert states[gone][0] == "dead" and states[gone][1].startswith(named) and states[1 - gone][0] == "dead"
    sessions = read_sessions(server.out / "sessions.jsonl")
    assert sessions and all(s.replica in (0, 1) for s in sessions)
    assert server.shm_left() == []
