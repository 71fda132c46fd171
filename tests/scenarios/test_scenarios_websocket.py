"""The scenarios over the network: one real ``python -m harness serve --listen 127.0.0.1:0``
subprocess (tiny preset, one ring slot, a window of one chunk) serves the slow-consumer, cancel and
bad-input scenarios and the bundled client's command line; the crash scenario launches its own
faulty servers. The last test stops the shared server and checks it left nothing behind."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from harness.drivers.procwatch import shm_names, wait_gone
from harness.experiments.scenario.bad_messages import bad_input_ws
from harness.experiments.scenario.cancel import cancel_ws, ended_of
from harness.experiments.scenario.crash import crash_ws
from harness.experiments.scenario.params import Params
from harness.experiments.scenario.server_process import REPO_ROOT, ServerProcess
from harness.experiments.scenario.slow_consumer import slow_consumer_ws
from harness.measure.events import read_events, read_sessions, validate_events
from harness.serving.client import status

SERVE_ARGS = ["--preset", "tiny", "--ring-slots", "1", "--window", "1"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(SERVE_ARGS, tmp_path_factory.mktemp("ws") / "run")
    srv.workers_at_start = srv.workers()
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def test_slow_consumer_over_websocket(server, tmp_path):
    rep = slow_consumer_ws(server.url, Params(chunks=4, rate=0.5, slow_sessions=2, workdir=tmp_path), server)
    print(rep.text())
    # rate comparisons are the scenario command's to judge (see the in-process test)
    assert rep.checks and not rep.correctness_failures, rep.correctness_failures
    assert len(rep.checks) - len(rep.rate_checks) >= 5  # window, exactly-once, ring, memory, blocked time


def test_cancel_and_disconnect_over_websocket(server, tmp_path):
    # Only points tied to protocol events: a wall-clock point ("cancel-mid-chunk0", 0.5 × TTFC)
    # can land after a short session ended when the box is loaded; the scenario command keeps it.
    points = ("cancel-right-after-start", "cancel-on-header0", "cancel-after-chunk0", "disconnect-right-after-start",
              "disconnect-mid-chunk1", "disconnect-mid-media", "actions-timeout", "cancel-after-last-chunk",
              "twice-1", "twice-2")
    rep = cancel_ws(server.url, Params(cancel_chunks=3, verify_chunks=1, points=points, workdir=tmp_path), server)
    print(rep.text())
    assert rep.ok, rep.failures
    assert {r[1] for r in rep.rows} == set(points)
    disconnected = [r for r in rep.rows if r[1].startswith("disconnect")]
    assert all(r[4] == "cancelled" and r[5] == "client disconnected" for r in disconnected)


def test_bad_network_messages(server, tmp_path):
    rep = bad_input_ws(server.url, Params(workdir=tmp_path))
    print(rep.text())
    assert rep.ok, rep.failures
    assert len(rep.rows) >= 15


def test_client_command_line_plays_verifies_and_disconnects(server, tmp_path):
    host_port = server.url.split("//")[1].split("/")[0]
    run = lambda *a: subprocess.run([sys.executable, "-m", "harness", "client", "--connect", host_port, *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    ok = run("--sessions", "2", "--chunks", "2", "--seed", "5", "--out", str(tmp_path / "c1"), "--verify")
    print(ok.stdout, ok.stderr)
    assert ok.returncode == 0, ok.stderr
    assert "decodes to the 21 frames sent" in ok.stdout
    report = json.loads((tmp_path / "c1" / "client.json").read_text())
    assert [r["outcome"] for r in report] == ["complete", "complete"]
    assert all(r["play"]["continuous_ratio"] is not None for r in report)
    assert sorted(p.name for p in (tmp_path / "c1").glob("*.mkv")) == sorted(f"session{r['session']}.mkv" for r in report)

    before = asyncio.run(status(server.url)).sessions_served
    gone = run("--chunks", "3", "--disconnect-after-chunk", "0", "--out", str(tmp_path / "c2"))
    print(gone.stdout, gone.stderr)
    assert gone.returncode == 0, gone.stderr
    assert not list((tmp_path / "c2").glob("*.mkv*"))  # nothing half-written left behind
    end = asyncio.run(ended_of(server.url, SimpleNamespace(ended=None, session=None), before,
                                 token=server.operator_token()))
    assert end is not None and end.cancelled and end.reason == "client disconnected"
    assert end.kv_blocks_used == 0 and end.ring_free == end.ring_slots and end.media_discarded


def test_shared_server_stops_clean_and_its_run_directory_is_valid(server):
    workers = server.workers()
    assert len(workers) == 5
    rc = server.stop()
    assert rc == 0, server.stderr()[-2000:]
    assert wait_gone(workers) == []
    assert shm_names(f"harness-{server.pid}-") == set()
    run = server.out
    man = json.loads((run / "manifest.json").read_text())
    assert man["status"] == "complete" and man["protocol"]["name"] == "websocket"
    events, sessions = read_events(run / "events.jsonl"), read_sessions(run / "sessions.jsonl")
    assert events and validate_events([e for e in events if e.frames > 0]) == []
    complete = {s.session for s in sessions if not s.cancelled}
    # every chunk of a completed session was acknowledged: delivered comes from the client
    assert all(e.delivered is not None and e.delivered >= e.encoded for e in events if e.session in complete)
    assert any(s.cancelled for s in sessions)


def test_crash_over_websocket(tmp_path):
    rep = crash_ws(["--preset", "tiny"], Params(ranks=("dit:1",), fault_chunk=2, workdir=tmp_path), tmp_path)
    print(rep.text())
    assert rep.ok, rep.failures
