"""bad-input, over websocket: malformed, oversized, unknown and ill-timed messages against a live
server. Each gets a one-line error (an oversized frame: a close with code 1009), and the server
serves a normal session afterwards."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import WSMsgType

from harness.experiments.scenario.params import Params
from harness.experiments.scenario.findings import Findings, Report
from harness.experiments.scenario.topology import prompt_for
from harness.serving import protocol as W
from harness.serving.client import ViewerOptions, run_session, status

CLOSED = (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.CLOSING)


def _outside_a_session(preset: str) -> list[tuple[str, str, str]]:
    """(case, the text sent, a piece of the expected error) with no session running."""
    start = f'{{"type": "start", "preset": "{preset}"'
    return [
        ("not JSON", "hello{", "malformed"),
        ("JSON, not an object", "[1, 2, 3]", "Expected `object`"),
        ("unknown message type", '{"type": "launch"}', "Invalid value 'launch'"),
        ("missing field", start + "}", "missing required field `seed`"),
        ("wrong field type", start + ', "seed": "zero"}', "Expected `int`"),
        ("unknown field", start + ', "seed": 1, "evil": true}', "unknown field `evil`"),
        ("value out of range", start + ', "seed": -1}', "Expected `int` >= 0"),
        ("prompt too long", start + f', "seed": 1, "prompt": "{"x" * 5000}"}}', "length <= 2000"),
        ("preset mismatch", W.encode(W.Start(preset="lingbot-704x1280", seed=1)), "does not match the server"),
        ("conditioning image", W.encode(W.Start(preset=preset, seed=1, image=b"\x00" * 16)), "not supported"),
        ("actions without a session", W.encode(W.Actions(chunk=0, actions=["W", "W", "W"])), "without a running session"),
        ("ack without a session", W.encode(W.Ack(chunk=0, received_ns=1)), "without a session"),
        ("cancel without a session", W.encode(W.Cancel()), "no running session"),
    ]


def _inside_a_session(preset: str, f: int) -> list[tuple[str, object, str]]:
    """(case, the message sent, a piece of the expected error) in a 2-chunk session of ``f``
    latent frames per chunk."""
    return [
        ("actions: invalid key", W.Actions(chunk=0, actions=["W", "Q!", ""][:f] + [""] * (f - 3)), "invalid key"),
        ("actions: wrong count", W.Actions(chunk=0, actions=["W"] * (f + 1)), f"expected {f} actions"),
        ("actions: chunk out of range", W.Actions(chunk=7, actions=[""] * f), "session has 2 chunks"),
        ("ack for a chunk never sent", W.Ack(chunk=1, received_ns=1), "was not sent"),
        ("second start on the same connection", W.Start(preset=preset, seed=2), "already running"),
    ]


async def _answer(ws, timeout=30.0):
    """The next error or busy message, or whatever that is not text came first (a close)."""
    while True:
        m = await ws.receive(timeout=timeout)
        if m.type != WSMsgType.TEXT:
            return m
        msg = W.decode_server(m.data)
        if isinstance(msg, (W.Error, W.Busy)):
            return msg


async def _next_of(ws, kind: type):
    """The next message of ``kind``, passing over media and every other message."""
    while True:
        m = await ws.receive(timeout=60)
        if m.type in CLOSED:
            raise ConnectionError(f"the server closed the connection before {kind.__name__}")
        if m.type == WSMsgType.TEXT:
            msg = W.decode_server(m.data)
            if isinstance(msg, kind):
                return msg


def _judge(found: Findings, name: str, got, expect: str) -> None:
    text = getattr(got, "message", None)
    if text is None:
        text = f"closed (code {getattr(got, 'data', None)}: {getattr(got, 'extra', '')})"
    ok = expect in text and "\n" not in text
    found.add([name, text[:100], "ok" if ok else "FAIL"], None if ok else f"{name}: {text!r}")


async def _queued_then_left(url: str, preset: str):
    """A second client while the only replica is busy: told its place in the queue, then it leaves."""
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws2:
        await ws2.send_str(W.encode(W.Start(preset=preset, seed=3, chunks=1)))
        queued = await _next_of(ws2, W.InQueue)
        if queued.position != 1:
            return W.Error(message=f"queued at position {queued.position}, not 1")
        await ws2.send_str(W.encode(W.Cancel()))
        return await _next_of(ws2, W.Busy)


async def _bad_session(ws, url: str, preset: str, p: Params, found: Findings) -> None:
    """In a session: wrong actions, wrong acks, a second start, a second client; then the session,
    cancelled, must end with every KV block and ring slot free."""
    await ws.send_str(W.encode(W.Start(preset=preset, seed=p.seed, prompt=prompt_for(p.seed), chunks=2, action_timeout_s=30.0)))
    started = await _next_of(ws, W.Started)
    for name, msg, expect in _inside_a_session(preset, started.latent_frames_per_chunk):
        await ws.send_str(W.encode(msg))
        _judge(found, name, await _answer(ws), expect)
    _judge(found, "second concurrent session (capacity 1): queued, then cancelled", await _queued_then_left(url, preset),
           "left the queue")
    await ws.send_str(W.encode(W.Cancel()))
    ended = await _next_of(ws, W.Ended)
    ok = ended.cancelled and ended.kv_blocks_used == 0 and ended.ring_free == ended.ring_slots
    found.add(["that session, cancelled", f"cancelled={ended.cancelled} KV used {ended.kv_blocks_used} "
               f"ring {ended.ring_free}/{ended.ring_slots}", "ok" if ok else "FAIL"],
              None if ok else "the session with bad messages did not end clean")


async def _oversized(http: aiohttp.ClientSession, url: str, found: Findings) -> None:
    async with http.ws_connect(url) as ws:
        await ws.send_str('{"type": "status", "pad": "' + "x" * (W.MAX_CONTROL_BYTES + 10) + '"}')
        m = await ws.receive(timeout=30)
        code = ws.close_code
        ok = m.type in CLOSED and code == 1009
        found.add([f"oversized message (> {W.MAX_CONTROL_BYTES} bytes)", f"closed with code {code}", "ok" if ok else "FAIL"],
                  None if ok else f"oversized message: {m.type} code {code}")


async def _bad_ws(url: str, p: Params) -> Findings:
    found = Findings()
    preset = (await status(url)).preset
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url) as ws:
            for name, text, expect in _outside_a_session(preset):
                await ws.send_str(text)
                _judge(found, name, await _answer(ws), expect)
            await ws.send_bytes(b"\x80\x04pickle-me")
            _judge(found, "binary message (never unpickled)", await _answer(ws), "binary messages are not accepted")
            await _bad_session(ws, url, preset, p, found)
        await _oversized(http, url, found)
    rep = await run_session(url, preset=preset, seed=p.seed, chunks=2, prompt=prompt_for(p.seed), opts=ViewerOptions())
    ok = rep.outcome == "complete" and not rep.errors
    found.add(["afterwards: a normal session", f"{rep.outcome}, {len(rep.headers)} chunks", "ok" if ok else "FAIL"],
              None if ok else f"the server did not serve normally afterwards: {rep.error or rep.outcome}")
    return found


def bad_input_ws(url: str, p: Params) -> Report:
    """Malformed, oversized, unknown and ill-timed messages against a live server: each a one-line
    error (or, for an oversized frame, a close with code 1009), and the server serves on."""
    report = Report("bad-input", "websocket")
    found = asyncio.run(_bad_ws(url, p))
    report.header = ["case", "answer", "ok"]
    report.rows = found.rows
    report.check_none("every bad message gets a clear one-line answer, the connection survives", found.problems)
    return report.done()
