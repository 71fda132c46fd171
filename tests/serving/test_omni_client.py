"""``client --api vllm-omni``: its messages, its event rows, its refusals, the gate on its pixels, and
one real measurement of the harness's own ``serve --listen --api vllm-omni`` (no vLLM needed),
whose run directory it must match row by row."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from harness.experiments.compare_servers import analyze
from harness.experiments.scenario.server_process import REPO_ROOT, ServerProcess
from harness.measure.events import BOUNDARIES, read_events, read_sessions, validate_events
from harness.measure.gates import HashRecord, gate, save_pixels, write_hashes
from harness.serving import omni_protocol as O
from harness.serving.omni_client import (ChunkRecord, ClientSession, Workload, camera_action_script, chunk_events,
                                         client_manifest, split_frames, start_message)
from harness.serving.protocol import boot_id

from helpers.presets import ONE_RANK_EACH

CHUNKS = 3


def test_session_start_is_productions_request():
    w = Workload(url="ws://h:1/v1/realtime/video", chunks=4, prompt="p", width=128, height=64)
    msg = json.loads(O.encode(start_message(w, seed=7)))
    assert msg["type"] == "session.start" and msg.get("format", O.FORMAT) == "m4s" and msg["seed"] == 7
    assert msg["num_frames"] == (4 * 3 - 1) * 4 + 1 and (msg["width"], msg["height"]) == (128, 64)
    script = msg["extra_params"]["camera_action_script"]
    assert len(script) == 4 and all(len(c) == 3 for c in script)
    assert script == camera_action_script(7, 4) and script != camera_action_script(8, 4)
    assert all(k in "wasdijkl" for c in script for f in c for k in f)
    assert "model" not in msg and "image_reference" not in msg  # unset: production's defaults apply


def test_event_rows_take_server_boundaries_only_from_this_hosts_clock():
    def rec(boot: str) -> ClientSession:
        c = ChunkRecord("media", 9, 10, metadata_ns=100, last_byte_ns=120, generation_chunk_index=0,
                        server_timestamps={"submit": 10, "encoded": 90}, server_boot_id=boot)
        trailer = ChunkRecord("trailer", 0, 5, metadata_ns=130, last_byte_ns=131)
        return ClientSession(session=0, seed=0, chunks_asked=1, chunks=[c, trailer])

    same, other = chunk_events(rec(boot_id()), boot_id()), chunk_events(rec("another-host"), boot_id())
    assert [e.present() for e in same] == [{"submit": 10, "encoded": 90, "delivered": 120}]
    assert [e.present() for e in other] == [{"delivered": 120}]  # another clock: not measured, never shifted
    assert [e.frames for e in same] == [9]  # the trailer is no chunk


def test_the_client_manifest_records_the_hosts_load_as_a_serve_manifest_does():
    host = client_manifest(Workload(url="ws://h:1/v1/realtime/video"), "running")["host"]
    assert host["cpus"] >= 1 and len(host["load_start"]) == 3 and "load_end" not in host  # load_end: at finish


def test_split_frames_cuts_at_the_announced_counts():
    frames = np.arange(21)[:, None, None, None] * np.ones((1, 2, 2, 3), np.uint8)
    parts = split_frames(frames, [9, 12])
    assert [len(p) for p in parts] == [9, 12] and parts[1][0, 0, 0, 0] == 9


@pytest.mark.parametrize("args, says", [
    (["--connect", "nohost"], "expected HOST:PORT"),
    (["--connect", "127.0.0.1:1", "--read-rate", "0.5"], "--read-rate: an option of --api harness"),
    (["--connect", "127.0.0.1:1", "--chunks", "0"], "--chunks must be ≥ 1"),
    (["--connect", "127.0.0.1:1", "--image", "/nonexistent.png"], "no such file"),
])
def test_bad_command_lines_are_refused_in_one_line(args, says, tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "harness", "client", "--api", "vllm-omni", *args, "--out", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert r.returncode != 0 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()  # refused before anything was created


def test_gate_compares_two_pixel_only_runs_on_pixels(tmp_path):
    px = np.random.default_rng(0).integers(0, 256, (9, 8, 8, 3), dtype=np.uint8)
    runs = {}
    for name, delta in (("a", 0), ("b", 0), ("c", 40)):
        d = tmp_path / name
        sha = save_pixels(d, 0, 0, (px.astype(int) + delta).clip(0, 255).astype(np.uint8))
        write_hashes(d, [HashRecord(epoch=0, chunk=0, session=0, pixels_sha256=sha)])
        runs[name] = d
    same = gate(runs["a"], runs["b"], "exact")
    assert same.passed and "pixels only" in same.verdict
    assert not gate(runs["a"], runs["c"], "threshold").passed
    with_latent = tmp_path / "server"
    rec = HashRecord(epoch=0, chunk=0, session=0, pixels_sha256=save_pixels(with_latent, 0, 0, px), latent_sha256="0" * 64)
    write_hashes(with_latent, [rec])
    assert not gate(runs["a"], with_latent, "threshold").passed  # a run with latents is not compared on pixels alone


@pytest.fixture(scope="module")
def measured_harness_server(tmp_path_factory):
    base = tmp_path_factory.mktemp("omni")
    srv = ServerProcess(["--preset", "tiny", "--api", "vllm-omni", "--sessions", "2", *ONE_RANK_EACH], base / "server")
    host_port = srv.url.split("//")[1].split("/")[0]
    r = subprocess.run([sys.executable, "-m", "harness", "client", "--api", "vllm-omni", "--connect", host_port,
                        "--sessions", "2", "--chunks", str(CHUNKS), "--seed", "4", "--interaction-every", "1",
                        "--out", str(base / "client")], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    srv.proc.wait(timeout=120)  # --sessions 2: the server ends after serving them
    return r, base / "server", base / "client"


def test_client_run_matches_the_harness_servers_row_by_row(measured_harness_server):
    r, server, client = measured_harness_server
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stderr
    client_manifest_ = json.loads((client / "manifest.json").read_text())
    assert client_manifest_["status"] == "complete"
    assert len(client_manifest_["host"]["load_start"]) == len(client_manifest_["host"]["load_end"]) == 3  # as serve's
    assert json.loads((server / "manifest.json").read_text())["status"] == "complete"
    ce, se = read_events(client / "events.jsonl"), read_events(server / "events.jsonl")
    cs = read_sessions(client / "sessions.jsonl")
    assert validate_events(ce, cs) == []
    assert [e.key for e in ce] == [e.key for e in se] == [(s, s, k) for s in range(2) for k in range(CHUNKS)]
    for c, s in zip(ce, se):
        server_side = {b: t for b, t in s.present().items() if b != "delivered"}
        assert {b: t for b, t in c.present().items() if b != "delivered"} == server_side  # same clock, same stamps
        assert c.delivered >= s.encoded and c.frames == s.frames
    # lossless media: the decoded frames are the server's, hash for hash
    cf = [json.loads(x)["frame_sha256"] for x in (client / "frames.jsonl").read_text().splitlines()]
    sf = [json.loads(x)["frame_sha256"] for x in (server / "frames.jsonl").read_text().splitlines()]
    assert cf == sf and len(cf[0]) == 9 + 12 * (CHUNKS - 1)
    summary = json.loads((client / "summary.json").read_text())
    assert summary["headline"]["boundary"] == "delivered" and "cpu_ready" in summary["boundaries"]
    assert set(summary["absent_boundaries"]) == {b for b in BOUNDARIES if b not in ce[0].present()}


def test_interactions_are_received_and_reported_applied(measured_harness_server):
    _, _, client = measured_harness_server
    dec = msgspec.json.Decoder(ClientSession)
    for rec in (dec.decode(x) for x in (client / "client.jsonl").read_bytes().splitlines()):
        assert [i.after_chunk for i in rec.interactions] == list(range(CHUNKS - 1))
        assert all(i.queued_ns is not None and i.error is None for i in rec.interactions)
        applied = [i for i in rec.interactions if i.applied_chunk is not None]
        assert all(i.applied_chunk > i.after_chunk for i in applied)


def test_report_reads_a_client_run(measured_harness_server):
    _, _, client = measured_harness_server
    r = subprocess.run([sys.executable, "-m", "harness", "report", str(client)], capture_output=True, text=True,
                       timeout=300, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr
    assert (client / "report.md").is_file()


def test_compare_servers_judges_launches_of_client_runs(measured_harness_server, tmp_path):
    """``compare-servers`` over round directories that are client runs: copies of one launch on
    both arms pass the pixel gate and are judged equivalent (ratio exactly 1); a changed arm B
    (its pixels shifted) fails the gate and gets no speed verdict."""
    _, _, client = measured_harness_server
    for r in range(2):
        for arm in "AB":
            shutil.copytree(client, tmp_path / "same" / f"round{r}-{arm}")
    res = analyze(tmp_path / "same")
    assert res["gate"]["passed"] and res["rounds"] == 2 and res["reference"] == "delivered"
    assert res["verdict"] == "equivalent" and res["rows"][0]["ab"]["value"] == 1.0
    for r in range(2):
        for arm in "AB":
            shutil.copytree(client, tmp_path / "diff" / f"round{r}-{arm}")
    px = tmp_path / "diff" / "round0-B" / "outputs" / "epoch0" / "chunk00.pixels.npy"
    shifted = (np.load(px).astype(int) + 60).clip(0, 255).astype(np.uint8)
    sha = save_pixels(tmp_path / "diff" / "round0-B", 0, 0, shifted)
    hashes = tmp_path / "diff" / "round0-B" / "outputs" / "hashes.jsonl"
    recs = [msgspec.json.decode(x, type=HashRecord) for x in hashes.read_bytes().splitlines()]
    write_hashes(tmp_path / "diff" / "round0-B", [msgspec.structs.replace(h, pixels_sha256=sha) if h.key == (0, 0) else h
                                                 for h in recs])
    res = analyze(tmp_path / "diff")
    assert not res["gate"]["passed"] and res["verdict"] == "no verdict" and "gate" in res["reason"]
