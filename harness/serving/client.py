"""``python -m harness client``: a viewer for ``serve --listen``.

It starts sessions, answers the server's requests for actions (the scripted trajectory of the
session's seed, so a network session reproduces the in-process one frame for frame), reads each
chunk's header and media fragment, stamps the moment it read them and acknowledges (that stamp is
the chunk's ``delivered``), and appends the fragments to ``session{S}.mkv`` (renamed into place
only when the session ran to its end; anything else is removed, never left looking valid).

Playback is modelled, not rendered: a player starts once ``prebuffer`` frames have arrived and then
wants frame k at ``start + k / fps``; a frame that has not arrived by then is an underrun, and the
player stalls until it does. Reported: underruns, stall time, startup delay and the continuous-play
ratio (play time / (play time + stall time)).

A slow consumer (``--read-rate 0.5``) takes each chunk's frames at half speed and acknowledges the
chunk only then (the ack carries the receipt time): the server's window of unacknowledged chunks
fills, which stops production. Meanwhile it goes on reading, as a browser does, so it answers the
server's heartbeat however slow it is; what arrives waits in its backlog (at most the window).
``--disconnect-after-chunk K`` leaves mid-session (the server must treat it as a cancel).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import WSMsgType

from harness.drivers.trajectory import actions_for
from harness.errors import HarnessError
from harness.measure.clock import now
from harness.measure.figures import console_table, define, label
from harness.measure.playout import SESSION_COLUMNS, PlayStats, first_frame_playout, playout, read_fps, session_ttfc_ms
from harness.measure.interaction import (LATENCY_COLUMNS, PARTS_COLUMNS, A2PSummary, ChunkRecord, EventOutcome,
                                         EventRecord, InteractionLog, invariants, latency_cells, outcomes, parts_cells,
                                         summarize)
from harness.pipeline.decode import decode_pyav
from harness.pipeline.sinks import ensure_writable_dir
from harness.serving import omni_protocol as O
from harness.serving import protocol as W
from harness.serving.player import TraceEvent, parse_trace


@dataclass
class ViewerOptions:
    read_rate: float | None = None  # × the nominal frame rate; None: read as fast as it arrives
    prebuffer_frames: int | None = None  # default: the first chunk's frames
    lookahead: int = 2  # chunks of actions sent ahead of the server's need
    #: when to cancel / drop the connection: "start" (right after sending start), "started",
    #: "header:K" (chunk K announced, its media in flight), "chunk:K" (K's media read), "after:S" (seconds)
    cancel_at: str | None = None
    disconnect_at: str | None = None
    cancel_repeat: int = 1
    withhold_actions_from: int | None = None  # never send actions for chunks ≥ this (timeout path)
    action_timeout_s: float | None = None
    out_dir: Path | None = None
    receive_timeout_s: float = 300.0
    #: no ``started`` within this many seconds of the start: leave (closing the connection, which the
    #: server treats as a cancel) with the outcome ``queue_timeout``; None: wait as for any message
    start_timeout_s: float | None = None
    #: a player session: these events are sent at their own times (from ``started``), and the
    #: server applies them at its chunk boundaries instead of asking for scripted actions
    player: tuple[TraceEvent, ...] | None = None


async def sleep_unless(event: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds`` or until ``event`` is set, whichever comes first."""
    if seconds > 0:
        try:
            await asyncio.wait_for(event.wait(), seconds)
        except asyncio.TimeoutError:
            pass


class SessionReport(msgspec.Struct):
    seed: int
    chunks: int
    outcome: str = ""  # complete | cancelled | disconnected | error | busy | queue_timeout | closed
    session: int | None = None
    error: str = ""
    errors: list[str] = []  # non-fatal rejections the server sent
    close_code: int | None = None
    started: W.Started | None = None
    ended: W.Ended | None = None
    headers: list[W.ChunkHeader] = []
    receipts_ns: list[int] = []
    media_path: str = ""
    media_bytes: int = 0
    t_start_ns: int = 0
    t_first_media_ns: int | None = None
    t_end_ns: int = 0  # the session ended on our side (last message, error, close)
    t_started_ns: int | None = None  # ``started`` read: the server admitted the session
    cancel_sent_ns: int | None = None
    play: PlayStats | None = None
    header_ns: list[int] = []  # when each header was read (client clock)
    interaction: InteractionLog | None = None  # player sessions: per event and per chunk
    a2p: A2PSummary | None = None
    a2p_events: list[EventOutcome] = []  # per event: sent, queued, applied at chunk k, delivered, played

    @property
    def frame_sha256(self) -> list[str]:
        return [h for hd in self.headers for h in hd.frame_sha256]


