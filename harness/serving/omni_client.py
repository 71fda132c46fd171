"""``python -m harness client --api vllm-omni``: measure any server of vLLM-Omni's realtime video API.

It drives ``WS /v1/realtime/video`` (``serving.omni_protocol``) as a player would: one connection
per session, a ``session.start`` with the workload (seed, prompt, size, ``num_frames`` for the
chunks asked, the camera script of the harness's scripted trajectory, an optional image),
``session.ping`` keep-alives, and interactions on a schedule (``--interaction-every K``: after
every K-th chunk, a camera event with the trajectory's keys, the first one with ``--interaction-
prompt`` too; unique event ids). It times every message at the client, on the host's monotonic
clock, and writes a run directory under the harness's contract:

- ``events.jsonl``: one row per media chunk; ``delivered`` = the last byte of that chunk's media
  read by the client. Server boundaries are recorded only when the metadata carries them *and*
  the server's clock is this host's (``server_boot_id`` equals this host's boot id: the harness's
  own ``serve --listen --api vllm-omni``); otherwise they are absent, and every figure that needs
  them reads "not measured", never estimated.
- ``sessions.jsonl``: session start = the send of ``session.start``.
- ``client.jsonl``: what has no boundary in the event schema, per session: the send of
  ``session.start``, the arrival of ``video.start``, of each chunk's metadata and of its last byte,
  every interaction (sent, queued receipt, the chunk that reported it applied), pongs, errors.
- ``media/session{S}.mp4`` (the fragments as received, concatenated in order; renamed into place
  only for a session that completed), ``frames.jsonl`` (SHA-256 of every decoded frame), and for
  the saved epochs the decoded pixels per chunk (``outputs/epoch{E}/chunk{CC}.pixels.npy`` and
  ``outputs/hashes.jsonl``; a client has no latents) for ``gate``.
- ``summary.json`` through ``measure.summary.build_summary`` at the reference ``delivered``, and
  ``manifest.json`` (status running → complete / failed, the command line, the server's
  ``video.start`` config).
"""

from __future__ import annotations

import asyncio
import base64
import datetime as _dt
import hashlib
import mimetypes
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec
import numpy as np
from aiohttp import WSMsgType

from harness.drivers.rundir import command_line, host_load, new_run_dir, versions, write_json, write_jsonl
from harness.drivers.runstate import owner_record
from harness.drivers.trajectory import actions_for
from harness.errors import HarnessError
from harness.measure.clock import now
from harness.measure.events import BOUNDARIES, ChunkEvent, SessionStart
from harness.measure.gates import SAVED_EPOCHS, HashRecord, array_sha256, save_pixels, write_hashes
from harness.measure.headline import headline
from harness.measure.metrics import window_for
from harness.measure.summary import SUMMARY_FILE, build_summary, run_summary
from harness.pipeline.decode import decode_pyav
from harness.serving import omni_protocol as O
from harness.serving.protocol import boot_id, one_line

REFERENCE = "delivered"


@dataclass
class Workload:
    """What every session asks for; session i uses seed + i."""

    url: str
    sessions: int = 1
    chunks: int = 10
    seed: int = 0
    prompt: str = ""
    width: int | None = None
    height: int | None = None
    fps: float | None = None
    model: str | None = None
    image_reference: dict | None = None
    ping_s: float = 5.0
    interaction_every: int | None = None
    interaction_prompt: str = ""
    receive_timeout_s: float = 300.0


class ChunkRecord(msgspec.Struct, omit_defaults=True):
    """One ``video.chunk_metadata`` and its binary frame, as the client saw them."""

    kind: str
    num_frames: int
    byte_length: int
    metadata_ns: int
    last_byte_ns: int
    generation_chunk_index: int | None = None
    transport_chunk_index: int | None = None
    started_event_ids: list[str] = []
    completed_event_ids: list[str] = []
    applied_event_ids: list[str] = []
    server_timestamps: dict[str, int] = {}
    server_boot_id: str = ""
    frame_sha256: list[str] = []


class InteractionRecord(msgspec.Struct, omit_defaults=True):
    event_id: str
    sent_ns: int
    after_chunk: int
    queued_ns: int | None = None
    applied_chunk: int | None = None
    error: str | None = None


