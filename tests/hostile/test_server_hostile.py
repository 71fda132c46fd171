"""Hostile clients against one real ``serve --listen 127.0.0.1:0`` (tiny preset, warmed up, a
2 s idle timeout). Each test asserts the clear refusal, then that the server still serves a normal
session whose frame hashes equal the clean reference session's; the last test stops the server
and finds nothing left behind (processes, /dev/shm, a manifest that says how it ended)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
from aiohttp import WSMsgType

from harness.serving.client import run_session, status
from harness.drivers.procwatch import shm_names, wait_gone
from harness.experiments.scenario import ServerProcess
from harness.measure.events import read_events
from harness.serving import protocol as W

IDLE_S = 2.0
SEED, CHUNKS = 11, 2
HOSTILE: list[str] = []  # every hostile or malformed input tried here, by name


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(["--preset", "tiny", "--window", "1", "--idle-timeout", str(IDLE_S), "--warmup-chunks", "2",
                         "--max-peer-connections", "8"],  # every slot from this one peer: the global limit is tested
                        tmp_path_factory.mktemp("hostile") / "run")
    srv.workers_at_start = srv.workers()
    srv.reference = _normal(srv)  # the clean run every later session must reproduce
    assert srv.reference.outcome == "complete" and len(srv.reference.frame_sha256) == 21
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def _normal(srv):
    return asyncio.run(run_session(srv.url, preset="tiny", seed=SEED, chunks=CHUNKS))


def _still_serving(srv) -> None:
    rep = _normal(srv)
    assert rep.outcome == "complete" and not rep.errors, rep.error
    assert rep.frame_sha256 == srv.reference.frame_sha256
    assert srv.proc.poll() is None


def _hostport(srv) -> tuple[str, int]:
    host, port = srv.url.split("//")[1].split("/")[0].rsplit(":", 1)
    return host, int(port)


def test_healthz_answers_ready_and_warm_up_wrote_nothing(server):
    with urllib.request.urlopen(server.url.replace("ws://", "http://").replace("/session", "/healthz"), timeout=10) as r:
        body = json.loads(r.read())
    assert r.status == 200 and body["status"] == "ready" and body["preset"] == "tiny"
    man = json.loads((server.out / "manifest.json").read_text())
    assert man["protocol"]["warmup_chunks"] == 2
    assert {e.epoch for e in read_events(server.out / "events.jsonl")} == {0}  # the reference only, no warm-up rows


def test_silent_connections_are_closed_and_do_not_lock_others_out(server):
    async def go():
        async with aiohttp.ClientSession() as http:
            socks = [await http.ws_connect(server.url) for _ in range(8)]  # every connection slot, silent
            HOSTILE.extend(["silent websocket"] * 8)
            t0 = time.monotonic()
            closed = []
            for ws in socks:
                msgs = []
                while True:
                    m = await ws.receive(timeout=IDLE_S + 20)
                    if m.type != WSMsgType.TEXT:
                        break
                    msgs.append(W.decode_server(m.data))
                closed.append((ws.close_code, msgs))
            return time.monotonic() - t0, closed

    waited, closed = asyncio.run(go())
    assert all(code == 1001 and any(isinstance(m, W.Error) and "without a running session" in m.message for m in msgs)
               for code, msgs in closed), closed
    assert waited < IDLE_S + 20
    _still_serving(server)


@pytest.mark.parametrize("payload", [b"", b"GET /session HTTP/1.1\r\nHost: 127.0.0.1"], ids=["nothing", "half-request"])
def test_half_open_tcp_connections_time_out(server, payload):
    HOSTILE.append(f"raw tcp {payload[:10]!r}")
    s = socket.create_connection(_hostport(server), timeout=IDLE_S + 20)
    try:
        s.sendall(payload)
        _still_serving(server)  # while that peer hangs, everyone else is served
        assert s.recv(100) == b""  # the server closed it (a timeout would raise instead)
    finally:
        s.close()


def test_foreign_origin_or_host_is_refused(server):
    async def go(headers):
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                await http.ws_connect(server.url, headers=headers)
            return e.value.status

    for headers in ({"Origin": "http://evil.example"}, {"Host": "evil.example:80"}, {"Origin": "null"}):
        HOSTILE.append(f"foreign {headers}")
        assert asyncio.run(go(headers)) == 403, headers
    _still_serving(server)  # one normal session after all three (each costs a whole session)


def test_a_session_longer_than_the_position_table_is_refused_at_start(server):
    HOSTILE.append("start with 100000 chunks")

    async def go():
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(server.url) as ws:
                await ws.send_str(W.encode(W.Start(preset="tiny", seed=1, chunks=100_000)))
                return W.decode_server((await ws.receive(timeout=30)).data)

    msg = asyncio.run(go())
    assert isinstance(msg, W.Error) and "position table holds 1024" in msg.message and not msg.fatal
    _still_serving(server)


def test_status_answers_only_the_connection_that_owned_the_session(server):
    HOSTILE.append("status from a stranger")

    async def own_session_then_status():
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(server.url) as ws:
                await ws.send_str(W.encode(W.Start(preset="tiny", seed=SEED, chunks=1)))
                while True:
                    m = W.decode_server((await ws.receive(timeout=60)).data)
                    if isinstance(m, W.NeedActions):
                        await ws.send_str(W.encode(W.Actions(chunk=m.chunk, actions=["W"] * 3)))
                    elif isinstance(m, W.ChunkHeader):
                        assert (await ws.receive(timeout=60)).type == WSMsgType.BINARY
                        await ws.send_str(W.encode(W.Ack(chunk=m.chunk, received_ns=time.monotonic_ns())))
                    elif isinstance(m, W.Ended):
                        break
                await ws.send_str(W.encode(W.StatusRequest()))
                mine = W.decode_server((await ws.receive(timeout=30)).data)
                return m, mine, await status(server.url)

    ended, mine, stranger = asyncio.run(own_session_then_status())
    assert isinstance(mine, W.Status) and mine.last is not None and mine.last.session == ended.session
    assert stranger.last is None and stranger.sessions_served == mine.sessions_served
    HOSTILE.append("status with a wrong token")
    assert asyncio.run(status(server.url, token="0" * 32)).last is None
    operator = asyncio.run(status(server.url, token=server.operator_token()))
    assert operator.last == mine.last
    assert (server.out / "operator.token").stat().st_mode & 0o077 == 0
    _still_serving(server)


def test_a_non_ascii_token_gets_the_normal_refusal(server):
    HOSTILE.append("status with a non-ASCII token")
    refused = asyncio.run(status(server.url, token="é" * 32))  # compare_digest raised TypeError on str
    assert refused.last is None and refused.preset == "tiny"
    assert "TypeError" not in server.stderr()
    _still_serving(server)


def _raw_websocket(srv) -> socket.socket:
    """A real handshake on a plain socket, so the frames after it can break the rules."""
    host, port = _hostport(srv)
    s = socket.create_connection((host, port), timeout=IDLE_S + 20)
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(f"GET /session HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(4096)
    assert head.startswith(b"HTTP/1.1 101"), head[:100]
    return s


def _read_all(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):  # until the server closes (a hang would time out and fail)
        data += chunk
    return data


def test_an_unmasked_client_frame_closes_the_connection_with_a_protocol_error(server):
    HOSTILE.append("unmasked client frame")
    s = _raw_websocket(server)
    try:
        payload = W.encode(W.StatusRequest()).encode()
        s.sendall(bytes([0x81, len(payload)]) + payload)  # FIN, text, no mask bit (RFC 6455 §5.1: the server must close)
        data = _read_all(s)
    finally:
        s.close()
    assert data[:1] == b"\x88" and int.from_bytes(data[2:4], "big") == 1002, data[:60]  # a close frame, 1002
    assert b'"status"' not in data  # the unmasked request was not answered
    _still_serving(server)


def test_a_masked_raw_frame_is_still_answered(server):
    """The check reads the mask bit, not the client library: the same request, masked, is served."""
    s = _raw_websocket(server)
    try:
        payload = W.encode(W.StatusRequest()).encode()
        mask = os.urandom(4)
        s.sendall(bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        data = s.recv(4096)
    finally:
        s.close()
    assert data[:1] == b"\x81" and b'"type":"status"' in data, data[:100]


@pytest.mark.parametrize("headers", [{"Origin": "http://evil.example"}, {"Host": "evil.example:80"}],
                         ids=["foreign-origin", "rebound-host"])
def test_healthz_applies_the_websockets_host_and_origin_rules(server, headers):
    HOSTILE.append(f"healthz {headers}")
    url = server.url.replace("ws://", "http://").replace("/session", "/healthz")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
    assert e.value.code == 403 and b"not" in e.value.read()
    with urllib.request.urlopen(url, timeout=10) as r:  # the server's own address is still answered
        assert r.status == 200


def test_server_stops_and_leaves_nothing_behind(server):
    workers = server.workers()
    assert server.stop() == 0
    assert not wait_gone(workers, 15)
    assert not shm_names(f"harness-{server.pid}-")
    man = json.loads((server.out / "manifest.json").read_text())
    assert man["status"] == "complete" and man["stopped_by"] == "SIGTERM"
    assert "Traceback" not in server.stderr()
    print(f"hostile inputs tried by this module: {len(HOSTILE)}")
