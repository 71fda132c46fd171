"""The driver: runs sessions over the launched ranks with the Case D or Case E schedule.

Both schedules use the same workers and messages; they differ only in when the next chunk's
DiT request may go out:

* Case D — after chunk i's frames are in host memory (``cpu_ready``): DiT(i) → VAE(i) → DiT(i+1).
* Case E — as soon as the DiT returned chunk i's latent and that latent has been handed to the
  VAE (or is the only one waiting), with at most ``max_pending_decodes`` decodes in flight.

The driver stamps ``submit``, ``latent_ready`` and ``decode_submit`` itself; the other
boundaries arrive in the workers' replies. A chunk's event is complete when the encoder stage
reports it delivered.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import msgspec

from harness.config import HarnessConfig
from harness.drivers.launcher import LocalLauncher, RankFailed
from harness.drivers.trajectory import actions_for
from harness.engine.image import synthetic_image
from harness.measure.clock import now
from harness.measure.events import ChunkEvent, SessionStart
from harness.measure.gates import save_latent
from harness.measure.metrics import DEFAULT_WINDOW
from harness.pipeline import messages as M


@dataclass
class SessionResult:
    start: SessionStart
    events: list[ChunkEvent]
    frame_sha256: list[str]
    chunk_hashes: list[dict]
    media: M.MediaClosed | None
    kv_after: dict[str, int] = field(default_factory=dict)
    ring_free_after: int | None = None
    cancelled: bool = False


@dataclass
class SessionControl:
    """How a session is driven from outside the driver (a client, a scenario).

    ``actions(chunk)`` supplies each chunk's actions (default: the scripted trajectory);
    ``should_cancel(start_ns, stamps)`` is polled every ``poll_s`` while the session runs and
    sees the boundaries the driver has stamped so far, so a scenario can cancel "2 ms after
    chunk 3's decode was submitted" and a server can cancel when its client asks or leaves.
    """

    actions: Callable[[int], list[str]] | None = None
    should_cancel: Callable[[int, list[dict]], bool] | None = None
    poll_s: float = 0.002
    keep_partial_media: bool = False
    prompt: str = ""


class StallWatch:
    """Notices a stage that owes a reply and makes no progress (alive, just stuck) within
    ``bound_s`` plus one poll period (≤ 1 s), long before the ``rank_timeout_s`` that gives up.
    One report per stall: printed at once, and kept (with its full length) for the summary.

    A compiled warm-up compiles on its first chunks: for chunks below ``allowance_chunks`` of the
    DiT and the VAE the bound is ``bound_s + allowance_s`` (a stall past that is still named), and
    passing the plain bound there prints a note instead of a stall. ``clock`` is for tests."""

    COMPILING_STAGES = ("dit", "vae")

    def __init__(self, bound_s: float, session: int, epoch: int, sink: list[dict], *, allowance_s: float = 0.0,
                 allowance_chunks: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.bound_s, self.session, self.epoch, self.sink = bound_s, session, epoch, sink
        self.allowance_s, self.allowance_chunks, self.clock = allowance_s, allowance_chunks, clock
        self.since = clock()
        self.current: dict | None = None
        self.noted = False  # the compile note of the current wait was printed
        self.checked = 0.0  # how long the wait had lasted at the previous idle check

    def allowance(self, stage: str, chunk: int) -> float:
        """The compile allowance that applies to ``stage`` owing ``chunk`` (0 where none does)."""
        return self.allowance_s if stage in self.COMPILING_STAGES and chunk < self.allowance_chunks else 0.0

    def idle(self, stage: str, chunk: int, rank: str = "") -> None:
        waited = self.clock() - self.since
        extra = self.allowance(stage, chunk)
        if self.current is None and waited >= self.bound_s + extra:
            # previous_check_s < bound_s <= reported_after_s: reported at the first look past the bound
            # (rounded down: rounding to nearest could lift a look just under the bound onto it)
            self.current = {"session": self.session, "epoch": self.epoch, "chunk": chunk, "stage": stage,
                            "reported_after_s": round(waited, 3), "previous_check_s": math.floor(self.checked * 1e3) / 1e3,
                            "bound_s": self.bound_s + extra, "compile_allowance_s": extra, "lasted_s": None,
                            "rank": rank or stage}
            self.sink.append(self.current)
            print(f"stall: {stage} ({rank or stage}) made no progress for {waited:.1f} s (session {self.session}, chunk {chunk}); "
                  f"still waiting", file=sys.stderr, flush=True)
        elif self.current is None and extra and waited >= self.bound_s and not self.noted:
            self.noted = True
            print(f"note: {stage} has not answered for {waited:.1f} s on warm-up chunk {chunk} (session {self.session}): "
                  f"compiling, within the {extra:.0f} s compile allowance (runtime.compile_allowance_s)",
                  file=sys.stderr, flush=True)
        self.checked = waited

    def progress(self) -> None:
        if self.current is not None:
            self.current["lasted_s"] = round(self.clock() - self.since, 3)
            self.current = None
        self.since, self.checked, self.noted = self.clock(), 0.0, False


def stall_watch(cfg: HarnessConfig, session: int, epoch: int, sink: list[dict]) -> StallWatch:
    """The session's watch: a compile allowance only where compiling happens (the compiled mode's
    warm-up epochs; measured epochs run compiled code and get the plain bound)."""
    rt = cfg.runtime
    compiling = rt.mode != "eager" and not DEFAULT_WINDOW.measured(epoch)  # compiled and deterministic both compile
    # a deferred commit (H5b) runs chunk k's commit pass in chunk k + 1's call: one call later
    chunks = rt.compile_allowance_chunks + (rt.commit == "deferred")
    return StallWatch(rt.stall_report_s, session, epoch, sink, allowance_s=rt.compile_allowance_s if compiling else 0.0,
                      allowance_chunks=chunks if compiling else 0)


@dataclass
class _SessionInFlight:
    """One session as the driver runs it: the boundaries it stamped, the chunks in flight."""

    session: int
    epoch: int
    n: int  # chunks asked for
    ctl: SessionControl
    case_e: bool
    save: bool  # a saved epoch: latents and pixels are kept
    actions: Callable[[int], list[str]]
    start_ns: int = 0
    next_chunk: int = 0
    dit_busy: bool = False
    done: int = 0  # chunks finished: delivered, or discarded after a cancel
    frames_back: int = 0  # chunks whose frames reached host memory
    cancelled: bool = False
    waiting: deque = field(default_factory=deque)  # (chunk, LatentReady) not yet handed to the VAE
    decoding: deque = field(default_factory=deque)  # chunks the VAE is decoding, in order
    frame_sha: dict[int, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.stamps: list[dict] = [dict() for _ in range(self.n)]
        self.extra: list[dict] = [{"gpu_ms": {}, "blocked_ns": {}, "frames": 0} for _ in range(self.n)]
        self.hashes: list[dict] = [{} for _ in range(self.n)]

    @property
    def target(self) -> int:
        """Chunks to finish: all of them, or after a cancel only those already submitted."""
        return self.next_chunk if self.cancelled else self.n

    def may_submit(self) -> bool:
        if self.cancelled or self.dit_busy or self.next_chunk >= self.n:
            return False
        if self.case_e:
            return not self.waiting
        return self.frames_back == self.next_chunk  # Case D: previous chunk is cpu_ready

    def cancel(self) -> None:
        """In-flight work is finished and discarded; nothing new starts."""
        self.cancelled = True
        self.done += len(self.waiting)
        self.waiting.clear()

    def owed(self) -> tuple[str, int]:
        """The stage that owes the next reply, and for which chunk (for stall reports)."""
        if self.dit_busy:
            return "dit", self.next_chunk - 1
        return ("vae", self.decoding[0]) if self.decoding else ("encoder", self.done)


@dataclass
class Driver:
    cfg: HarnessConfig
    launcher: LocalLauncher
    run_dir: Path
    #: called with each chunk's event (and the encoder's reply, None for chunks never encoded)
    on_chunk: Callable[[ChunkEvent, "M.ChunkDelivered | None"], None] | None = None
    _io: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="driver-io"))
    #: every stall seen (a stage owing a reply silent for ``runtime.stall_report_s``), for the summary
    stalls: list[dict] = field(default_factory=list)
    #: the engine group this driver runs (``serve --listen --replicas``): stamped on every row
    replica: int | None = None

    def close(self) -> None:
        self._io.shutdown(wait=True)

    # ---- one session ---------------------------------------------------------------------
    def run_session(self, session: int, epoch: int, seed: int, chunks: int | None = None,
                    control: "SessionControl | None" = None) -> SessionResult:
        cfg = self.cfg
        ctl = control or SessionControl()
        s = _SessionInFlight(session=session, epoch=epoch, n=chunks or cfg.video.chunks_per_session, ctl=ctl,
                     case_e=cfg.runtime.scheduler == "case-e", save=epoch in cfg.runtime.save_epochs,
                     actions=ctl.actions or (lambda c: actions_for(seed, c, cfg.video.frames_per_chunk)))
        # The picture is the client's upload: it exists before the session starts, so making the
        # stand-in (≈ 25 ms of CPU at 480×832) is not serving time; turning it into the condition is.
        picture = M.Tensor.of(synthetic_image(seed, cfg.video.height, cfg.video.width))
        s.start_ns = now()
        self._open(s, seed, picture)
        self._drive(s)
        return self._conclude(s)

    def _open(self, s: _SessionInFlight, seed: int, picture: M.Tensor) -> None:
        L = self.launcher
        start_msg = M.StartSession(session=s.session, epoch=s.epoch, seed=seed, prompt=s.ctl.prompt or f"session {s.session}")
        L.send(L.lead("encoder"), M.OpenSession(session=s.session, epoch=s.epoch))
        L.fanout("dit", msgspec.structs.replace(start_msg, image=picture))
        L.fanout("vae", start_msg)

    def _drive(self, s: _SessionInFlight) -> None:
        """Submit chunks and decodes as the schedule allows and take the ranks' replies until every
        chunk is delivered (or, once cancelled, every chunk in flight is finished and discarded)."""
        L, ctl, timeout = self.launcher, s.ctl, self.cfg.runtime.rank_timeout_s
        deadline = time.monotonic() + timeout
        watch = stall_watch(self.cfg, s.session, s.epoch, self.stalls)
        while s.done < s.target:
            if not s.cancelled and ctl.should_cancel is not None and ctl.should_cancel(s.start_ns, s.stamps):
                s.cancel()
                continue
            if s.may_submit():
                self._submit_chunk(s)
                watch.progress()  # the wait for a client's actions is not a stage's stall
            self._submit_decodes(s)
            if s.may_submit():
                continue
            wait_s = ctl.poll_s if ctl.should_cancel is not None and not s.cancelled else 1.0
            msgs = L.poll(min(wait_s, max(0.0, deadline - time.monotonic())))
            if not msgs and time.monotonic() > deadline:
                raise RankFailed(f"session {s.session}: no progress for {timeout:.0f} s ({s.done} of {s.n} chunks done); "
                                 f"{self._owing(s.owed()[0])} owes its reply")
            if not msgs:
                stage, chunk = s.owed()
                watch.idle(stage, chunk, rank=self._owing(stage))
            for proc, msg in msgs:
                deadline = time.monotonic() + timeout
                watch.progress()
                self._on_reply(s, proc, msg)
            if msgs:
                watch.progress()  # on_chunk may have waited on a client: that is not a stage's stall

    def _owing(self, stage: str) -> str:
        owing = getattr(self.launcher, "owing", None)  # a test's stand-in launcher may have none
        return owing(stage) if owing is not None else stage

    def _submit_chunk(self, s: _SessionInFlight) -> None:
        c = s.next_chunk
        acts = s.actions(c)
        s.stamps[c]["submit"] = now()
        self.launcher.fanout("dit", M.GenerateChunk(session=s.session, chunk=c, actions=acts))
        s.next_chunk, s.dit_busy = c + 1, True

    def _submit_decodes(self, s: _SessionInFlight) -> None:
        """Hand waiting latents to the VAE, up to ``max_pending_decodes`` in flight."""
        while s.waiting and len(s.decoding) < self.cfg.runtime.max_pending_decodes:
            c, lat = s.waiting.popleft()
            s.stamps[c]["decode_submit"] = now()
            self.launcher.fanout("vae", M.DecodeChunk(session=s.session, epoch=s.epoch, chunk=c, latent=lat.latent))
            s.decoding.append(c)
            self._io.submit(self._keep_latent, s.epoch, c, lat.latent, s.save, s.hashes[c])

    def _on_reply(self, s: _SessionInFlight, proc, msg) -> None:
        if isinstance(msg, M.LatentReady):
            self._on_latent(s, msg)
        elif isinstance(msg, M.FramesReady):
            self._on_frames(s, msg)
        elif isinstance(msg, M.ChunkDelivered):
            self._on_delivered(s, msg)
        else:
            raise RankFailed(f"unexpected {type(msg).__name__} from {proc.name} in session {s.session}")

    def _on_latent(self, s: _SessionInFlight, msg: M.LatentReady) -> None:
        t = now()
        s.stamps[msg.chunk].update(dit_start=msg.dit_start, dit_end=msg.dit_end, latent_ready=t)
        s.extra[msg.chunk]["gpu_ms"].update({f"dit_{k}" if k != "dit" else k: v for k, v in msg.gpu_ms.items()})
        s.dit_busy = False
        if s.cancelled:
            s.done += 1  # finished, discarded: never decoded
        else:
            s.waiting.append((msg.chunk, msg))

    def _on_frames(self, s: _SessionInFlight, msg: M.FramesReady) -> None:
        s.stamps[msg.chunk].update(decode_start=msg.decode_start, decode_end=msg.decode_end, gpu_ready=msg.gpu_ready,
                                   cpu_ready=msg.cpu_ready)
        extra = s.extra[msg.chunk]
        extra["gpu_ms"].update(msg.gpu_ms)
        extra["blocked_ns"].update(msg.blocked_ns)
        extra["frames"] = msg.frames
        s.decoding.popleft()
        s.frames_back += 1
        # a cancelled session's frames only free their slot; nothing is encoded
        L = self.launcher
        L.send(L.lead("encoder"), M.EncodeChunk(frames=msg, save_pixels=s.save and not s.cancelled, discard=s.cancelled))

    def _on_delivered(self, s: _SessionInFlight, msg: M.ChunkDelivered) -> None:
        s.stamps[msg.chunk].update({k: v for k, v in (("received", msg.received), ("encoded", msg.encoded),
                                                      ("delivered", msg.delivered)) if v is not None})
        s.extra[msg.chunk]["blocked_ns"].update({k: v for k, v in msg.blocked_ns.items() if v})
        if msg.encoded is not None:
            s.hashes[msg.chunk]["pixels_sha256"] = msg.pixel_sha256
            s.frame_sha[msg.chunk] = msg.frame_sha256
        s.done += 1
        if self.on_chunk:
            self.on_chunk(self._event(s.session, s.epoch, msg.chunk, s.stamps, s.extra, s.cancelled), msg)

    def _conclude(self, s: _SessionInFlight) -> SessionResult:
        """End the session on every rank and gather its result; a cancelled session's chunks that
        never reached the encoder still get their event row."""
        media, kv, ring_free = self._end_session(s.session, discard=s.cancelled and not s.ctl.keep_partial_media)
        self._io.submit(lambda: None).result()  # latent saves/hashes of this session are done
        m = s.target
        events = [self._event(s.session, s.epoch, c, s.stamps, s.extra, s.cancelled) for c in range(m)]
        if s.cancelled and self.on_chunk:
            for c in range(m):
                if "received" not in s.stamps[c]:
                    self.on_chunk(events[c], None)
        records = [] if s.cancelled else [dict(epoch=s.epoch, session=s.session, chunk=c, **s.hashes[c]) for c in range(s.n)]
        start = SessionStart(session=s.session, epoch=s.epoch, start_ns=s.start_ns, cancelled=s.cancelled, replica=self.replica)
        return SessionResult(start, events, [h for c in range(m) for h in s.frame_sha.get(c, [])], records, media, kv,
                             ring_free, s.cancelled)

    def _end_session(self, session: int, discard: bool = False):
        L = self.launcher
        L.send(L.lead("encoder"), M.CloseSession(session=session, discard=discard))
        L.fanout("dit", M.EndSession(session=session))
        L.fanout("vae", M.EndSession(session=session))
        media, kv, ring_free = None, {}, None
        pending = {"encoder", "dit", "vae"}
        deadline = time.monotonic() + self.cfg.runtime.rank_timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise RankFailed(f"session {session}: {', '.join(sorted(pending))} did not acknowledge the end")
            for proc, msg in L.poll(1.0):
                if isinstance(msg, M.MediaClosed):
                    media = msg
                    pending.discard("encoder")
                elif isinstance(msg, M.SessionEnded):
                    if msg.role == "dit":
                        kv = dict(msg.stats)
                    else:
                        ring_free = msg.stats.get("ring_free")
                    pending.discard(msg.role)
        return media, kv, ring_free

    def _keep_latent(self, epoch: int, chunk: int, latent: M.Tensor, save: bool, record: dict) -> None:
        """Off the critical path: hash every chunk's latent, save those of the saved epochs."""
        record["latent_sha256"] = hashlib.sha256(latent.data).hexdigest()
        if save:
            save_latent(self.run_dir, epoch, chunk, latent.array())

    def _event(self, session: int, epoch: int, chunk: int, stamps: list[dict], extra: list[dict], cancelled: bool = False) -> ChunkEvent:
        e = extra[chunk]
        return ChunkEvent(session=session, epoch=epoch, chunk=chunk, frames=e["frames"], gpu_ms=dict(e["gpu_ms"]),
                          blocked_ns=dict(e["blocked_ns"]), cancelled=cancelled, replica=self.replica, **stamps[chunk])

    # ---- small probes --------------------------------------------------------------------
    def control_round_trip_ns(self, n: int = 20) -> list[int]:
        """Driver → DiT rank 0 → driver over the control pipe, ``n`` times."""
        L = self.launcher
        out = []
        for _ in range(n):
            t0 = now()
            L.send(L.lead("dit"), M.Ping(sent_ns=t0))
            msg = L.recv(L.lead("dit"), 30.0)
            assert isinstance(msg, M.Pong)
            out.append(now() - t0)
        return out

