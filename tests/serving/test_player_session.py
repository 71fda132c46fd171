"""Player sessions: the server's side without a socket (receipts, the boundary rule, late events,
refusals), then one real ``serve --listen`` on the tiny preset driven by a player over loopback —
events applied exactly once, in order, none before it arrived, receipts two-phase, media intact —
and the ``client --player`` command line against it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import msgspec
import pytest

from harness.experiments.scenario.server_process import REPO_ROOT, ServerProcess
from harness.measure.events import ChunkEvent
from harness.measure.interaction import InteractionLog, invariants
from harness.serving import protocol as W
from harness.serving.client import ViewerOptions, first_frame_playout, playout, run_session, verify_media
from harness.serving.player import TraceEvent
from harness.serving.server import ListenOptions, StreamServer, StreamSession

from helpers.presets import ONE_RANK_EACH


class Conn:
    open, errors = True, 0

    def __init__(self) -> None:
        self.written: set[int] = set()
        self.sent: list = []
        self.session = None

    def post(self, item) -> None:
        self.sent.append(W.decode_server(item) if isinstance(item, str) else item)


def player_session(chunks: int = 3, mode: str = "player") -> tuple[Conn, StreamSession]:
    conn = Conn()
    sess = StreamSession(conn, W.Start(preset="tiny", seed=0, input=mode), chunks=chunks, frames_per_chunk=3, window=4,
                    action_timeout_s=1.0, stall_timeout_s=1.0)
    sess.index = 0
    return conn, sess


def _input(eid: str, keys="w") -> W.Input:
    return W.Input(event_id=eid, keys=keys, sent_ns=1)


def test_inputs_are_receipted_at_once_and_applied_latest_wins_at_the_boundary():
    conn, sess = player_session()
    assert sess.actions_for(0) == ["", "", ""]  # nothing arrived yet: no keys held
    assert sess.put_input(_input("a", "w")) is None and sess.put_input(_input("b", ["W", "j"])) is None
    queued = [m for m in conn.sent if isinstance(m, W.Queued)]
    assert [(q.event_id, q.late) for q in queued] == [("a", False), ("b", False)]
    assert all(q.received_ns > 0 for q in queued) and not any(isinstance(m, W.NeedActions) for m in conn.sent)
    assert sess.actions_for(1) == ["wj"] * 3  # the latest event wins, for every latent frame
    assert sess.actions_for(2) == ["wj"] * 3  # and is held across boundaries
    ids, boundary = sess.applied[1]
    assert ids == ["a", "b"] and boundary >= max(q.received_ns for q in queued) and sess.applied[2][0] == []
    # the header of chunk 1 names what its boundary applied
    sess._on_chunk(ChunkEvent(session=0, epoch=0, chunk=1, frames=12, encoded=1),
                   type("Msg", (), {"encoded": 1, "media": b"m", "pixel_sha256": "", "frame_sha256": []})())
    header = next(m for m in conn.sent if isinstance(m, W.ChunkHeader))
    assert header.applied == ["a", "b"] and header.boundary_ns == boundary


def test_inputs_after_the_last_boundary_are_late_and_ids_are_unique():
    conn, sess = player_session(chunks=2)
    sess.actions_for(0)
    assert sess.put_input(_input("a")) is None
    assert "already used" in sess.put_input(_input("a", "s"))
    assert "invalid key" in sess.put_input(_input("q", "x"))
    sess.actions_for(1)  # the last boundary
    assert sess.put_input(_input("z")) is None
    late = {m.event_id: m.late for m in conn.sent if isinstance(m, W.Queued)}
    assert late == {"a": False, "z": True} and sess.applied[1][0] == ["a"] and sess.inbox == []


def test_each_mode_refuses_the_others_messages():
    srv = StreamServer(ListenOptions())
    for mode, msg, refusal in (("script", W.Input(event_id="a", keys="w", sent_ns=0), "input in a script session"),
                               ("player", W.Actions(chunk=0, actions=["w"] * 3), "actions in a player session")):
        conn, sess = player_session(mode=mode)
        conn.session, sess.state = sess, "running"  # placed on a replica by the router
        srv._dispatch(conn, W.encode(msg))
        assert isinstance(conn.sent[-1], W.Error) and refusal in conn.sent[-1].message and conn.errors == 1


def test_first_frames_play_when_due_or_on_arrival_after_a_stall():
    """fps 16 (62.5 ms a frame), prebuffer 9: chunk 0 (9 frames, t = 0) plays 0-500 ms; chunk 1 (12
    frames) arrives at 1 s, past its 562.5 ms due time, and plays on arrival; chunk 2 arrives at
    1.2 s, before its due time 1 s + 12 × 62.5 ms, and waits for it."""
    arrivals = [(9, 0), (12, 1_000_000_000), (12, 1_200_000_000)]
    assert first_frame_playout(arrivals, 16, 9) == [0, 1_000_000_000, 1_750_000_000]
    stats = playout(arrivals, 16, 9, 0)
    assert (stats.underruns, stats.stall_ms, stats.startup_ms) == (1, 437.5, 0.0)
    assert first_frame_playout([], 16, 9) == []


# ---- over a real socket ---------------------------------------------------------------------------
#: three events at once, as the session starts, then a release: every one arrives while chunk 0
#: is generated (Case D: boundary 1 waits for chunk 0's frames, a DiT and a VAE pass away)
TRACE = (TraceEvent(0.0, "w", "a"), TraceEvent(0.0, "wj", "b"), TraceEvent(0.0, "l", "c"), TraceEvent(0.001, "", "d"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(["--preset", "tiny", "--scheduler", "case-d", *ONE_RANK_EACH], tmp_path_factory.mktemp("player") / "run")
    yield srv
    srv.stop()


def test_a_player_session_over_the_socket(server, tmp_path):
    rep = asyncio.run(run_session(server.url, preset="tiny", seed=3, chunks=3,
                                  opts=ViewerOptions(player=TRACE, out_dir=tmp_path)))
    assert rep.outcome == "complete", rep.error
    assert rep.started.input == "player" and rep.started.same_clock
    log = rep.interaction
    assert [e.event_id for e in log.events] == ["a", "b", "c", "d"]
    assert {name: problems for name, problems in invariants(log) if problems} == {}
    applied = [eid for h in rep.headers for eid in h.applied]
    # exactly once each, in the order sent; none late: the last boundary (2) comes two chunks' frames after start
    assert applied == ["a", "b", "c", "d"]
    assert [ids for ids in rep.ended.applied] == [h.applied for h in rep.headers]
    assert all(h.boundary_ns is not None and h.boundary_ns <= h.event["submit"] for h in rep.headers)
    assert rep.a2p.applied == 4 and rep.a2p.late == 0 and rep.a2p.delivery_ms["p50"] is not None
    assert verify_media(rep) is None


def test_client_command_line_prints_and_writes_action_to_photon(server, tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("t,keys\n0,w\n0,\n")
    host_port = server.url.split("//")[1].split("/")[0]
    r = subprocess.run([sys.executable, "-m", "harness", "client", "--connect", host_port, "--chunks", "2",
                        "--player", str(trace), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "A2P delivery P50 ms" in r.stdout and "boundary wait ms" in r.stdout
    rec = json.loads((tmp_path / "out" / "client.json").read_text())[0]
    assert rec["a2p"]["events"] == 2 and rec["a2p"]["applied"] + rec["a2p"]["late"] == 2
    assert [e["event_id"] for e in rec["interaction"]["events"]] == ["e0", "e1"]
    assert [e["event_id"] for e in rec["a2p_events"]] == ["e0", "e1"]
    assert all(e["late"] or e["delivery_ms"] > 0 for e in rec["a2p_events"])
    msgspec.json.decode(json.dumps(rec["interaction"]), type=InteractionLog)  # the records read back typed
