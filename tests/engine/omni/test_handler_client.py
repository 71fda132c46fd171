"""vLLM-Omni's own realtime video handler, over a real socket, fed by the harness's engine, measured
by ``client --api vllm-omni``.

One module-scoped server: production's ``OmniStreamingVideoOutputHandler`` from the installed
package, mounted by ``serving.omni_engine_client.omni_app`` over ``HarnessEngineClient`` (the tiny
preset's DiT and VAE in this process), served by uvicorn on 127.0.0.1 (port 0) in a thread. The
client measures two sessions of three chunks with an interaction after every chunk.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import aiohttp
import numpy as np
import pytest

from harness.config import load_preset
from harness.measure.events import read_run, validate_events
from harness.measure.gates import to_unit_range
from harness.pipeline.decode import decode_pyav
from harness.serving import omni_protocol as O
from harness.serving.omni_client import Workload, measure, split_frames
from harness.serving.omni_engine_client import HarnessEngineClient, omni_app

CHUNKS = 3
#: production's encoder is H.264 in yuv420p at crf 18 (``FragmentedMP4Muxer``; lossy by design,
#: and the pixel format is fixed, so no codec option makes it lossless: crf 0 keeps the 4:2:0
#: chroma). The tiny preset's random-weight frames are colour noise (std ≈ 74 levels), the worst
#: case for 4:2:0: measured RMSE 0.18–0.21 per frame in [−1, 1] units (max |Δ| ≈ 165 levels), at
#: crf 18 and at crf 0 alike, against 0.74–0.77 between neighbouring frames. So the check is the
#: bound below and, per decoded frame, that the generated frame nearest to it is its own.
RMSE_BOUND = 0.3


@pytest.fixture(scope="module")
def server(extra):
    uvicorn = pytest.importorskip("uvicorn")
    engine = HarnessEngineClient(load_preset("tiny"))
    app = omni_app(engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws_max_size=O.MAX_FRAME_BYTES))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 120
    while not srv.started:
        assert th.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield engine, f"ws://127.0.0.1:{sock.getsockname()[1]}{O.PATH}"
    srv.should_exit = True
    th.join(30)
    sock.close()


@pytest.fixture(scope="module")
def measured(server, tmp_path_factory):
    engine, url = server
    v = engine.cfg.video
    w = Workload(url=url, sessions=2, chunks=CHUNKS, seed=5, prompt="a road", width=v.width, height=v.height,
                 interaction_every=1, interaction_prompt="a river", ping_s=0.5)
    run_dir, recs, summary = measure(w, str(tmp_path_factory.mktemp("omni") / "run"))
    return engine, run_dir, recs, summary


def test_message_sequence_is_the_handlers(measured):
    _, run_dir, recs, summary = measured
    assert [r.outcome for r in recs] == ["complete", "complete"], [r.error for r in recs]
    for r in recs:
        assert r.request_id.startswith("video_stream-") and r.video_start_ns is not None
        assert r.start_sent_ns < r.video_start_ns < r.chunks[0].metadata_ns <= r.chunks[0].last_byte_ns < r.done_ns
        kinds = [c.kind for c in r.chunks]
        assert kinds[:CHUNKS] == ["media"] * CHUNKS and kinds[CHUNKS:] in ([], ["trailer"])
        assert [c.transport_chunk_index for c in r.chunks] == list(range(len(r.chunks)))
        assert [c.generation_chunk_index for c in r.chunks[:CHUNKS]] == list(range(CHUNKS))
        assert [c.num_frames for c in r.chunks[:CHUNKS]] == [9, 12, 12]
        assert r.config["num_frames"] == O.num_frames_for_chunks(CHUNKS) and r.config["seed"] == r.seed
        assert r.pongs >= 0 and not r.media_check
    assert summary["status"] == "complete"


def test_run_directory_contract(measured):
    _, run_dir, recs, summary = measured
    man = json.loads((run_dir / "manifest.json").read_text())
    assert man["status"] == "complete" and man["command"] and man["client"]["api"] == "vllm-omni"
    events, starts = read_run(run_dir)
    assert validate_events(events, starts) == []
    assert [(e.session, e.chunk) for e in events] == [(s, k) for s in range(2) for k in range(CHUNKS)]
    # production's metadata carries no server timestamps: only the client's boundary is present
    assert all(set(e.present()) == {"delivered"} for e in events)
    assert summary["headline"]["boundary"] == "delivered" and summary["valid"], summary["flags"]
    assert "cpu_ready" in summary["absent_boundaries"] and "cpu_ready" not in summary["boundaries"]
    assert [s.start_ns for s in starts] == [r.start_sent_ns for r in recs]
    assert (run_dir / "media" / "session0.mp4").is_file() and not list(run_dir.glob("media/*.part"))
    frames = [json.loads(line) for line in (run_dir / "frames.jsonl").read_text().splitlines()]
    assert [len(f["frame_sha256"]) for f in frames] == [9 + 12 * (CHUNKS - 1)] * 2


def test_decoded_frames_are_the_generated_ones_within_the_encoders_loss(measured):
    engine, run_dir, recs, _ = measured
    for r in recs:
        generated = engine.generated[r.request_id]
        decoded = decode_pyav(run_dir / r.media_path).frames
        assert len(decoded) == sum(len(g) for g in generated)
        gen = to_unit_range(np.concatenate(generated))
        dec = to_unit_range(decoded)
        rmse = np.sqrt(((dec[:, None] - gen[None]) ** 2).mean(axis=(2, 3, 4)))  # (decoded, generated)
        own = np.diag(rmse)
        assert own.max() <= RMSE_BOUND, f"session {r.session}: frame RMSE up to {own.max():.3f} > {RMSE_BOUND}"
        assert list(rmse.argmin(axis=1)) == list(range(len(decoded))), "a decoded frame is nearest to another frame"
        print(f"session {r.session}: frame RMSE decoded vs generated {own.min():.3f}–{own.max():.3f}, "
              f"nearest other frame ≥ {np.where(np.eye(len(own), dtype=bool), np.inf, rmse).min():.3f}")
        # the saved epochs' pixels are what was decoded, chunk by chunk
        saved = np.load(run_dir / "outputs" / f"epoch{r.session}" / "chunk01.pixels.npy")
        assert np.array_equal(saved, split_frames(decoded, [len(g) for g in generated])[1])


def test_each_chunks_bytes_decode_to_its_frames_but_the_last(measured):
    """Production's muxer (``frag_every_frame``) writes a frame's fragment when the next frame
    arrives: the bytes through chunk k decode to all of chunks 0…k's frames but the last one,
    which comes with the next chunk's bytes or the trailer. So against production the client's
    ``delivered`` (the last byte of the chunk's own fragment) is one frame short of the chunk."""
    _, run_dir, recs, _ = measured
    r = recs[0]
    data = (run_dir / r.media_path).read_bytes()
    ends = np.cumsum([c.byte_length for c in r.chunks])
    prefix = run_dir / "prefix.mp4"
    for k in range(CHUNKS):
        prefix.write_bytes(data[: ends[k]])
        assert len(decode_pyav(prefix).frames) == sum(c.num_frames for c in r.chunks[: k + 1]) - 1
    prefix.unlink()


def test_interactions_are_queued_and_applied_once(measured):
    engine, _, recs, _ = measured
    for r in recs:
        assert [i.after_chunk for i in r.interactions] == list(range(CHUNKS - 1))
        assert all(i.queued_ns is not None and i.queued_ns > i.sent_ns and i.error is None for i in r.interactions)
        applied = {i.event_id: i.applied_chunk for i in r.interactions if i.applied_chunk is not None}
        # what the metadata reported applied is what the engine applied, each at a later chunk than sent after
        assert applied == dict(engine.applied[r.request_id])
        assert all(applied[i.event_id] > i.after_chunk for i in r.interactions if i.event_id in applied)
        assert len(engine.applied[r.request_id]) == len({e for e, _ in engine.applied[r.request_id]})


def test_conflicting_event_id_gets_productions_error(server):
    engine, url = server
    v = engine.cfg.video

    async def go() -> list[dict]:
        start = O.SessionStart(prompt="x", width=v.width, height=v.height, num_frames=O.num_frames_for_chunks(1), seed=1)
        ev = O.SessionInteraction(interaction=O.Interaction(event_id="same", event=O.InteractionEvent(prompt="y")))
        seen = []
        async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
            await ws.send_str(O.encode(start))
            while True:
                m = await ws.receive(timeout=120)
                if m.type == aiohttp.WSMsgType.BINARY:
                    continue
                assert m.type == aiohttp.WSMsgType.TEXT, m
                msg = json.loads(m.data)
                seen.append(msg)
                if msg["type"] == "video.start":
                    await ws.send_str(O.encode(ev))
                    await ws.send_str(O.encode(ev))
                if msg["type"] == "session.done":
                    return seen

    seen = asyncio.run(go())
    queued = [m for m in seen if m["type"] == "session.interaction.queued"]
    errors = [m for m in seen if m["type"] == "error"]
    assert [m["event_id"] for m in queued] == ["same"]
    assert errors == [{"type": "error", "message": O.EVENT_ID_CONFLICT, "code": "event_id_conflict",
                       "request_id": queued[0]["request_id"], "event_id": "same"}]