class ClientSession(msgspec.Struct, omit_defaults=True):
    """Everything one session's connection carried, timed at the client (``client.jsonl``)."""

    session: int
    seed: int
    chunks_asked: int
    outcome: str = ""  # complete | stopped | error | closed
    error: str = ""
    request_id: str = ""
    start_sent_ns: int = 0
    video_start_ns: int | None = None
    done_ns: int | None = None
    config: dict = {}
    chunks: list[ChunkRecord] = []
    interactions: list[InteractionRecord] = []
    pongs: int = 0
    errors: list[str] = []
    media_path: str = ""
    decoded_frames: int | None = None
    media_check: str = ""  # "" = decoded frames match the server's hashes (or none were sent)


def camera_action_script(seed: int, chunks: int, frames: int = O.LATENT_FRAMES_PER_CHUNK) -> list[list[list[str]]]:
    """The scripted trajectory (``drivers.trajectory``) as production's per-chunk key lists."""
    return [[list(a.lower()) for a in actions_for(seed, c, frames)] for c in range(chunks)]


def image_reference(path: str) -> dict:
    """``--image FILE`` as production's ``image_reference`` (a data URL)."""
    p = Path(path)
    if not p.is_file():
        raise HarnessError(f"--image {path}: no such file")
    mime = mimetypes.guess_type(p.name)[0] or "application/octet-stream"
    if not mime.startswith("image/"):
        raise HarnessError(f"--image {path}: not an image ({mime})")
    return {"image_url": f"data:{mime};base64,{base64.b64encode(p.read_bytes()).decode()}"}


def start_message(w: Workload, seed: int) -> O.SessionStart:
    return O.SessionStart(prompt=w.prompt, model=w.model, image_reference=w.image_reference, width=w.width,
                          height=w.height, fps=w.fps, seed=seed, num_frames=O.num_frames_for_chunks(w.chunks),
                          extra_params=O.ExtraParams(camera_action_script=camera_action_script(seed, w.chunks)))