async def run_session(url: str, *, preset: str, seed: int, chunks: int | None = None, prompt: str = "",
                      opts: ViewerOptions | None = None, http=None) -> SessionReport:
    """One session on its own connection, driven as ``opts`` says; never raises for what the
    server answered (busy, errors, a dropped connection): the report says what happened."""
    opts = opts or ViewerOptions()
    own = http is None
    http = http or aiohttp.ClientSession()
    try:
        async with http.ws_connect(url, max_msg_size=1 << 30, autoping=True) as ws:
            return await _session(ws, preset=preset, seed=seed, chunks=chunks, prompt=prompt, opts=opts)
    except (aiohttp.ClientError, OSError) as e:
        return SessionReport(seed=seed, chunks=chunks or 0, outcome="error", error=W.one_line(f"cannot connect to {url}: {e}"))
    finally:
        if own:
            await http.close()


async def _session(ws, *, preset: str, seed: int, chunks: int | None, prompt: str, opts: ViewerOptions) -> SessionReport:
    v = _Viewer(ws, opts, seed, SessionReport(seed=seed, chunks=chunks or 0, headers=[], receipts_ns=[], errors=[]))
    try:
        await v.start(preset, chunks, prompt)
        if not await v.trigger("start"):
            await v.receive_all()
        await v.stop_player()
    except (aiohttp.ClientError, OSError) as e:  # connected, then lost: not "cannot connect"
        v.lost(e)
    finally:
        v.finish()
    return v.rep


