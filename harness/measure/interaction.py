"""Action-to-photon: how long after a player pressed a key the picture changed, from frozen records.

Two clocks meet here. *Client* stamps (``sent_ns``, ``queued_ns``, ``delivered_ns``, ``playout_ns``)
are the client's ``time.monotonic_ns()``; *server* stamps (``received_ns``, ``boundary_ns`` and the
chunk's ``latent_ready``/``cpu_ready``/``encoded``) are the server's. Action-to-photon itself is
client-only (sent → the applied chunk's first frame delivered, or played), so it holds across hosts.
Its decomposition crosses the clocks at the uplink (sent → received) and the transport (encoded →
delivered); those two parts are given only when both ends share one clock (same host, same boot
id: ``same_clock``) and are otherwise "not measured", never estimated.

Per applied event, with B its chunk's boundary::

    sent ─uplink→ received ─wait→ B ─generation→ latent_ready ─decode→ cpu_ready ─encode→ encoded
         ─transport→ delivered ─buffer→ playout

so the parts sum to delivery − sent (and, with the buffer, to playout − sent) event by event; the
decomposition is reported as means because means add up and medians do not.

The floor the cadence implies: an event lands at a uniformly random moment between two boundaries
``T`` apart, so it waits ``T/2`` on average, then rides one chunk's pipeline (boundary → delivered):
``floor = T/2 + P50(boundary → delivered)``, with ``T`` the median boundary interval.
"""

from __future__ import annotations

import msgspec

from harness.measure.stats import nearest_rank

MS = 1e6
PARTS = ("uplink", "wait", "generation", "decode", "encode", "transport", "buffer")


class EventRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One player event as the client saw it (and as the server's receipts said)."""

    event_id: str
    keys: str
    planned_ns: int  # client: when the trace said to send it
    sent_ns: int  # client
    queued_ns: int | None = None  # client: the ``queued`` receipt arrived
    received_ns: int | None = None  # server: the event arrived (from the receipt)
    late: bool = False  # arrived after the session's last boundary: no chunk is left to apply it


class ChunkRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One chunk of a player session: its boundary and the events applied at it (server), its
    first frame's delivery and playout (client)."""

    chunk: int
    applied: tuple[str, ...] = ()
    boundary_ns: int | None = None  # server: the driver took this chunk's actions
    latent_ready_ns: int | None = None
    cpu_ready_ns: int | None = None
    encoded_ns: int | None = None
    header_ns: int | None = None  # client: the chunk's header (which names the applied ids) read
    delivered_ns: int | None = None  # client: the chunk's media read (None: never delivered)
    playout_ns: int | None = None  # client: its first frame played, in the client's playout model


class InteractionLog(msgspec.Struct, frozen=True, kw_only=True):
    events: tuple[EventRecord, ...]
    chunks: tuple[ChunkRecord, ...]
    same_clock: bool = False


class A2PSummary(msgspec.Struct, frozen=True, kw_only=True):
    """The figures of one player session (``harness.measure.figures``: the ``a2p_*`` rows)."""

    events: int  # sent
    applied: int
    late: int
    delivery_ms: dict[str, float | None]  # "p50" / "p95" / "p99"
    playout_ms: dict[str, float | None]
    next_share: float | None  # 0..1
    parts_ms: dict[str, float | None]  # mean of each part over the applied, delivered events
    interval_ms: float | None  # median boundary interval T
    pipeline_ms: float | None  # median boundary → delivered
    floor_ms: float | None


class EventOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """One event, end to end: sent, queued, applied at chunk k, that chunk's first frame delivered and played."""

    event_id: str
    keys: str
    sent_ns: int  # client
    queued_ns: int | None  # client
    received_ns: int | None  # server
    late: bool
    chunk: int | None  # applied at (None: late, or never applied)
    boundary_ns: int | None  # server
    delivered_ns: int | None  # client
    playout_ns: int | None  # client
    delivery_ms: float | None  # action-to-photon at delivery
    playout_ms: float | None  # action-to-photon at playout


def outcomes(log: InteractionLog) -> list[EventOutcome]:
    """Every sent event joined with the (first) chunk that applied it."""
    where = applied_at(log)
    by_chunk = {c.chunk: c for c in log.chunks}
    out = []
    for e in log.events:
        c = by_chunk[where[e.event_id][0]] if e.event_id in where else ChunkRecord(chunk=-1)
        d, p = c.delivered_ns, c.playout_ns
        out.append(EventOutcome(event_id=e.event_id, keys=e.keys, sent_ns=e.sent_ns, queued_ns=e.queued_ns,
                                received_ns=e.received_ns, late=e.late, chunk=None if c.chunk < 0 else c.chunk,
                                boundary_ns=c.boundary_ns, delivered_ns=d, playout_ns=p,
                                delivery_ms=None if d is None else (d - e.sent_ns) / MS,
                                playout_ms=None if p is None else (p - e.sent_ns) / MS))
    return out


def applied_at(log: InteractionLog) -> dict[str, list[int]]:
    """Every event id the chunks name, with every chunk that names it (one, if the rule holds)."""
    out: dict[str, list[int]] = {}
    for c in log.chunks:
        for eid in c.applied:
            out.setdefault(eid, []).append(c.chunk)
    return out


def next_boundary(boundaries: list[int | None], t_ns: int) -> int | None:
    """The index of the first boundary at or after ``t_ns`` (None: none left)."""
    return next((i for i, b in enumerate(boundaries) if b is not None and b >= t_ns), None)


def percentiles_ms(values_ns: list[int]) -> dict[str, float | None]:
    return {f"p{p}": nearest_rank(values_ns, p) / MS if values_ns else None for p in (50, 95, 99)}


def _median_ms(values_ns: list[int]) -> float | None:
    return nearest_rank(values_ns, 50) / MS if values_ns else None


def event_parts(ev: EventRecord, ch: ChunkRecord, same_clock: bool) -> dict[str, int | None]:
    """The parts of one applied event's action-to-photon, in ns (None where a stamp is missing or
    the clocks differ)."""

    def span(a: int | None, b: int | None, ok: bool = True) -> int | None:
        return b - a if ok and a is not None and b is not None else None

    return {"uplink": span(ev.sent_ns, ev.received_ns, same_clock), "wait": span(ev.received_ns, ch.boundary_ns),
            "generation": span(ch.boundary_ns, ch.latent_ready_ns), "decode": span(ch.latent_ready_ns, ch.cpu_ready_ns),
            "encode": span(ch.cpu_ready_ns, ch.encoded_ns), "transport": span(ch.encoded_ns, ch.delivered_ns, same_clock),
            "buffer": span(ch.delivered_ns, ch.playout_ns)}


def _joined(log: InteractionLog) -> list[tuple[EventRecord, ChunkRecord]]:
    """Applied events with the (first) chunk that applied them."""
    where = applied_at(log)
    by_chunk = {c.chunk: c for c in log.chunks}
    return [(e, by_chunk[where[e.event_id][0]]) for e in log.events if e.event_id in where]


def floor_ms(boundaries: list[int | None], pipelines_ns: list[int]) -> tuple[float | None, float | None, float | None]:
    """(T, pipeline, floor) in ms: T the median interval between consecutive boundaries, pipeline
    the median boundary → delivered, floor = T/2 + pipeline."""
    gaps = [b - a for a, b in zip(boundaries, boundaries[1:]) if a is not None and b is not None]
    t, pipe = _median_ms(gaps), _median_ms(pipelines_ns)
    return t, pipe, (t / 2 + pipe if t is not None and pipe is not None else None)


def in_intervals(s: A2PSummary) -> float | None:
    """Action-to-photon P50 at delivery in boundary intervals: what a player waits, in chunks of
    cadence (the floor is 0.5 + pipeline ÷ T; under 1.5 only if a chunk is delivered within one
    interval of its boundary)."""
    p50 = s.delivery_ms.get("p50")
    return None if p50 is None or not s.interval_ms else p50 / s.interval_ms


def summarize(log: InteractionLog) -> A2PSummary:
    everywhere = _joined(log)
    joined = [(e, c) for e, c in everywhere if c.delivered_ns is not None]
    ordered = sorted(log.chunks, key=lambda c: c.chunk)
    boundaries = [c.boundary_ns for c in ordered]
    on_time = [e for e, c in everywhere if e.received_ns is not None
               and (k := next_boundary(boundaries, e.received_ns)) is not None and ordered[k].chunk == c.chunk]
    applied = len(applied_at(log))
    parts = [event_parts(e, c, log.same_clock) for e, c in joined]
    means = {}
    for name in PARTS:
        vals = [p[name] for p in parts if p[name] is not None]
        means[name] = sum(vals) / len(vals) / MS if vals and len(vals) == len(parts) else None
    pipes = [c.delivered_ns - c.boundary_ns for c in log.chunks if c.delivered_ns is not None and c.boundary_ns is not None]
    t, pipe, floor = floor_ms(boundaries, pipes)
    return A2PSummary(
        events=len(log.events), applied=applied, late=sum(e.late for e in log.events),
        delivery_ms=percentiles_ms([c.delivered_ns - e.sent_ns for e, c in joined]),
        playout_ms=percentiles_ms([c.playout_ns - e.sent_ns for e, c in joined if c.playout_ns is not None]),
        next_share=len(on_time) / applied if applied else None, parts_ms=means, interval_ms=t, pipeline_ms=pipe,
        floor_ms=floor)


def _applied_once(log: InteractionLog, where: dict[str, list[int]]) -> list[str]:
    sent = {e.event_id for e in log.events}
    out = [f"{eid} applied at chunks {cs}" for eid, cs in where.items() if len(cs) > 1]
    out += [f"{eid} applied but never sent" for eid in where if eid not in sent]
    out += [f"{e.event_id} neither applied nor answered late" for e in log.events if e.event_id not in where and not e.late]
    return out + [f"{e.event_id} answered late but applied at chunk {where[e.event_id]}" for e in log.events
                  if e.late and e.event_id in where]


def _in_order(log: InteractionLog, where: dict[str, list[int]]) -> list[str]:
    """The applied ids, chunk by chunk in arrival order, must be the sent events in send order."""
    sent = [e.event_id for e in log.events if e.event_id in where]
    applied = list(dict.fromkeys(eid for c in sorted(log.chunks, key=lambda c: c.chunk) for eid in c.applied))
    if applied == sent:
        return []
    k = next(i for i, (a, b) in enumerate(zip(applied + [None], sent + [None])) if a != b)
    return [f"applied order departs from the send order at event {k}: {applied[k:k + 3]} vs {sent[k:k + 3]}"]


def invariants(log: InteractionLog) -> list[tuple[str, list[str]]]:
    """The player session's invariants, each with its problems (none: it holds)."""
    where = applied_at(log)
    by_chunk = {c.chunk: c for c in log.chunks}
    chunk_of = {e.event_id: by_chunk[where[e.event_id][0]] for e in log.events if e.event_id in where}
    receipts = [f"{e.event_id}: no queued receipt" for e in log.events if e.queued_ns is None or e.received_ns is None]
    early = [f"{e.event_id} received at {e.received_ns} but applied at chunk {c.chunk} whose boundary is {c.boundary_ns}"
             for e in log.events if (c := chunk_of.get(e.event_id)) and e.received_ns is not None
             and c.boundary_ns is not None and c.boundary_ns < e.received_ns]
    early += [f"chunk {c.chunk} was delivered without its boundary time" for c in log.chunks
              if c.applied and c.delivered_ns is not None and c.boundary_ns is None]
    two_phase = [f"{e.event_id}: applied at chunk {c.chunk}, announced before its queued receipt" for e in log.events
                 if (c := chunk_of.get(e.event_id)) and e.queued_ns is not None and c.header_ns is not None
                 and c.header_ns < e.queued_ns]
    undelivered = [f"chunk {c.chunk} applied {len(c.applied)} events and was never delivered" for c in log.chunks
                   if c.applied and c.delivered_ns is None]
    return [("every event applied exactly once (or answered as arriving after the last boundary)", _applied_once(log, where)),
            ("every event got its queued receipt", receipts),
            ("receipts two-phase: queued, then applied at chunk k", two_phase),
            ("no event applied at a boundary before it arrived", early),
            ("events applied in the order they were sent", _in_order(log, where)),
            ("every chunk that applied an event was delivered", undelivered)]


# ---- the printed tables (columns: harness.measure.figures) ----------------------------------------
LATENCY_COLUMNS = ("a2p_events", "a2p_applied", "a2p_late", "a2p_delivery_p50", "a2p_delivery_p95", "a2p_delivery_p99",
                   "a2p_playout_p50", "a2p_playout_p95", "a2p_playout_p99", "a2p_next_share", "a2p_floor",
                   "a2p_delivery_intervals")
PARTS_COLUMNS = ("a2p_uplink", "a2p_wait", "a2p_generation", "a2p_decode", "a2p_encode", "a2p_transport", "a2p_buffer",
                 "a2p_parts_sum", "a2p_interval", "a2p_pipeline")


def parts_sum_ms(s: A2PSummary) -> float | None:
    """Σ of the mean parts: the mean action-to-photon at playout (None unless every part was measured)."""
    vals = [s.parts_ms.get(p) for p in PARTS]
    return None if any(v is None for v in vals) else sum(vals)


def _cell(v: float | None, digits: int = 1) -> str:
    return "not measured" if v is None else f"{v:.{digits}f}"


def latency_cells(s: A2PSummary) -> list[str]:
    return [str(s.events), str(s.applied), str(s.late), *(_cell(s.delivery_ms[f"p{p}"]) for p in (50, 95, 99)),
            *(_cell(s.playout_ms[f"p{p}"]) for p in (50, 95, 99)),
            _cell(None if s.next_share is None else 100 * s.next_share), _cell(s.floor_ms), _cell(in_intervals(s), 2)]


def parts_cells(s: A2PSummary) -> list[str]:
    return [*(_cell(s.parts_ms.get(p)) for p in PARTS), _cell(parts_sum_ms(s)), _cell(s.interval_ms), _cell(s.pipeline_ms)]