# ---- one session ------------------------------------------------------------------------------
@dataclass
class _LiveSession:
    """One session while it streams: its socket, what it asked for, its record and the media so far."""

    ws: aiohttp.ClientWebSocketResponse
    w: Workload
    rec: ClientSession
    media: list[bytes] = field(default_factory=list)
    pending: O.ChunkMetadata | None = None
    pending_ns: int = 0
    sent_events: dict[str, InteractionRecord] = field(default_factory=dict)

    async def send(self, msg) -> None:
        await self.ws.send_str(O.encode(msg))

    async def pinger(self) -> None:
        while True:
            await asyncio.sleep(self.w.ping_s)
            await self.send(O.SessionPing())

    async def interact(self, after_chunk: int) -> None:
        n = len(self.sent_events)
        event_id = f"s{self.rec.session}-e{n}"
        keys = actions_for(self.rec.seed + 1000 + n, after_chunk, 1)[0].lower()
        event = O.InteractionEvent(prompt=self.w.interaction_prompt or None if n == 0 else None,
                                   multi_modal_data=O.InteractionModalities(camera=O.CameraInput(keys=list(keys))))
        self.sent_events[event_id] = InteractionRecord(event_id, now(), after_chunk)
        await self.send(O.SessionInteraction(interaction=O.Interaction(event_id=event_id, event=event)))

    def on_media(self, data: bytes, t: int) -> str | None:
        """The binary frame of the pending metadata; an error text when it does not fit."""
        md, self.pending = self.pending, None
        if md is None:
            return "media without chunk metadata"
        if len(data) != md.byte_length:
            return f"chunk {md.transport_chunk_index}: {len(data)} bytes, metadata said {md.byte_length}"
        self.media.append(data)
        k = len(self.rec.chunks)
        self.rec.chunks.append(ChunkRecord(
            md.kind, md.num_frames, md.byte_length, self.pending_ns, t, md.generation_chunk_index, md.transport_chunk_index,
            md.started_event_ids, md.completed_event_ids, md.applied_event_ids, md.server_timestamps, md.server_boot_id,
            md.frame_sha256))
        for e in {*md.started_event_ids, *md.applied_event_ids}:
            if e in self.sent_events and self.sent_events[e].applied_chunk is None:
                self.sent_events[e].applied_chunk = md.generation_chunk_index if md.generation_chunk_index is not None else k
        return None

    async def on_text(self, data: str, t: int) -> bool:
        """True when the session is over."""
        try:
            msg = O.decode_server(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return self.fail("error", one_line(f"bad message from the server: {e}"))
        rec = self.rec
        if isinstance(msg, O.VideoStart):
            rec.video_start_ns, rec.request_id, rec.config = t, msg.request_id, msg.config
        elif isinstance(msg, O.ChunkMetadata):
            self.pending, self.pending_ns = msg, t
        elif isinstance(msg, O.InteractionQueued):
            if msg.event_id in self.sent_events:
                self.sent_events[msg.event_id].queued_ns = t
        elif isinstance(msg, O.SessionPong):
            rec.pongs += 1
        elif isinstance(msg, O.SessionDone):
            rec.done_ns = t
            rec.outcome = "stopped" if msg.stopped else "complete"
            return True
        elif isinstance(msg, O.Error):
            # an interaction's refusal names its event and the session goes on; any other error
            # (a refused start, a failed generation, a stall) is the session's end in production
            if msg.event_id is not None and msg.event_id in self.sent_events:
                self.sent_events[msg.event_id].error = msg.message
                rec.errors.append(msg.message)
            else:
                return self.fail("error", msg.message)
        return False

    def fail(self, outcome: str, error: str) -> bool:
        self.rec.outcome, self.rec.error = outcome, error
        return True

    async def run(self) -> None:
        rec, w = self.rec, self.w
        rec.start_sent_ns = now()
        await self.send(start_message(w, rec.seed))
        ping = asyncio.create_task(self.pinger())
        try:
            while True:
                try:
                    m = await self.ws.receive(timeout=w.receive_timeout_s)
                except asyncio.TimeoutError:
                    self.fail("error", f"no message from the server for {w.receive_timeout_s:g} s")
                    return
                t = now()
                if m.type == WSMsgType.TEXT:
                    if await self.on_text(m.data, t):
                        return
                elif m.type == WSMsgType.BINARY:
                    if why := self.on_media(m.data, t):
                        self.fail("error", why)
                        return
                    media = [c for c in rec.chunks if c.kind == "media"]
                    if (w.interaction_every and rec.chunks[-1].kind == "media" and len(media) % w.interaction_every == 0
                            and len(media) < w.chunks):
                        await self.interact(len(media) - 1)
                else:
                    self.fail("closed", one_line(f"connection closed by the server (code {self.ws.close_code})"))
                    return
        finally:
            ping.cancel()
            rec.interactions = list(self.sent_events.values())


async def run_session(w: Workload, session: int, http: aiohttp.ClientSession) -> tuple[ClientSession, bytes]:
    rec = ClientSession(session=session, seed=w.seed + session, chunks_asked=w.chunks, chunks=[], interactions=[], errors=[])
    try:
        async with http.ws_connect(w.url, max_msg_size=O.MAX_FRAME_BYTES * 4) as ws:
            s = _LiveSession(ws, w, rec)
            await s.run()
            return rec, b"".join(s.media)
    except (aiohttp.ClientError, OSError) as e:
        rec.outcome, rec.error = "error", one_line(f"cannot connect to {w.url}: {e}")
        return rec, b""


# ---- the run directory --------------------------------------------------------------------------
def chunk_events(rec: ClientSession, host_boot: str) -> list[ChunkEvent]:
    """One event row per media chunk: ``delivered`` at the client, the server's boundaries only
    when its clock is this host's."""
    out = []
    for k, c in enumerate(x for x in rec.chunks if x.kind == "media"):
        server = c.server_timestamps if c.server_boot_id and c.server_boot_id == host_boot else {}
        stamps = {b: t for b, t in server.items() if b in BOUNDARIES and b != REFERENCE}
        out.append(ChunkEvent(session=rec.session, epoch=rec.session, chunk=k, frames=c.num_frames,
                              delivered=c.last_byte_ns, **stamps))
    return out


def split_frames(frames: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    """Decoded frames cut into chunks of the metadata's frame counts (in order)."""
    edges = np.cumsum([0, *counts])
    return [frames[a:b] for a, b in zip(edges[:-1], edges[1:])]


def check_media(rec: ClientSession, frames: np.ndarray) -> str:
    """"" when the decoded frames are as many as announced and, where the server sent per-frame
    hashes (the harness's server: lossless), equal to them."""
    media = [c for c in rec.chunks if c.kind == "media"]
    want_n = sum(c.num_frames for c in media)
    if len(frames) != want_n:
        return f"decoded {len(frames)} frames, the metadata announced {want_n}"
    want = [h for c in media for h in c.frame_sha256]
    if want:
        got = [hashlib.sha256(f.tobytes()).hexdigest() for f in frames]
        if got != want:
            n = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b) if len(got) == len(want) else min(len(got), len(want))
            return f"decoded frames differ from the server's hashes from frame {n} on"
    return ""


def save_session(run_dir: Path, rec: ClientSession, media: bytes) -> tuple[list[str], list[HashRecord]]:
    """Media file, decoded frame hashes, and (saved epochs) per-chunk pixels; returns the frame
    hashes and the hash records."""
    if not media:
        return [], []
    final = run_dir / "media" / f"session{rec.session}.mp4"
    part = final.with_name(final.name + ".part")
    part.write_bytes(media)
    frames = decode_pyav(part).frames
    rec.decoded_frames, rec.media_check = len(frames), check_media(rec, frames)
    if rec.outcome != "complete":
        part.unlink()  # a partial file is never left looking like a video
        return [], []
    os.replace(part, final)
    rec.media_path = str(final.relative_to(run_dir))
    hashes = [hashlib.sha256(f.tobytes()).hexdigest() for f in frames]
    counts = [c.num_frames for c in rec.chunks if c.kind == "media"]
    records = []
    if not rec.media_check:
        for k, px in enumerate(split_frames(frames, counts)):
            if rec.session in SAVED_EPOCHS:
                save_pixels(run_dir, rec.session, k, px)
            records.append(HashRecord(epoch=rec.session, chunk=k, session=rec.session, pixels_sha256=array_sha256(px)))
    return hashes, records


def client_manifest(w: Workload, status: str) -> dict:
    return {
        "command": command_line(sys.argv),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "status": status,
        "owner": owner_record(),
        "client": {"api": "vllm-omni", "url": w.url, "ping_s": w.ping_s, "interaction_every": w.interaction_every},
        "seeds": {"run": w.seed, "sessions": "seed + session index"},
        "protocol": {"name": "client", "sessions": w.sessions, "warmup_epochs": 1, "chunks_per_session": w.chunks,
                     "window": msgspec.to_builtins(window_for(w.chunks)), "reference_boundary": REFERENCE,
                     "saved_epochs": list(SAVED_EPOCHS), "outputs": "pixels (decoded at the client; no latents)",
                     "media": "client", "boundaries": "delivered at the client; the server's only from the same host clock"},
        "versions": versions(),
        "host": {"cpus": os.cpu_count(), "load_start": host_load()},  # a busy client host slows what it measures
    }


async def run_all(w: Workload) -> list[tuple[ClientSession, bytes]]:
    out = []
    async with aiohttp.ClientSession() as http:
        for i in range(w.sessions):
            rec, media = await run_session(w, i, http)
            out.append((rec, media))
            if rec.outcome in ("error", "closed"):
                break
    return out


def measure(w: Workload, out: str | None, overwrite: bool = False) -> tuple[Path, list[ClientSession], dict]:
    """Run the sessions and write the run directory; returns it, the sessions and the summary."""
    run_dir = new_run_dir(out, "omni-client", overwrite)
    man = client_manifest(w, "running")
    write_json(run_dir / "manifest.json", man)
    status, error, results = "failed", None, []
    try:
        results = asyncio.run(run_all(w))
        status = "complete"
    except BaseException as e:
        error = one_line(f"{type(e).__name__}: {e}")
        raise
    finally:
        summary = finish(run_dir, w, results, status, error, man)
    return run_dir, [r for r, _ in results], summary


def finish(run_dir: Path, w: Workload, results: list[tuple[ClientSession, bytes]], status: str, error: str | None,
           man: dict) -> dict:
    host = boot_id()
    events, starts, frames, hashes = [], [], [], []
    for rec, media in results:
        h, records = save_session(run_dir, rec, media)
        frames.append({"session": rec.session, "frame_sha256": h})
        hashes += records
        events += chunk_events(rec, host)
        starts.append(SessionStart(session=rec.session, epoch=rec.session, start_ns=rec.start_sent_ns,
                                   cancelled=rec.outcome != "complete"))
    recs = [r for r, _ in results]
    if status == "complete" and (bad := next((r for r in recs if r.outcome != "complete" or r.media_check), None)):
        status, error = "failed", f"session {bad.session}: {bad.error or bad.media_check or bad.outcome}"
    write_jsonl(run_dir / "events.jsonl", events)
    write_jsonl(run_dir / "sessions.jsonl", starts)
    write_jsonl(run_dir / "frames.jsonl", frames)
    write_jsonl(run_dir / "client.jsonl", recs)
    write_hashes(run_dir, hashes)
    figures = build_summary(events, starts, window=window_for(w.chunks), reference=REFERENCE)
    summary = run_summary(figures, status=status, error=error, hooks=[], candidates=[], probes={},
                          sessions_completed=sum(r.outcome == "complete" for r in recs), stalls=[], stall_report_s=0.0,
                          protocol="client")
    write_json(run_dir / SUMMARY_FILE, summary)
    man.setdefault("host", {})["load_end"] = host_load()
    man.update(status=status, error=error, ended=_dt.datetime.now(_dt.timezone.utc).isoformat(), summary=SUMMARY_FILE,
               server={"request_config": recs[0].config if recs else {},
                       "same_host_clock": any(c.server_boot_id == host for r in recs for c in r.chunks)})
    write_json(run_dir / "manifest.json", man)
    return msgspec.to_builtins(summary)


# ---- CLI ----------------------------------------------------------------------------------------
def workload(args, url: str) -> Workload:
    """The command line as a workload; bad input refused before anything connects."""
    for name in ("sessions", "chunks", "interaction_every"):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise HarnessError(f"--{name.replace('_', '-')} must be ≥ 1, got {v}")
    harness_only = [f"--{n.replace('_', '-')}" for n in ("read_rate", "prebuffer_frames", "disconnect_after_chunk",
                                                          "cancel_after_chunk", "preset") if getattr(args, n, None) is not None]
    if harness_only or getattr(args, "verify", False):
        raise HarnessError(f"{', '.join(harness_only) or '--verify'}: an option of --api harness; --api vllm-omni always "
                           "decodes and checks the media and takes its sizes from --width/--height")
    if not args.ping > 0:
        raise HarnessError(f"--ping must be positive, got {args.ping}")
    return Workload(url=url, sessions=args.sessions, chunks=args.chunks or 10, seed=args.seed,
                    prompt=args.prompt, width=args.width, height=args.height, model=args.model,
                    image_reference=image_reference(args.image) if args.image else None, ping_s=args.ping,
                    interaction_every=args.interaction_every, interaction_prompt=args.interaction_prompt)


def table(recs: list[ClientSession]) -> list[str]:
    rows = [f"{'session':>7} {'outcome':<9} {'chunks':>7} {'frames':>6} {'TTFC ms':>8} {'queued':>7} {'media'}"]
    for r in recs:
        media = [c for c in r.chunks if c.kind == "media"]
        ttfc = f"{(media[0].last_byte_ns - r.start_sent_ns) / 1e6:.1f}" if media else "-"
        queued = sum(i.queued_ns is not None for i in r.interactions)
        rows.append(f"{r.session:>7} {r.outcome:<9} {len(media):>3}/{r.chunks_asked:<3} {sum(c.num_frames for c in media):>6} "
                    f"{ttfc:>8} {queued:>3}/{len(r.interactions):<3} {r.media_check or ('decodes' if r.media_path else '-')}")
        if r.error:
            rows.append(f"        {r.outcome}: {r.error}")
    return rows


def print_run(lines: list[str], run_dir: Path, summary: dict) -> int:
    """A measuring client's console end: its own lines, the run directory, the headline; 1 unless complete."""
    for line in lines:
        print(line)
    print(f"run directory: {run_dir}")
    for line in headline(summary):
        print(line)
    if summary.get("status") != "complete":
        print(f"error: {summary.get('error')}", file=sys.stderr)
        return 1
    return 0


def main(args, url: str) -> int:
    """``url``: the endpoint of ``--connect`` (``client.session_url`` at production's path)."""
    w = workload(args, url)
    run_dir, recs, summary = measure(w, args.out, getattr(args, "overwrite", False))
    return print_run(table(recs), run_dir, summary)
