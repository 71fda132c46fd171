"""Action-to-photon figures on hand-built records: percentiles (even and odd n), the decomposition
(its parts sum to the whole, event by event and in the mean), the next-boundary share, the floor,
and the invariants a player session is judged by."""

from __future__ import annotations

import msgspec
import pytest

from harness.measure import figures as F
from harness.measure import interaction as I
from harness.measure.interaction import ChunkRecord, EventRecord, InteractionLog

MS = 1_000_000


def _chunk(c: int, applied=(), boundary=None, **kw) -> ChunkRecord:
    """Chunk c: boundary at c·100 ms, latent +30, cpu_ready +70, encoded +80, header +84, media +85, played +105."""
    b = c * 100 * MS if boundary is None else boundary
    stamps = dict(latent_ready_ns=b + 30 * MS, cpu_ready_ns=b + 70 * MS, encoded_ns=b + 80 * MS, header_ns=b + 84 * MS,
                  delivered_ns=b + 85 * MS, playout_ns=b + 105 * MS)
    return ChunkRecord(chunk=c, applied=tuple(applied), boundary_ns=b, **{**stamps, **kw})


def _event(eid: str, sent_ms: float, **kw) -> EventRecord:
    sent = round(sent_ms * MS)
    base = dict(planned_ns=sent, sent_ns=sent, received_ns=sent + MS, queued_ns=sent + 2 * MS)
    return EventRecord(event_id=eid, keys="w", **{**base, **kw})


def good_log(same_clock: bool = True) -> InteractionLog:
    # events at 10, 40 ms (applied at chunk 1, boundary 100 ms) and 150 ms (chunk 2, boundary 200 ms)
    events = (_event("a", 10), _event("b", 40), _event("c", 150))
    chunks = (_chunk(0), _chunk(1, ("a", "b")), _chunk(2, ("c",)), _chunk(3))
    return InteractionLog(events=events, chunks=chunks, same_clock=same_clock)


def test_percentiles_are_nearest_rank_for_even_and_odd_n():
    assert I.percentiles_ms([4 * MS, 1 * MS, 3 * MS, 2 * MS]) == {"p50": 2.0, "p95": 4.0, "p99": 4.0}  # ceil(0.5·4) = 2nd
    assert I.percentiles_ms([5 * MS, 1 * MS, 4 * MS, 2 * MS, 3 * MS])["p50"] == 3.0  # ceil(0.5·5) = 3rd
    assert I.percentiles_ms([]) == {"p50": None, "p95": None, "p99": None}


def test_action_to_photon_at_delivery_and_playout():
    s = I.summarize(good_log())
    # delivery − sent: a 185 − 10 = 175, b 185 − 40 = 145, c 285 − 150 = 135 → sorted 135, 145, 175
    assert s.delivery_ms == {"p50": 145.0, "p95": 175.0, "p99": 175.0}
    assert s.playout_ms == {"p50": 165.0, "p95": 195.0, "p99": 195.0}  # +20 ms of buffer each
    assert (s.events, s.applied, s.late) == (3, 3, 0)


def test_the_parts_sum_to_the_whole_event_by_event_and_in_the_mean():
    log = good_log()
    by_chunk = {c.chunk: c for c in log.chunks}
    where = I.applied_at(log)
    totals = []
    for e in log.events:
        ch = by_chunk[where[e.event_id][0]]
        parts = I.event_parts(e, ch, same_clock=True)
        assert sum(parts.values()) == ch.playout_ns - e.sent_ns
        assert sum(v for k, v in parts.items() if k != "buffer") == ch.delivered_ns - e.sent_ns
        totals.append(ch.playout_ns - e.sent_ns)
    s = I.summarize(log)
    assert abs(I.parts_sum_ms(s) - sum(totals) / len(totals) / MS) < 1e-9
    assert abs(s.parts_ms["wait"] - (89 + 59 + 49) / 3) < 1e-9 and s.parts_ms["generation"] == 30.0  # received → boundary; B → latent
    assert s.parts_ms["transport"] == 5.0 and s.parts_ms["buffer"] == 20.0


def test_each_event_end_to_end():
    late = EventRecord(event_id="z", keys="", planned_ns=0, sent_ns=390 * MS, received_ns=391 * MS, queued_ns=392 * MS,
                       late=True)
    log = msgspec.structs.replace(good_log(), events=good_log().events + (late,))
    got = {o.event_id: o for o in I.outcomes(log)}
    assert (got["a"].chunk, got["a"].boundary_ns, got["a"].delivery_ms, got["a"].playout_ms) == (1, 100 * MS, 175.0, 195.0)
    assert got["c"].chunk == 2 and got["z"].late and got["z"].chunk is None and got["z"].delivery_ms is None


def test_parts_across_two_clocks_are_not_measured():
    s = I.summarize(good_log(same_clock=False))
    assert s.parts_ms["uplink"] is None and s.parts_ms["transport"] is None and I.parts_sum_ms(s) is None
    assert s.parts_ms["wait"] is not None and s.delivery_ms["p50"] == 145.0  # client-only figures still hold
    assert "not measured" in I.parts_cells(s)