class _Viewer:
    """One session on an open connection: what it sent, what it is waiting for, the report.

    Every ``on_*`` handler returns True when the session is over on our side (it ended, failed,
    or we left); the report then says how."""

    def __init__(self, ws, opts: ViewerOptions, seed: int, rep: SessionReport):
        self.ws, self.opts, self.seed, self.rep = ws, opts, seed, rep
        self.sent_actions: set[int] = set()
        self.frames_per_chunk = 0
        self.pending: W.ChunkHeader | None = None  # header whose media is next
        self.part: Path | None = None  # the media file being written (renamed into place when complete)
        self.fh = None
        self.timer: asyncio.Task | None = None
        self.player_task: asyncio.Task | None = None
        self.player_stop = asyncio.Event()  # set once the last chunk was announced: no boundary is left
        self.sent_inputs: dict[str, tuple[int, int, TraceEvent]] = {}  # id → (planned, sent, event)
        self.queued: dict[str, tuple[int, W.Queued]] = {}  # id → (receipt read, receipt)
        self.backlog: deque = deque()  # messages read while a slow consumer took a chunk's frames

    async def send(self, msg) -> None:
        await self.ws.send_str(W.encode(msg))

    async def start(self, preset: str, chunks: int | None, prompt: str) -> None:
        opts = self.opts
        self.rep.t_start_ns = now()
        await self.send(W.Start(preset=preset, seed=self.seed, prompt=prompt, chunks=chunks, boot_id=W.boot_id(),
                                action_timeout_s=opts.action_timeout_s, input="player" if opts.player else "script"))
        for point in (opts.cancel_at, opts.disconnect_at):
            if point and point.startswith("after:"):
                self.timer = asyncio.create_task(self.after(float(point.split(":", 1)[1])))

    async def cancel(self) -> None:
        if self.rep.cancel_sent_ns is None:
            self.rep.cancel_sent_ns = now()
        for _ in range(self.opts.cancel_repeat):
            await self.send(W.Cancel())

    async def send_actions(self, upto: int) -> None:
        if not self.frames_per_chunk:
            return
        rep, opts = self.rep, self.opts
        total = rep.started.chunks if rep.started else upto + 1
        for c in range(min(upto, total - 1) + 1):
            if c in self.sent_actions or (opts.withhold_actions_from is not None and c >= opts.withhold_actions_from):
                continue
            self.sent_actions.add(c)
            await self.send(W.Actions(chunk=c, actions=actions_for(self.seed, c, self.frames_per_chunk)))

    async def play(self, t0: int) -> None:
        """Send the trace's events at their own times, whatever the chunks are doing."""
        for ev in self.opts.player or ():
            planned = t0 + round(ev.t_s * 1e9)
            await sleep_unless(self.player_stop, (planned - now()) / 1e9)
            if self.player_stop.is_set():
                return
            sent = now()
            self.sent_inputs[ev.event_id] = (planned, sent, ev)
            await self.send(W.Input(event_id=ev.event_id, keys=ev.keys, sent_ns=sent))

    async def stop_player(self) -> None:
        self.player_stop.set()
        if self.player_task is not None:
            try:
                await self.player_task
            except (ConnectionError, RuntimeError):
                pass  # the connection went away mid-send: the report says how the session ended

    async def trigger(self, point: str) -> bool:
        """True when the session is over on our side (we disconnected)."""
        if self.opts.cancel_at == point:
            await self.cancel()
        if self.opts.disconnect_at == point:
            self.rep.outcome = "disconnected"
            await self.ws.close()
            return True
        return False

    async def after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        await self.trigger(f"after:{seconds:g}")

    def lost(self, e: BaseException) -> None:
        """The connection failed under us (a send to a closed transport, a reset): the session is
        over, said with what we had received."""
        rep = self.rep
        if rep.outcome == "disconnected":
            return  # we left: the failure is our own close
        rep.outcome, rep.close_code = "closed", self.ws.close_code
        rep.error = W.one_line(f"connection lost after {self.received()} (code {self.ws.close_code}): "
                               f"{e or type(e).__name__}")

    def received(self) -> str:
        return f"{len(self.rep.headers)} of {self.rep.chunks or '?'} chunks"

    def fail(self, outcome: str, error: str) -> bool:
        self.rep.outcome, self.rep.error = outcome, error
        return True

    def _receive_timeout(self) -> tuple[float, bool]:
        """How long the next read may wait, and whether that wait is the admission's (start timeout)."""
        opts, rep = self.opts, self.rep
        if opts.start_timeout_s is None or rep.started is not None:
            return opts.receive_timeout_s, False
        left = opts.start_timeout_s - (now() - rep.t_start_ns) / 1e9
        return (max(left, 0.0), True) if left < opts.receive_timeout_s else (opts.receive_timeout_s, False)

    async def receive_all(self) -> None:
        while True:
            timeout, admission = self._receive_timeout()
            try:
                m = self.backlog.popleft() if self.backlog else await self.ws.receive(timeout=timeout)
            except asyncio.TimeoutError:
                if admission:
                    self.fail("queue_timeout", f"not admitted within {self.opts.start_timeout_s:g} s of the start")
                    await self.ws.close()
                    return
                self.fail("error", f"no message from the server for {self.opts.receive_timeout_s:g} s")
                return
            if m.type == WSMsgType.TEXT:
                over = await self.on_text(m.data)
            elif m.type == WSMsgType.BINARY:
                over = await self.on_media(m.data)
            else:  # CLOSE / CLOSING / CLOSED / ERROR
                over = self.on_closed()
            if over:
                return

    async def on_text(self, data: str) -> bool:
        try:
            msg = W.decode_server(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return self.fail("error", W.one_line(f"bad message from the server: {e}"))
        rep = self.rep
        if isinstance(msg, W.Started):
            return await self.on_started(msg)
        if isinstance(msg, W.NeedActions):
            await self.send_actions(msg.chunk + self.opts.lookahead - 1)
        elif isinstance(msg, W.Queued):
            self.queued[msg.event_id] = (now(), msg)
        elif isinstance(msg, W.ChunkHeader):
            self.pending = msg
            rep.header_ns.append(now())
            if rep.started is not None and msg.chunk >= rep.started.chunks - 1:
                self.player_stop.set()  # its boundary has passed: anything sent now would be late
            return await self.trigger(f"header:{msg.chunk}")
        elif isinstance(msg, W.Ended):
            rep.ended = msg
            rep.outcome = "cancelled" if msg.cancelled else "complete"
            return True
        elif isinstance(msg, W.Error):
            if msg.fatal:
                return self.fail("error", msg.message)
            if rep.started is None:  # the answer to our start: the session was refused, nothing will follow
                return self.fail("error", f"the server refused the session: {msg.message}")
            rep.errors.append(msg.message)
        elif isinstance(msg, W.Busy):
            return self.fail("busy", msg.message)
        return False

    async def on_started(self, msg: W.Started) -> bool:
        rep, opts = self.rep, self.opts
        rep.started, rep.session, rep.chunks = msg, msg.session, msg.chunks
        rep.t_started_ns = now()
        self.frames_per_chunk = msg.latent_frames_per_chunk
        if opts.out_dir is not None:
            opts.out_dir.mkdir(parents=True, exist_ok=True)
            self.part = opts.out_dir / f"session{msg.session}.mkv.part"
            self.fh = open(self.part, "wb")
        if opts.player:
            self.player_task = asyncio.create_task(self.play(now()))
        else:
            await self.send_actions(opts.lookahead - 1)
        return await self.trigger("started")

    async def on_media(self, data: bytes) -> bool:
        t = now()
        rep = self.rep
        if self.pending is None:
            return self.fail("error", "media without a chunk header")
        hd, self.pending = self.pending, None
        if len(data) != hd.nbytes:
            return self.fail("error", f"chunk {hd.chunk}: {len(data)} bytes, header said {hd.nbytes}")
        rep.headers.append(hd)
        rep.receipts_ns.append(t)
        rep.media_bytes += len(data)
        if rep.t_first_media_ns is None:
            rep.t_first_media_ns = t
        if self.fh is not None:
            self.fh.write(data)
        if self.opts.read_rate and rep.started:
            # A slow consumer: it takes the chunk's frames at read_rate × fps and returns the
            # credit (the ack) only then; the ack still carries the receipt time, which is what
            # ``delivered`` means.
            if not await self.read_ahead(hd.frames / (self.opts.read_rate * rep.started.fps)):
                return False  # the connection closed meanwhile: the backlog ends with why
        await self.send(W.Ack(chunk=hd.chunk, received_ns=t))
        return await self.trigger(f"chunk:{hd.chunk}")

    async def read_ahead(self, seconds: float) -> bool:
        """Wait ``seconds`` while still reading: aiohttp answers the server's pings only inside
        ``receive``, so a consumer that stopped reading for longer than the heartbeat's pong wait
        would be dropped as dead. Requests for actions are answered at once (the controls do not
        wait for playback, or the server's action timeout would cancel the session); everything
        else is kept, in order, for ``receive_all``. False when the connection closed meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while (left := deadline - loop.time()) > 0:
            try:  # one deadline around the receive: aiohttp's own timeout restarts at every ping it answers
                m = await asyncio.wait_for(self.ws.receive(), left)
            except asyncio.TimeoutError:
                break
            if m.type == WSMsgType.TEXT and _is_request(m.data):
                await self.on_text(m.data)
                continue
            self.backlog.append(m)
            if m.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                return False
        return True

    def on_closed(self) -> bool:
        rep, ws = self.rep, self.ws
        rep.outcome = rep.outcome or "closed"
        rep.close_code = ws.close_code
        ex = ws.exception()
        rep.error = rep.error or W.one_line(f"connection closed by the server after {self.received()} (code {ws.close_code}"
                                            f"{': ' + str(ex) if ex else ''})")
        return True

    def finish(self) -> None:
        """The media file renamed into place (complete) or removed (anything else), and the
        modelled playback."""
        rep, opts = self.rep, self.opts
        rep.t_end_ns = now()
        if self.timer is not None:
            self.timer.cancel()
        if self.fh is not None:
            self.fh.close()
            final = self.part.with_suffix("")  # drop ".part"
            if rep.outcome == "complete":
                os.replace(self.part, final)
                rep.media_path = str(final)
            else:
                self.part.unlink(missing_ok=True)  # a partial file is never left looking like a video
        fps = rep.started.fps if rep.started else 16
        pre = opts.prebuffer_frames or (rep.headers[0].frames if rep.headers else 1)
        arrivals = [(h.frames, t) for h, t in zip(rep.headers, rep.receipts_ns)]
        rep.play = playout(arrivals, fps, pre, rep.t_start_ns)
        if opts.player:
            rep.interaction = self.interaction_log(first_frame_playout(arrivals, fps, pre))
            rep.a2p = summarize(rep.interaction)
            rep.a2p_events = outcomes(rep.interaction)

    def interaction_log(self, plays: list[int]) -> InteractionLog:
        """The frozen records of a player session: what was sent and receipted, what each chunk applied."""
        events = []
        for eid, (planned, sent, ev) in self.sent_inputs.items():
            got, q = self.queued.get(eid, (None, None))
            events.append(EventRecord(event_id=eid, keys=ev.keys, planned_ns=planned, sent_ns=sent, queued_ns=got,
                                      received_ns=q.received_ns if q else None, late=bool(q and q.late)))
        rep = self.rep
        header_ns = dict(zip((h.chunk for h in rep.headers), rep.header_ns))
        chunks = [ChunkRecord(chunk=h.chunk, applied=tuple(h.applied), boundary_ns=h.boundary_ns,
                              latent_ready_ns=h.event.get("latent_ready"), cpu_ready_ns=h.event.get("cpu_ready"),
                              encoded_ns=h.event.get("encoded"), header_ns=header_ns.get(h.chunk), delivered_ns=t,
                              playout_ns=p) for h, t, p in zip(rep.headers, rep.receipts_ns, plays)]
        seen = {c.chunk for c in chunks}
        if rep.ended is not None:  # chunks the server generated and applied events at, never delivered here
            chunks += [ChunkRecord(chunk=c, applied=tuple(ids)) for c, ids in enumerate(rep.ended.applied) if c not in seen]
        return InteractionLog(events=tuple(events), chunks=tuple(chunks),
                              same_clock=bool(rep.started and rep.started.same_clock))


def _is_request(data: str) -> bool:
    """A server's request for actions (answered even while a slow consumer holds its chunks)."""
    try:
        return isinstance(W.decode_server(data), W.NeedActions)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False  # receive_all reports it, in its place


async def status(url: str, timeout_s: float = 10.0, token: str = "") -> W.Status:
    try:
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(url, max_msg_size=1 << 20) as ws:
                await ws.send_str(W.encode(W.StatusRequest(token=token)))
                while True:
                    m = await ws.receive(timeout=timeout_s)
                    if m.type != WSMsgType.TEXT:
                        raise HarnessError(f"{url}: connection closed before the status answer")
                    msg = W.decode_server(m.data)
                    if isinstance(msg, W.Status):
                        return msg
                    if isinstance(msg, (W.Busy, W.Error)):
                        raise HarnessError(f"{url}: {msg.message}")
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        raise HarnessError(W.one_line(f"cannot reach {url}: {e or type(e).__name__}")) from None


def session_url(connect: str, path: str = W.PATH) -> str:
    """``HOST:PORT`` (the endpoint at ``path``) or a full ``ws://…`` URL."""
    if connect.startswith(("ws://", "wss://")):
        return connect
    host, sep, port = connect.rpartition(":")
    if not sep or not port.isdigit():
        raise HarnessError(f"--connect {connect!r}: expected HOST:PORT or a ws:// URL")
    return f"ws://{host or '127.0.0.1'}:{port}{path}"


async def run_sessions(url: str, *, sessions: int, seed: int, preset: str | None, chunks: int | None, prompt: str,
                       opts: ViewerOptions, busy_wait_s: float = 60.0) -> list[SessionReport]:
    """Sessions one after another; a ``busy`` answer is retried until ``busy_wait_s`` passes
    (the server may still be finishing a session a previous client left)."""
    if preset is None:
        preset = (await status(url)).preset
    out = []
    for i in range(sessions):
        deadline = time.monotonic() + busy_wait_s
        while True:
            rep = await run_session(url, preset=preset, seed=seed + i, chunks=chunks, prompt=prompt, opts=opts)
            if rep.outcome != "busy" or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        out.append(rep)
        if rep.outcome == "error":
            break
    return out


def verify_media(rep: SessionReport) -> str | None:
    """None when the written file decodes to exactly the frames the server hashed, in order."""
    if not rep.media_path:
        return "no media file"
    frames = decode_pyav(rep.media_path).frames
    got = [hashlib.sha256(f.tobytes()).hexdigest() for f in frames]
    want = rep.frame_sha256
    if got != want:
        n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        return f"decoded {len(got)} frames, expected {len(want)}; first mismatch at frame {n}"
    return None


TABLE_COLUMNS = SESSION_COLUMNS


def _row(r: SessionReport) -> list[str]:
    p, n = r.play, len(r.headers)
    ttfc = session_ttfc_ms(r.t_start_ns, r.t_first_media_ns)
    fps = read_fps([h.frames for h in r.headers], r.receipts_ns)
    epoch = "-" if r.started is None else f"{r.started.epoch}" + (" warm-up" if r.started.epoch == 0 else "")
    return ["-" if r.session is None else str(r.session), epoch, str(r.seed), r.outcome, f"{n}/{r.chunks}",
            str(p.frames if p else 0), _f(ttfc), str(p.underruns if p else 0), _f(p.stall_ms if p else None),
            _f(100 * p.continuous_ratio if p and p.continuous_ratio is not None else None, " %"), _f(fps)]


def table(reports: list[SessionReport]) -> list[str]:
    """One row per session, then what every column is (``measure.figures``) and which session was the
    server's warm-up (epoch 0: not counted in the server's summary)."""
    rows: list[list[str]] = []
    for r in reports:
        rows.append(_row(r))
        if r.error:
            rows.append(["", f"{r.outcome}: {r.error}"])
    out = console_table(TABLE_COLUMNS, rows)
    warm = [str(r.session) for r in reports if r.started is not None and r.started.epoch == 0]
    if warm:
        out.append(f"  session {', '.join(warm)} was the server's warm-up (epoch 0): served like any other, never "
                   "counted in the server's summary")
    return out + [f"  {label(n)}: {define(n).formula}" for n in TABLE_COLUMNS[1:]]


def a2p_table(reports: list[SessionReport], first: str = "session") -> list[str]:
    """The action-to-photon tables of the player sessions: latency, then its decomposition."""
    rows = [(str(r.session), r.a2p) for r in reports if r.a2p is not None]
    if not rows:
        return []
    return (["action-to-photon (rule: latest-wins key state, applied at each chunk boundary; columns: README, Figures)"]
            + console_table((first, *LATENCY_COLUMNS), [[k, *latency_cells(s)] for k, s in rows])
            + console_table((first, *PARTS_COLUMNS), [[k, *parts_cells(s)] for k, s in rows]))


def _f(v, suffix: str = "") -> str:
    return "-" if v is None else f"{v:.1f}{suffix}"


# ---- CLI -----------------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> int:
    if getattr(args, "api", "harness") == "vllm-omni":
        # imported here: its run directory (drivers.rundir) brings torch, which this viewer never needs
        from harness.serving import omni_client

        return omni_client.main(args, session_url(args.connect, O.PATH))
    omni_only = [f"--{n.replace('_', '-')}" for n in ("width", "height", "model", "image", "interaction_every")
                 if getattr(args, n, None) is not None] + (["--interaction-prompt"] if getattr(args, "interaction_prompt", "") else [])
    if omni_only:
        raise HarnessError(f"{', '.join(omni_only)}: an option of --api vllm-omni")
    for name in ("sessions", "chunks", "prebuffer_frames"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise HarnessError(f"--{name.replace('_', '-')} must be ≥ 1, got {v}")
    if args.read_rate is not None and not args.read_rate > 0:
        raise HarnessError(f"--read-rate must be positive, got {args.read_rate}")
    trace = tuple(parse_trace(args.player)) if args.player else None
    url = session_url(args.connect)
    out = Path(args.out) if args.out else None
    if out is not None:
        ensure_writable_dir(out)
    opts = ViewerOptions(read_rate=args.read_rate, prebuffer_frames=args.prebuffer_frames, out_dir=out,
                         disconnect_at=None if args.disconnect_after_chunk is None else f"chunk:{args.disconnect_after_chunk}",
                         cancel_at=None if args.cancel_after_chunk is None else f"chunk:{args.cancel_after_chunk}",
                         player=trace)
    reports = asyncio.run(run_sessions(url, sessions=args.sessions, seed=args.seed, preset=args.preset,
                                       chunks=args.chunks, prompt=args.prompt, opts=opts, busy_wait_s=args.busy_wait))
    for line in table(reports) + a2p_table(reports):
        print(line)
    asked_to_stop = args.disconnect_after_chunk is not None or args.cancel_after_chunk is not None
    failed = [r for r in reports if r.outcome in ("error", "busy", "closed")
              or (r.outcome in ("cancelled", "disconnected") and not asked_to_stop)]
    if args.verify:
        for r in reports:
            if r.outcome == "complete":
                why = verify_media(r) if r.media_path else None
                if why:
                    print(f"  session {r.session}: media does not verify: {why}")
                    failed.append(r)
                elif r.media_path:
                    print(f"  session {r.session}: {r.media_path} decodes to the {len(r.frame_sha256)} frames sent")
    for r in reports:
        for name, problems in invariants(r.interaction) if r.interaction is not None and r.outcome == "complete" else ():
            if problems:
                print(f"  session {r.session}: {name}: broken: {'; '.join(problems[:5])}")
                failed.append(r)
    if out is not None:
        (out / "client.json").write_bytes(msgspec.json.format(msgspec.json.encode(
            [msgspec.structs.asdict(r) | {"frame_sha256": r.frame_sha256} for r in reports]), indent=1))
    if failed:
        r = failed[0]
        print(f"error: session {r.session if r.session is not None else '-'}: {r.error or r.outcome}", file=sys.stderr)
        return 1
    return 0
