"""Issue 28 rows 1, 8 (the port) and 11 against one real ``serve --listen`` at its *default* idle
timeout (30 s) and heartbeat (10 s), the setting a user has:

* clients that answer every ping and send nothing (every browser and WebSocket library does) are
  closed as idle — answering the heartbeat is no message — so eight of them cannot lock a newcomer
  out for good;
* ``client --chunks 1000`` gets the server's refusal of its start and exits at once with it;
* ``--listen`` on a port another process listens on is refused in one line before anything starts;
* row 12: the bundled slow consumer, slower than the heartbeat's ping and pong wait, still answers
  the pings and is served to the end; a client that does stop reading is dropped by the heartbeat
  and its report says the connection was lost after what it had received, not "cannot connect".
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import aiohttp
import pytest
from aiohttp import WSMsgType

from harness.experiments.scenario import ServerProcess
from harness.serving import protocol as W
from harness.serving import client as C
from harness.serving.client import ViewerOptions, run_session
from harness.serving.guards import DEFAULT_IDLE_TIMEOUT_S

from helpers import REPO
from helpers.presets import ONE_RANK_EACH

HEARTBEAT_S = 10.0  # ListenOptions.heartbeat_s, the default


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # every slot from this one peer: the global limit is what is tested
    srv = ServerProcess(["--preset", "tiny", "--warmup-chunks", "0", "--max-peer-connections", "8", *ONE_RANK_EACH],
                        tmp_path_factory.mktemp("idle") / "run")
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


async def _answer_pings_until_closed(ws) -> tuple[int, list, int | None]:
    """Answer every ping by hand (so they can be counted), send nothing else; until the server closes."""
    pongs, texts = 0, []
    while True:
        m = await ws.receive(timeout=DEFAULT_IDLE_TIMEOUT_S + 4 * HEARTBEAT_S)
        if m.type == WSMsgType.PING:
            await ws.pong(m.data)
            pongs += 1
        elif m.type == WSMsgType.TEXT:
            texts.append(W.decode_server(m.data))
        else:
            return pongs, texts, ws.close_code


def test_clients_that_only_answer_pings_are_closed_and_a_newcomer_is_served(server):
    assert DEFAULT_IDLE_TIMEOUT_S == 30.0 and DEFAULT_IDLE_TIMEOUT_S > 2 * HEARTBEAT_S  # pongs fall inside the idle time

    async def go():
        async with aiohttp.ClientSession() as http:
            idle = [await http.ws_connect(server.url, autoping=False) for _ in range(8)]  # every connection slot
            refused = await http.ws_connect(server.url)
            busy = W.decode_server((await refused.receive(timeout=30)).data)
            await refused.close()
            # bounded: a server that counts pongs as messages keeps them open for ever (the bug this guards)
            results = await asyncio.wait_for(asyncio.gather(*(_answer_pings_until_closed(ws) for ws in idle)),
                                             DEFAULT_IDLE_TIMEOUT_S + 6 * HEARTBEAT_S)
            newcomer = await run_session(server.url, preset="tiny", seed=1, chunks=1, http=http)
            return busy, results, newcomer

    busy, results, newcomer = asyncio.run(go())
    assert isinstance(busy, W.Busy) and "too many connections" in busy.message
    for pongs, texts, code in results:
        assert pongs >= 2, "the heartbeat pinged at least twice within the idle time, and each ping was answered"
        assert code == 1001 and any(isinstance(t, W.Error) and "without a running session" in t.message for t in texts)
    assert newcomer.outcome == "complete", newcomer.error


def test_a_refused_start_ends_the_client_with_the_refusal(server):
    proc = subprocess.run([sys.executable, "-m", "harness", "client", "--connect", server.url, "--chunks", "1000"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "refused the session" in proc.stderr and "341 chunks" in proc.stderr


def test_listen_on_a_port_in_use_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = tmp_path / "run"
        proc = subprocess.run([sys.executable, "-m", "harness", "serve", "--preset", "tiny", "--listen", f"127.0.0.1:{port}",
                               "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "cannot listen there" in err[0] and "Traceback" not in proc.stderr
    assert not out.exists()  # refused before the run directory was claimed


#: one 9-frame chunk taken at this × 16 fps lasts 18.75 s: longer than the heartbeat's ping (10 s
#: after the client's last message) plus its pong wait (5 s), after which aiohttp drops the peer
SLOW_RATE = 0.03


def test_the_bundled_slow_consumer_answers_the_heartbeat_and_is_served(server, tmp_path):
    assert 9 / (SLOW_RATE * 16) > 1.5 * HEARTBEAT_S
    proc = subprocess.run([sys.executable, "-m", "harness", "client", "--connect", server.url, "--chunks", "1",
                           "--read-rate", str(SLOW_RATE), "--out", str(tmp_path), "--verify"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " complete " in proc.stdout and "decodes to the 9 frames sent" in proc.stdout


def test_a_client_that_stops_reading_is_reported_as_dropped_not_as_cannot_connect(server, monkeypatch):
    async def stop_reading(self, seconds):  # the consumer before the fix: it read nothing while it slept
        await asyncio.sleep(seconds)
        return True

    monkeypatch.setattr(C._Viewer, "read_ahead", stop_reading)
    rep = asyncio.run(run_session(server.url, preset="tiny", seed=1, chunks=1, opts=ViewerOptions(read_rate=SLOW_RATE)))
    assert rep.outcome == "closed" and rep.session is not None and len(rep.headers) == 1, (rep.outcome, rep.error)
    assert "after 1 of 1 chunks" in rep.error and "cannot connect" not in rep.error