def test_next_boundary_share_and_the_floor():
    assert I.next_boundary([0, 100, 200], 100) == 1 and I.next_boundary([0, 100, 200], 101) == 2
    assert I.next_boundary([0, 100], 101) is None
    s = I.summarize(good_log())
    assert s.next_share == 1.0
    # c arrived before boundary 2 but was applied at 3: one of three missed its next boundary
    late_apply = msgspec.structs.replace(good_log(), chunks=(_chunk(0), _chunk(1, ("a", "b")), _chunk(2), _chunk(3, ("c",))))
    assert abs(I.summarize(late_apply).next_share - 2 / 3) < 1e-12
    # boundaries 100 ms apart, boundary → delivered 85 ms: floor 50 + 85
    assert (s.interval_ms, s.pipeline_ms, s.floor_ms) == (100.0, 85.0, 135.0)
    assert I.floor_ms([None], []) == (None, None, None)


def test_a_good_log_breaks_no_invariant():
    assert all(not problems for _, problems in I.invariants(good_log()))
    late = EventRecord(event_id="z", keys="", planned_ns=390 * MS, sent_ns=390 * MS, received_ns=391 * MS,
                       queued_ns=392 * MS, late=True)
    log = msgspec.structs.replace(good_log(), events=good_log().events + (late,))
    assert all(not problems for _, problems in I.invariants(log))
    assert I.summarize(log).late == 1


def _broken(log: InteractionLog) -> dict[str, list[str]]:
    return {name: problems for name, problems in I.invariants(log) if problems}


def test_each_invariant_catches_its_fault():
    g = good_log()
    twice = msgspec.structs.replace(g, chunks=(_chunk(0), _chunk(1, ("a", "b")), _chunk(2, ("c", "a")), _chunk(3)))
    assert list(_broken(twice)) == ["every event applied exactly once (or answered as arriving after the last boundary)"]
    never = msgspec.structs.replace(g, chunks=(_chunk(0), _chunk(1, ("a",)), _chunk(2, ("c",)), _chunk(3)))
    assert "b neither applied nor answered late" in _broken(never)[I.invariants(g)[0][0]]
    early = msgspec.structs.replace(g, chunks=(_chunk(0, ("a", "b")), _chunk(1), _chunk(2, ("c",)), _chunk(3)))
    assert list(_broken(early)) == ["no event applied at a boundary before it arrived"]
    undelivered = msgspec.structs.replace(g, chunks=g.chunks[:2] + (ChunkRecord(chunk=2, applied=("c",)),) + g.chunks[3:])
    assert list(_broken(undelivered)) == ["every chunk that applied an event was delivered"]
    no_receipt = msgspec.structs.replace(g, events=(_event("a", 10, queued_ns=None, received_ns=None),) + g.events[1:])
    assert "every event got its queued receipt" in _broken(no_receipt)
    announced_first = msgspec.structs.replace(g, events=(_event("a", 10, queued_ns=190 * MS),) + g.events[1:])
    assert list(_broken(announced_first)) == ["receipts two-phase: queued, then applied at chunk k"]
    swapped = msgspec.structs.replace(g, events=(g.events[2], g.events[0], g.events[1]))
    assert list(_broken(swapped)) == ["events applied in the order they were sent"]


def test_every_summary_field_and_table_column_is_a_defined_figure():
    fields = {f.name for f in msgspec.structs.fields(I.A2PSummary)}
    assert fields <= F.summary_keys(), fields - F.summary_keys()
    for name in ("arm", *I.LATENCY_COLUMNS, *I.PARTS_COLUMNS):
        assert F.resolve(F.label(name)) is F.define(name)
    s = I.summarize(good_log())
    assert len(I.latency_cells(s)) == len(I.LATENCY_COLUMNS) and len(I.parts_cells(s)) == len(I.PARTS_COLUMNS)


def test_action_to_photon_in_intervals_is_the_delivery_p50_over_the_boundary_interval():
    def summary(p50: float | None, interval: float | None) -> I.A2PSummary:
        return I.A2PSummary(events=2, applied=2, late=0, delivery_ms={"p50": p50, "p95": p50, "p99": p50},
                            playout_ms={"p50": None, "p95": None, "p99": None}, next_share=1.0, parts_ms={},
                            interval_ms=interval, pipeline_ms=None, floor_ms=None)

    assert I.in_intervals(summary(3000.0, 2000.0)) == 1.5
    assert I.in_intervals(summary(4270.5, 2793.0)) == pytest.approx(1.529, abs=5e-4)  # batch 13's Case D
    assert I.in_intervals(summary(None, 2000.0)) is None and I.in_intervals(summary(3000.0, None)) is None
    assert I.latency_cells(summary(3000.0, 2000.0))[-1] == "1.50"
    assert I.latency_cells(summary(3000.0, None))[-1] == "not measured"
