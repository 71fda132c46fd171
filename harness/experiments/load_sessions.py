"""One arriving session of ``load`` as a player of either API, and what it leaves: its
``LoadRecord`` (load.jsonl) and its chunk rows (events.jsonl, ``delivered`` at this client)."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec

from harness.measure.clock import now
from harness.measure.events import BOUNDARIES, ChunkEvent
from harness.measure.goodput import LoadRecord, Slo, meets, session_interval_p50
from harness.serving import client as C
from harness.serving import omni_client as OC

#: words of a ``busy`` refusal that say the session waited in the server's queue and timed out
#: there (a server with an admission queue: "no replica became free within the queue timeout");
#: any other ``busy`` is a refusal at once
_QUEUE_WORDS = ("queue", "timed out", "timeout")


class Arrival(msgspec.Struct, frozen=True):
    index: int
    seed: int
    planned_s: float
    due_ns: int


def _intervals_ms(receipts_ns: list[int]) -> list[float]:
    """The session's own cadence: every delivery interval from chunk 1 on, in ms."""
    return [(b - a) / 1e6 for a, b in zip(receipts_ns, receipts_ns[1:])]


def _record(a: Arrival, slo: Slo, **kw) -> LoadRecord:
    r = LoadRecord(index=a.index, seed=a.seed, planned_s=a.planned_s, arrived_ns=a.due_ns, **kw)
    if r.start_sent_ns is not None:
        r.client_wait_ms = (r.start_sent_ns - a.due_ns) / 1e6
        if r.started_ns is not None:
            r.queue_wait_ms = (r.started_ns - r.start_sent_ns) / 1e6
        if r.first_chunk_ns is not None:
            r.ttfc_ms = (r.first_chunk_ns - r.start_sent_ns) / 1e6
    r.interval_p50_ms = session_interval_p50(r.intervals_ms)
    r.meets_slo = meets(r, slo)
    return r


def harness_outcome(rep: C.SessionReport) -> str:
    if rep.outcome == "complete":
        return "served"
    if rep.outcome == "busy":
        return "queue_timeout" if any(w in rep.error.lower() for w in _QUEUE_WORDS) else "refused"
    return "queue_timeout" if rep.outcome == "queue_timeout" else "failed"


def harness_record(a: Arrival, rep: C.SessionReport, slo: Slo) -> LoadRecord:
    p = rep.play
    return _record(a, slo, start_sent_ns=rep.t_start_ns or None, started_ns=rep.t_started_ns,
                   first_chunk_ns=rep.t_first_media_ns, end_ns=rep.t_end_ns or now(), outcome=harness_outcome(rep),
                   error=rep.error, session=rep.session, replica=getattr(rep.started, "replica", None),
                   chunks=rep.chunks, chunks_delivered=len(rep.headers),
                   frames=sum(h.frames for h in rep.headers), intervals_ms=_intervals_ms(rep.receipts_ns),
                   underruns=p.underruns if p else 0, stall_ms=p.stall_ms if p else 0.0,
                   continuous_ratio=p.continuous_ratio if p else None)


def harness_events(a: Arrival, rep: C.SessionReport, outcome: str) -> list[ChunkEvent]:
    """The admitted session's chunks; the server's boundaries only on one host clock (``same_clock``)."""
    if rep.started is None:
        return []
    same = rep.started.same_clock
    return [ChunkEvent(session=a.index, epoch=a.index + 1, chunk=h.chunk, frames=h.frames, delivered=t,
                       cancelled=outcome != "served",
                       **({b: v for b, v in h.event.items() if b in BOUNDARIES and b != "delivered"} if same else {}))
            for h, t in zip(rep.headers, rep.receipts_ns)]


async def harness_session(a: Arrival, url: str, preset: str, chunks: int | None, slo: Slo, queue_timeout_s: float,
                          http: aiohttp.ClientSession) -> tuple[LoadRecord, list[ChunkEvent]]:
    opts = C.ViewerOptions(start_timeout_s=queue_timeout_s, receive_timeout_s=max(queue_timeout_s, 60.0))
    rep = await C.run_session(url, preset=preset, seed=a.seed, chunks=chunks, opts=opts, http=http)
    rec = harness_record(a, rep, slo)
    return rec, harness_events(a, rep, rec.outcome)


def omni_record(a: Arrival, rec: OC.ClientSession, slo: Slo) -> LoadRecord:
    media = [c for c in rec.chunks if c.kind == "media"]
    fps = int(rec.config.get("fps") or 16)
    arrivals = [(c.num_frames, c.last_byte_ns) for c in media]
    p = C.playout(arrivals, fps, media[0].num_frames if media else 1, rec.start_sent_ns)
    refused = rec.outcome == "error" and rec.video_start_ns is None and "busy" in rec.error.lower()
    outcome = "served" if rec.outcome == "complete" else "refused" if refused else "failed"
    return _record(a, slo, start_sent_ns=rec.start_sent_ns or None, started_ns=rec.video_start_ns,
                   first_chunk_ns=media[0].last_byte_ns if media else None, end_ns=rec.done_ns or now(),
                   outcome=outcome, error=rec.error, session=a.index, chunks=rec.chunks_asked,
                   chunks_delivered=len(media), frames=sum(c.num_frames for c in media),
                   intervals_ms=_intervals_ms([c.last_byte_ns for c in media]), underruns=p.underruns,
                   stall_ms=p.stall_ms, continuous_ratio=p.continuous_ratio)


async def omni_session(a: Arrival, url: str, chunks: int | None, slo: Slo, http: aiohttp.ClientSession,
                       host_boot: str) -> tuple[LoadRecord, list[ChunkEvent]]:
    w = OC.Workload(url=url, sessions=1, chunks=chunks or 10, seed=a.seed - a.index)
    rec, _media = await OC.run_session(w, a.index, http)
    out = omni_record(a, rec, slo)
    events = [msgspec.structs.replace(e, epoch=a.index + 1, cancelled=out.outcome != "served")
              for e in OC.chunk_events(rec, host_boot)] if rec.video_start_ns is not None else []
    return out, events


def ended_here(a: Arrival, slo: Slo, sent_ns: int, why: str) -> tuple[LoadRecord, list[ChunkEvent]]:
    """A session that did not end on its own (its bound passed, or the client itself failed): failed."""
    return _record(a, slo, start_sent_ns=sent_ns, end_ns=now(), outcome="failed", error=why), []


async def bounded(coro, a: Arrival, slo: Slo, limit_s: float) -> tuple[LoadRecord, list[ChunkEvent]]:
    """The session within ``limit_s``; whatever happens, an outcome (the connection is closed on the way out)."""
    sent = now()
    try:
        return await asyncio.wait_for(coro, limit_s)
    except asyncio.TimeoutError:
        return ended_here(a, slo, sent, f"no end within {limit_s:g} s of the start")
    except Exception as e:  # a fault of this client, not the server's answer: still this arrival's outcome
        return ended_here(a, slo, sent, C.W.one_line(f"{type(e).__name__}: {e}"))
