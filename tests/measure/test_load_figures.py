"""The pure parts of ``load`` and ``sweep``: arrival processes, SLO, goodput's interval, LoadGen-style
early stopping, time slices' drift flag and the Pareto front — on synthetic data."""

from __future__ import annotations

import numpy as np
import pytest

from harness.measure import arrivals as A
from harness.measure.goodput import LoadRecord, Slo, early_stop, goodput, load_summary, meets, parse_slo
from harness.measure.pareto import pareto_front
from harness.measure.slices import parse_slice, slices


def test_poisson_offsets_are_fixed_by_the_seed_and_bounded():
    spec = A.parse_arrivals("poisson:30")
    a, b = A.offsets(spec, 7, 600.0, None), A.offsets(spec, 7, 600.0, None)
    assert a == b and a != A.offsets(spec, 8, 600.0, None)
    assert all(x < y for x, y in zip(a, a[1:])) and a[-1] < 600.0
    gaps = np.diff([0.0, *a])
    assert 1.5 < gaps.mean() < 2.5  # 30 per minute: mean gap 2 s (≈ 300 gaps)
    assert len(A.offsets(spec, 7, None, 5)) == 5


def test_burst_and_trace_offsets():
    assert A.offsets(A.parse_arrivals("burst:3@10"), 0, 25.0, None) == [0, 0, 0, 10, 10, 10, 20, 20, 20]
    assert A.offsets(A.parse_arrivals("burst:2@5"), 0, None, 3) == [0, 0, 5]
    spec = A.parse_arrivals("trace:x.csv", "t,who\n3.5,a\n1,b\n", ".csv")
    assert spec.trace == (1.0, 3.5) and A.offsets(spec, 0, 2.0, None) == [1.0]
    assert A.parse_arrivals("trace:x.jsonl", '{"t": 2}\n0.5\n', ".jsonl").trace == (0.5, 2.0)


@pytest.mark.parametrize("text", ["poisson:-1", "poisson:abc", "burst:0@5", "burst:3", "uniform:3", "poisson"])
def test_bad_arrival_specs_are_refused(text):
    with pytest.raises(ValueError):
        A.parse_arrivals(text)


def test_an_unbounded_process_is_refused():
    with pytest.raises(ValueError, match="bound it"):
        A.offsets(A.parse_arrivals("poisson:3"), 0, None, None)


def _rec(i, outcome="served", ttfc=1000.0, cont=1.0, **kw) -> LoadRecord:
    r = LoadRecord(index=i, seed=i, planned_s=float(i), arrived_ns=i * 10**9, end_ns=i * 10**9 + 5 * 10**9,
                   outcome=outcome, ttfc_ms=ttfc if outcome == "served" else None,
                   continuous_ratio=cont if outcome == "served" else None, **kw)
    r.meets_slo = meets(r, SLO)
    return r


SLO = Slo(2.0, 0.95)


def test_slo_parsing_and_meeting():
    assert parse_slo("ttfc=1.5,play=0.9") == Slo(1.5, 0.9)
    for bad in ("ttfc=1", "ttfc=1,play=2", "ttfc=x,play=1", "foo=1,play=1"):
        with pytest.raises(ValueError):
            parse_slo(bad)
    assert _rec(0).meets_slo and not _rec(1, ttfc=2500.0).meets_slo and not _rec(2, cont=0.5).meets_slo
    assert not _rec(3, outcome="refused").meets_slo


def test_goodput_is_the_meeting_share_times_the_arrival_rate_with_its_interval():
    g = goodput(6, 10, 60.0)
    assert g.per_min == pytest.approx(6.0) and g.low < 6.0 < g.high and g.low > 0 and g.high < 10.0
    assert goodput(0, 10, 60.0).low == 0.0 and goodput(10, 10, 60.0).high == pytest.approx(10.0)
    s = load_summary([_rec(0), _rec(1, outcome="refused"), _rec(2, ttfc=3000.0)], SLO, "t", "poisson:1", 1.0)
    assert s.outcomes == {"served": 2, "refused": 1, "queue_timeout": 0, "failed": 0}
    assert s.meeting_slo == 1 and s.refused_share == pytest.approx(1 / 3) and s.span_s == pytest.approx(7.0)
    assert s.goodput.per_min == pytest.approx(60 / 7)


def test_early_stopping_decides_a_clear_series_and_not_an_ambiguous_one():
    # LoadGen's bound with no misses at P = 0.9, c = 0.99: n ≥ ceil(log 0.01 / log 0.9) = 44
    assert early_stop(43, 0, 0.9).decided is None and early_stop(44, 0, 0.9).decided == "met"
    assert early_stop(2, 2, 0.9).decided == "missed"  # 0.1² = 0.01
    assert early_stop(20, 2, 0.9).decided is None
    # a synthetic series of a server that serves about half its sessions: "≥ 90 %" is decided missed early
    rng = np.random.default_rng(0)
    misses = np.cumsum(rng.random(200) < 0.5)
    first = next(n for n in range(1, 201) if early_stop(n, int(misses[n - 1]), 0.9).decided)
    assert early_stop(first, int(misses[first - 1]), 0.9).decided == "missed" and first < 20


def _series(drift: float, n: int = 24, per: int = 6) -> tuple[list[float], list[list[float]]]:
    rng = np.random.default_rng(1)
    return ([float(i) for i in range(n)],
            [list(1000 + drift * i + rng.normal(0, 20, per)) for i in range(n)])


def test_a_drifting_series_is_flagged_and_a_stationary_one_is_not():
    spec = parse_slice("sessions:6")
    still = slices(*_series(0.0), spec)
    assert len(still.slices) == 4 and still.drifted == []
    moving = slices(*_series(15.0), spec)  # +15 ms per session: +360 ms over the run
    assert moving.drifted == [0, 3]
    assert moving.slices[0].p50_ms < moving.run_low_ms and moving.slices[3].p50_ms > moving.run_high_ms


def test_time_slices_and_bad_slice_specs():
    offs, vals = _series(0.0, n=6)
    assert [(s.first_session, s.last_session) for s in slices(offs, vals, parse_slice("seconds:2.5")).slices] == [(0, 2), (3, 4), (5, 5)]
    for bad in ("sessions:0", "sessions:1.5", "minutes:3", "seconds:-1"):
        with pytest.raises(ValueError):
            parse_slice(bad)


def test_pareto_front_marks_the_points_no_other_dominates():
    pts = [(1.0, 5.0), (2.0, 8.0), (3.0, 7.0), (2.0, 8.0), (0.5, 1.0), (None, 9.0), (4.0, 9.0)]
    assert pareto_front(pts) == [0, 1, 3, 4, 6]  # (3, 7) is dominated by (2, 8); None is not comparable
    assert pareto_front([]) == []
