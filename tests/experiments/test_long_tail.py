"""Long-tail protocol: the slowest-sample breakdown on hand-built event tables, and its plumbing."""

from __future__ import annotations

import re

import pytest

from harness.config import load_preset, override
from harness.errors import HarnessError
from harness.experiments import serve
from harness.measure import figures as F
from harness.measure import metrics as M
from harness.measure import stages
from harness.measure import tails

def test_slowest_samples_name_the_stage_that_grew_and_where_the_delay_entered(tables):
    NOMINAL, GAP = tables.NOMINAL, tables.GAP
    events, starts = tables.case_d({
        0: {6: {"decode": 500}},            # warm-up: never counted
        1: {2: {"dit": 400}},               # outside the steady window (chunks 5-8): never counted
        2: {6: {"decode": 50}, 8: {"gap": 20}},
        3: {7: {"dit": 30}, 5: {"encode": 25}},
    })
    slow = tails.slowest_samples(events, starts, M.DEFAULT_WINDOW, "cpu_ready", k=3)
    assert [(s.epoch, s.chunk) for s in slow] == [(2, 6), (3, 7), (2, 8)]
    assert [s.rank for s in slow] == [1, 2, 3]
    first, second, third = slow
    nominal_interval = GAP + sum(NOMINAL[n] for n in stages.STAGE_NAMES[:8])  # gap + submit → cpu_ready
    assert first.median_ms == pytest.approx(nominal_interval)
    assert first.interval_ms == pytest.approx(nominal_interval + 50) and first.excess_ms == pytest.approx(50)
    assert first.grew == "decode" and first.stages["decode"].excess_ms == pytest.approx(50)
    assert first.stages["dit"].excess_ms == pytest.approx(0)
    assert first.first_late == "decode_end"  # every boundary before it kept its cadence
    assert first.boundaries["decode_start"].excess_ms == pytest.approx(0)
    assert first.boundaries["decode_end"].excess_ms == pytest.approx(50)
    assert second.grew == "dit" and second.first_late == "dit_end"
    assert third.grew == "gap" and third.first_late == "submit"
    assert third.stages["gap"].ms == pytest.approx(GAP + 20)
    assert tails.culprit_counts(slow) == {"dit": 1, "decode": 1, "gap": 1}


def test_first_late_ignores_a_delay_inherited_from_the_previous_chunk(tables):
    # Closed loop: chunk 5's slow decode makes chunk 6 submitted 50 ms late, so chunk 6's intervals
    # B(6) − B(5) up to decode_start carry +50 ms that chunk 6 did not cause; its own delay is the DiT.
    events, starts = tables.case_d({2: {5: {"decode": 50}, 6: {"dit": 30}}})
    s = {(x.epoch, x.chunk): x for x in tails.slowest_samples(events, starts, reference="cpu_ready", k=2)}[(2, 6)]
    assert s.excess_ms == pytest.approx(30) and s.grew == "dit"
    assert s.boundaries["submit"].excess_ms == pytest.approx(50)  # inherited
    assert s.lateness["submit"].excess_ms == pytest.approx(0) and s.lateness["dit_end"].excess_ms == pytest.approx(30)
    assert s.first_late == "dit_end"


def test_first_late_threshold_is_inclusive():
    x = lambda ms: tails.Excess(ms, 0.0, ms)
    late = {"submit": x(4.0), "dit_end": x(5.0), "cpu_ready": x(10.0)}
    assert tails.first_late(late, 10.0) == "dit_end"  # exactly LATE_FRACTION of the excess counts as late
    assert tails.first_late({"submit": x(4.0), "cpu_ready": x(10.0)}, 10.0) == "cpu_ready"
    assert tails.first_late(late, 0.0) is None


def test_an_encode_stall_is_invisible_at_cpu_ready_but_named_at_delivered(tables):
    events, starts = tables.case_d({2: {6: {"encode": 40}}})
    at_cpu = tails.slowest_samples(events, starts, reference="cpu_ready", k=1)
    assert at_cpu[0].excess_ms == pytest.approx(0)  # Case D: encoding is off the cpu_ready path
    assert at_cpu[0].grew is None and at_cpu[0].first_late is None
    at_delivered = tails.slowest_samples(events, starts, reference="delivered", k=1)[0]
    assert (at_delivered.epoch, at_delivered.chunk) == (2, 6)
    assert at_delivered.grew == "encode" and at_delivered.first_late == "encoded"


