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
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from harness.config import HarnessConfig
from harness.drivers.launcher import LocalLauncher, RankFailed
from harness.drivers.trajectory import actions_for
from harness.measure.clock import now
from harness.measure.events import ChunkEvent, SessionStart
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
    One report per stall: printed at once, and kept (with its full length) for the summary."""

    def __init__(self, bound_s: float, session: int, epoch: int, sink: list[dict]) -> None:
        self.bound_s, self.session, self.epoch, self.sink = bound_s, session, epoch, sink
        self.since = time.monotonic()
        self.current: dict | None = None

    def idle(self, stage: str, chunk: int) -> None:
        waited = time.monotonic() - self.since
        if self.current is None and waited >= self.bound_s:
            self.current = {"session": self.session, "epoch": self.epoch, "chunk": chunk, "stage": stage,
                            "reported_after_s": round(waited, 3), "bound_s": self.bound_s, "lasted_s": None}
            self.sink.append(self.current)
            print(f"stall: {stage} made no progress for {waited:.1f} s (session {self.session}, chunk {chunk}); "
                  f"still waiting", file=sys.stderr, flush=True)

    def progress(self) -> None:
        if self.current is not None:
            self.current["lasted_s"] = round(time.monotonic() - self.since, 3)
            self.current = None
        self.since = time.monotonic()


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

    def close(self) -> None:
        self._io.shutdown(wait=True)

    # ---- one session ---------------------------------------------------------------------
    def run_session(self, session: int, epoch: int, seed: int, chunks: int | None = None,
                    control: "SessionControl | None" = None) -> SessionResult:
        cfg, L = self.cfg, self.launcher
        ctl = control or SessionControl()
        n = chunks or cfg.video.chunks_per_session
        case_e = cfg.runtime.scheduler == "case-e"
        max_dec = cfg.runtime.max_pending_decodes
        save = epoch in cfg.runtime.save_epochs
        timeout = cfg.runtime.rank_timeout_s
        actions = ctl.actions or (lambda c: actions_for(seed, c, cfg.video.frames_per_chunk))

        start_ns = now()
        start_msg = M.StartSession(session=session, epoch=epoch, seed=seed, prompt=ctl.prompt or f"session {session}",
                                   image_seed=seed)
        L.send(L.lead("encoder"), M.OpenSession(session=session, epoch=epoch))
        L.fanout("dit", start_msg)
        L.fanout("vae", start_msg)

        stamps: list[dict] = [dict() for _ in range(n)]
        extra: list[dict] = [{"gpu_ms": {}, "blocked_ns": {}, "frames": 0} for _ in range(n)]
        hashes: list[dict] = [{} for _ in range(n)]
        frame_sha: dict[int, list[str]] = {}
        next_chunk, dit_busy, done = 0, False, 0
        waiting: deque[tuple[int, M.LatentReady]] = deque()
        decoding: deque[int] = deque()
        frames_back = 0  # chunks whose frames reached host memory
        cancelled = False

        def may_submit() -> bool:
            if cancelled or dit_busy or next_chunk >= n:
                return False
            if case_e:
                return not waiting
            return frames_back == next_chunk  # Case D: previous chunk is cpu_ready

        deadline = time.monotonic() + timeout
        watch = StallWatch(cfg.runtime.stall_report_s, session, epoch, self.stalls)
        while done < (next_chunk if cancelled else n):
            if not cancelled and ctl.should_cancel is not None and ctl.should_cancel(start_ns, stamps):
                # In-flight work is finished and discarded; nothing new starts.
                cancelled = True
                done += len(waiting)
                waiting.clear()
                continue
            if may_submit():
                c = next_chunk
                acts = actions(c)
                stamps[c]["submit"] = now()
                L.fanout("dit", M.GenerateChunk(session=session, chunk=c, actions=acts))
                next_chunk, dit_busy = c + 1, True
                watch.progress()  # the wait for a client's actions is not a stage's stall
            while waiting and len(decoding) < max_dec:
                c, lat = waiting.popleft()
                stamps[c]["decode_submit"] = now()
                L.fanout("vae", M.DecodeChunk(session=session, epoch=epoch, chunk=c, latent=lat.latent))
                decoding.append(c)
                self._io.submit(self._keep_latent, epoch, c, lat.latent, save, hashes[c])
            if may_submit():
                continue
            wait_s = ctl.poll_s if ctl.should_cancel is not None and not cancelled else 1.0
            msgs = L.poll(min(wait_s, max(0.0, deadline - time.monotonic())))
            if not msgs and time.monotonic() > deadline:
                raise RankFailed(f"session {session}: no progress for {timeout:.0f} s ({done} of {n} chunks done)")
            if not msgs:
                stage, chunk = ("dit", next_chunk - 1) if dit_busy else ("vae", decoding[0]) if decoding else ("encoder", done)
                watch.idle(stage, chunk)
            for proc, msg in msgs:
                deadline = time.monotonic() + timeout
                watch.progress()
                if isinstance(msg, M.LatentReady):
                    t = now()
                    s = stamps[msg.chunk]
                    s.update(dit_start=msg.dit_start, dit_end=msg.dit_end, latent_ready=t)
                    extra[msg.chunk]["gpu_ms"].update({f"dit_{k}" if k != "dit" else k: v for k, v in msg.gpu_ms.items()})
                    dit_busy = False
                    if cancelled:
                        done += 1  # finished, discarded: never decoded
                    else:
                        waiting.append((msg.chunk, msg))
                elif isinstance(msg, M.FramesReady):
                    s = stamps[msg.chunk]
                    s.update(decode_start=msg.decode_start, decode_end=msg.decode_end, gpu_ready=msg.gpu_ready, cpu_ready=msg.cpu_ready)
                    extra[msg.chunk]["gpu_ms"].update(msg.gpu_ms)
                    extra[msg.chunk]["blocked_ns"].update(msg.blocked_ns)
                    extra[msg.chunk]["frames"] = msg.frames
                    decoding.popleft()
                    frames_back += 1
                    # a cancelled session's frames only free their slot; nothing is encoded
                    L.send(L.lead("encoder"), M.EncodeChunk(frames=msg, save_pixels=save and not cancelled, discard=cancelled))
                elif isinstance(msg, M.ChunkDelivered):
                    s = stamps[msg.chunk]
                    s.update({k: v for k, v in (("received", msg.received), ("encoded", msg.encoded),
                                                ("delivered", msg.delivered)) if v is not None})
                    extra[msg.chunk]["blocked_ns"].update({k: v for k, v in msg.blocked_ns.items() if v})
                    if msg.encoded is not None:
                        hashes[msg.chunk]["pixels_sha256"] = msg.pixel_sha256
                        frame_sha[msg.chunk] = msg.frame_sha256
                    done += 1
                    if self.on_chunk:
                        self.on_chunk(self._event(session, epoch, msg.chunk, stamps, extra, cancelled), msg)
                else:
                    raise RankFailed(f"unexpected {type(msg).__name__} from {proc.name} in session {session}")
            if msgs:
                watch.progress()  # on_chunk may have waited on a client: that is not a stage's stall

        media, kv, ring_free = self._end_session(session, discard=cancelled and not ctl.keep_partial_media)
        self._io.submit(lambda: None).result()  # latent saves/hashes of this session are done
        m = next_chunk if cancelled else n
        events = [self._event(session, epoch, c, stamps, extra, cancelled) for c in range(m)]
        if cancelled and self.on_chunk:  # chunks that never reached the encoder still get their row
            for c in range(m):
                if "received" not in stamps[c]:
                    self.on_chunk(events[c], None)
        records = [] if cancelled else [dict(epoch=epoch, session=session, chunk=c, **hashes[c]) for c in range(n)]
        start = SessionStart(session=session, epoch=epoch, start_ns=start_ns, cancelled=cancelled)
        return SessionResult(start, events, [h for c in range(m) for h in frame_sha.get(c, [])], records, media, kv,
                             ring_free, cancelled)

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
            from harness.measure.gates import save_latent

            save_latent(self.run_dir, epoch, chunk, latent.array())

    @staticmethod
    def _event(session: int, epoch: int, chunk: int, stamps: list[dict], extra: list[dict], cancelled: bool = False) -> ChunkEvent:
        e = extra[chunk]
        return ChunkEvent(session=session, epoch=epoch, chunk=chunk, frames=e["frames"], gpu_ms=dict(e["gpu_ms"]),
                          blocked_ns=dict(e["blocked_ns"]), cancelled=cancelled, **stamps[chunk])

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

