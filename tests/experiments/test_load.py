"""``load`` and ``sweep`` against one real tiny server (capacity as the server states it): every
arrival ends with an outcome, early stopping ends the arrivals once the SLO share is decided, the
run directory passes the contract checks, and a two-rate sweep writes its table and Pareto plot."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from harness.cli import main
from harness.experiments import load_sessions as S
from harness.experiments import sweep as SW
from harness.experiments.scenario import ServerProcess
from harness.measure.events import read_run, validate_events
from harness.measure.goodput import OUTCOMES, LoadRecord, Slo
from harness.measure.summary import read_summary
from harness.serving import client as C
from harness.serving import omni_client as OC

from helpers.presets import ONE_RANK_EACH


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(["--preset", "tiny", *ONE_RANK_EACH], tmp_path_factory.mktemp("load") / "server")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def burst(server, tmp_path_factory):
    """Three sessions at once, an SLO nobody meets (TTFC ≤ 1 ms) and --early-stop 0.9: the second
    burst (300 s later) must never come, because two misses already decide 'share ≥ 0.9' missed."""
    out = tmp_path_factory.mktemp("load") / "burst"
    rc = main(["load", "--connect", server.url, "--arrivals", "burst:3@300", "--sessions", "6", "--chunks", "2",
               "--slo", "ttfc=0.001,play=0.5", "--early-stop", "0.9", "--slice", "sessions:2", "--out", str(out)])
    return rc, out


def _records(out) -> list[LoadRecord]:
    return [msgspec.json.decode(line, type=LoadRecord) for line in (out / "load.jsonl").read_bytes().splitlines()]


def test_every_arrival_ends_with_an_outcome_and_early_stopping_ends_the_arrivals(burst):
    rc, out = burst
    assert rc == 0
    recs = _records(out)
    assert [r.index for r in recs] == [0, 1, 2] and all(r.outcome in OUTCOMES for r in recs)
    assert sum(r.outcome == "served" for r in recs) >= 1 and not any(r.outcome == "failed" for r in recs)
    assert not any(r.meets_slo for r in recs)
    for r in recs:
        if r.outcome == "served":
            assert r.start_sent_ns <= r.started_ns < r.first_chunk_ns <= r.end_ns and r.chunks_delivered == 2
            assert r.queue_wait_ms is not None and r.ttfc_ms >= r.queue_wait_ms and r.continuous_ratio is not None
        else:
            assert r.chunks_delivered == 0 and r.error
    ld = read_summary(out / "summary.json").load
    assert ld.stopped_early and ld.early_stop.decided == "missed" and "decided" in ld.stop_reason
    assert ld.sessions == 3 and sum(ld.outcomes.values()) == 3 and ld.meeting_slo == 0 and ld.goodput.per_min == 0.0


def test_the_load_run_directory_passes_the_contract_checks(burst):
    _, out = burst
    man = json.loads((out / "manifest.json").read_text())
    assert man["status"] == "complete" and man["command"] and man["protocol"]["name"] == "load"
    assert man["arrivals"]["process"] == "burst:3@300" and man["slo"]["text"] == "ttfc=0.001,play=0.5"
    events, starts = read_run(out)
    assert validate_events(events, starts) == []
    served = {r.index for r in _records(out) if r.outcome == "served"}
    assert {e.session for e in events} == served and {s.session for s in starts} >= served
    assert all(e.delivered is not None for e in events)
    s = read_summary(out / "summary.json")
    assert s.status == "complete" and s.protocol == "load" and s.headline.boundary == "delivered"
    assert s.slices is not None and [sl.index for sl in s.slices.slices] == [0, 1]
    assert not (out / ".space-reserve").exists()


def test_sweep_over_two_rates_writes_the_table_and_the_pareto_plot(server, tmp_path):
    out = tmp_path / "sweep"
    rc = main(["sweep", "--connect", server.url, "--rates", "30,120", "--sessions", "1", "--chunks", "2",
               "--slo", "ttfc=600,play=0", "--out", str(out)])
    assert rc == 0
    rows = json.loads((out / "sweep.json").read_text())
    assert [r["rate_per_min"] for r in rows] == [30, 120] and all(r["status"] == "complete" for r in rows)
    # a CPU server through --connect: goodput per replica; per GPU is not known (and none is held)
    assert all(r["outcomes"]["served"] == 1 and r["goodput_per_replica"] > 0 and r["goodput_per_gpu"] is None for r in rows)
    assert any(r["pareto"] for r in rows)
    for r in rows:
        assert json.loads((out / "points" / r["name"] / "manifest.json").read_text())["status"] == "complete"
    md = (out / "sweep.md").read_text()
    assert md.count("| 0") == 2 and "goodput per replica" in md
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("device, per_gpu, axis", [("cuda", 2.5, "sweep_goodput_per_gpu"),
                                                   ("cpu", None, "sweep_goodput_per_replica")])
def test_goodput_per_gpu_only_where_the_server_held_gpus(tmp_path, device, per_gpu, axis):
    run = tmp_path / "point"
    (run / "server").mkdir(parents=True)
    (run / "server" / "manifest.json").write_text(json.dumps({"config": {"runtime": {"device": device}}}))
    p = SW.Point(name="p", rate_per_min=10, replicas=2, candidates=[], size=None)
    SW.fill(p, run, {"status": "complete", "load": {"goodput": {"per_min": 10.0, "low": 8.0, "high": 11.0}}}, 2)
    assert p.device == device and p.goodput_per_replica == 5.0 and p.goodput_per_gpu == per_gpu
    assert SW.y_figure([p]) == axis


# ---- how each API's session report becomes an outcome (no server needed) -------------------------
def _arrival():
    return S.Arrival(index=4, seed=9, planned_s=1.5, due_ns=10**9)


@pytest.mark.parametrize("outcome, error, want", [
    ("complete", "", "served"), ("busy", "server is busy with another session (capacity 1)", "refused"),
    ("busy", "timed out in the admission queue after 30 s", "queue_timeout"), ("queue_timeout", "not admitted", "queue_timeout"),
    ("error", "bad message", "failed"), ("closed", "code 1011", "failed"), ("cancelled", "", "failed")])
def test_a_harness_session_report_becomes_one_outcome(outcome, error, want):
    rep = C.SessionReport(seed=9, chunks=2, outcome=outcome, error=error, t_start_ns=2 * 10**9, t_end_ns=3 * 10**9)
    rec = S.harness_record(_arrival(), rep, Slo(2.0, 0.5))
    assert rec.outcome == want and rec.client_wait_ms == pytest.approx(1000.0) and not rec.meets_slo


def test_a_vllm_omni_session_becomes_a_record():
    chunks = [OC.ChunkRecord("media", n, 10, t - 5, t) for n, t in ((9, 3 * 10**9), (12, 4 * 10**9))]
    rec = OC.ClientSession(session=4, seed=9, chunks_asked=2, outcome="complete", start_sent_ns=2 * 10**9,
                           video_start_ns=2 * 10**9 + 10**6, done_ns=5 * 10**9, config={"fps": 16}, chunks=chunks)
    r = S.omni_record(_arrival(), rec, Slo(2.0, 0.5))
    assert r.outcome == "served" and r.ttfc_ms == pytest.approx(1000.0) and r.queue_wait_ms == pytest.approx(1.0)
    assert r.intervals_ms == [pytest.approx(1000.0)] and r.frames == 21 and r.meets_slo
    busy = OC.ClientSession(session=4, seed=9, chunks_asked=2, outcome="error", error="server is busy (capacity 1)",
                            start_sent_ns=2 * 10**9)
    assert S.omni_record(_arrival(), busy, Slo(2.0, 0.5)).outcome == "refused"


def test_a_session_that_never_ends_or_breaks_the_client_still_gets_an_outcome():
    async def never():
        await asyncio.Event().wait()

    async def broken():
        raise OSError("socket gone")

    hung, _ = asyncio.run(S.bounded(never(), _arrival(), Slo(2.0, 0.5), 0.01))
    assert hung.outcome == "failed" and "no end within" in hung.error
    bad, events = asyncio.run(S.bounded(broken(), _arrival(), Slo(2.0, 0.5), 5.0))
    assert bad.outcome == "failed" and bad.error == "OSError: socket gone" and events == []