def test_ties_are_broken_by_run_order_and_k_bounds_the_list(tables):
    events, starts = tables.case_d({})
    slow = tails.slowest_samples(events, starts, k=5)
    assert [(s.epoch, s.chunk) for s in slow] == [(1, 5), (1, 6), (1, 7), (1, 8), (2, 5)]
    assert tails.slowest_samples(events, starts, k=0) == []
    assert tails.slowest_samples([], [], k=3) == []


def test_tail_summary_percentiles_and_flags(tables):
    events, starts = tables.case_d({2: {6: {"decode": 50}}})
    t = tails.tail_summary(events, starts, k=2, n_boot=200)
    assert set(t.boundaries) == {"cpu_ready", "encoded", "delivered"}
    b = t.boundaries["cpu_ready"]
    assert b.n == 12 and b.n_sessions == 3
    p = {x.p: x for x in b.percentiles}
    assert p[99].is_max and p[99].ms == pytest.approx(b.max_ms)  # 12 samples cannot resolve a P99
    assert not p[50].is_max and p[50].low_ms <= p[50].ms <= p[50].high_ms
    assert len(t.slowest) == 2 and t.culprits == {"decode": 1}


def test_window_for_short_sessions():
    assert M.window_for(10) == M.DEFAULT_WINDOW
    assert M.window_for(12) == M.DEFAULT_WINDOW
    assert (M.window_for(7).first_chunk, M.window_for(7).last_chunk) == (5, 6)
    assert (M.window_for(3).first_chunk, M.window_for(3).last_chunk) == (2, 2)
    assert M.window_for(1) == M.DEFAULT_WINDOW  # no interval exists: every slot reported missing


def test_protocol_sessions_and_summary_extra(tables):
    cfg = load_preset("tiny")
    assert serve.protocol_for("timing", cfg).sessions == cfg.runtime.sessions
    lt = serve.protocol_for("long-tail", cfg)
    assert lt.sessions == 251 and lt.measured_sessions == 250 and lt.slowest == tails.DEFAULT_SLOWEST
    assert serve.protocol_for("long-tail", cfg, sessions=4).sessions == 4
    with pytest.raises(HarnessError, match="no measured sessions|has none"):
        serve.protocol_for("long-tail", cfg, sessions=1)
    with pytest.raises(HarnessError, match="unknown protocol"):
        serve.protocol_for("soak", cfg)
    short = serve.protocol_for("long-tail", override(cfg, video={"chunks_per_session": 7}), sessions=3)
    assert (short.window_first_chunk, short.window_last_chunk) == (5, 6)
    assert serve.summary_extra(serve.protocol_for("timing", cfg)) is None
    events, starts = tables.case_d({2: {6: {"decode": 50}}})
    extra = serve.summary_extra(lt)(events, starts, M.DEFAULT_WINDOW)
    assert extra["long_tail"]["slowest"][0]["grew"] == "decode"
    lines = serve.protocol_lines(extra)
    # two tables headed by measure.figures labels; the slowest sample's row says decode grew
    heads = [re.split(r"\s{2,}", l.strip()) for l in lines if l.strip().startswith(("boundary ", "# "))]
    assert len(heads) == 2 and all(F.resolve(h) for head in heads for h in head)
    slow = lines.index(next(l for l in lines if l.strip().startswith("# ")))
    first = re.split(r"\s{2,}", lines[slow + 1].strip())
    assert dict(zip(heads[1], first))[F.label("slow_grew")] == "decode" and first[:3] == ["1", "2", "6"]
    assert lines[-2] == f"  {F.label('culprits')}: decode 1"
    # and the time slices (25 sessions each): this table's measured sessions make one, not drifted
    assert [x["drifted"] for x in extra["slices"]["slices"]] == [False]
    assert lines[-1].startswith(f"  {F.label('slice_p50')} per 25 sessions")
