"""``serve --listen --api vllm-omni`` (tiny preset, one real server process for the module): the
message sequence of production's realtime API, fragmented-MP4 media that decodes to exactly the
frames generated, production's error for each bad input with the next client still served, and a
run directory that passes the contract checks."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import time

import aiohttp
import av
import numpy as np
import pytest
from aiohttp import WSMsgType

from harness.drivers.procwatch import wait_gone
from harness.experiments.scenario import ServerProcess
from harness.measure.events import BOUNDARIES, read_events, validate_events
from harness.serving import omni_protocol as O
from harness.serving import protocol as W

from helpers.presets import ONE_RANK_EACH

START_TIMEOUT_S = 1.0
SEED, CHUNKS = 5, 2
SCRIPT = [[["w"], ["w"], ["d"]], [["a"], [], ["s"]]]


def start_msg(**kw) -> dict:
    msg = {"type": "session.start", "model": "any", "prompt": "a boardwalk", "image_reference": None, "width": 128,
           "height": 64, "num_frames": O.num_frames_for_chunks(CHUNKS), "fps": 16, "seed": SEED,
           "extra_params": {"flow_shift": 5.0, "camera_action_script": SCRIPT}}
    msg.update(kw)
    return {k: v for k, v in msg.items() if v is not None}


async def _session(url: str, first: str | None, during=(), after_first_chunk=(), stamps: dict | None = None) -> list:
    """Every message of one connection until the server closes it: decoded text messages and the
    binary frames as bytes. ``during`` is sent once video.start arrived, ``after_first_chunk`` once
    chunk 0's media did. ``stamps`` gets (this host's monotonic ns) when each message was sent
    (``sent``, in order) and when each ``queued`` receipt arrived (``queued``, by event id)."""
    out, stamps = [], stamps if stamps is not None else {}
    stamps.setdefault("sent", [])
    stamps.setdefault("queued", {})

    async def send(ws, texts) -> None:
        for text in texts:
            stamps["sent"].append(time.monotonic_ns())
            await ws.send_str(text)

    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url, max_msg_size=0) as ws:
            if first is not None:
                await ws.send_str(first)
            while True:
                m = await ws.receive(timeout=300)
                if m.type == WSMsgType.TEXT:
                    out.append(O.decode_server(m.data))
                    if isinstance(out[-1], O.InteractionQueued):
                        stamps["queued"][out[-1].event_id] = time.monotonic_ns()
                    if isinstance(out[-1], O.VideoStart):
                        await send(ws, during)
                elif m.type == WSMsgType.BINARY:
                    out.append(bytes(m.data))
                    if sum(isinstance(x, bytes) for x in out) == 1:
                        await send(ws, after_first_chunk)
                else:
                    return out


def run(url, first, **kw) -> list:
    return asyncio.run(_session(url, first, **kw))


def interaction(event_id: str, **event) -> str:
    return json.dumps({"type": "session.interaction", "interaction": {"event_id": event_id, "event": event}})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(["--preset", "tiny", "--api", "vllm-omni", "--start-timeout", str(START_TIMEOUT_S),
                         "--warmup-chunks", "0", "--window", "1", *ONE_RANK_EACH], tmp_path_factory.mktemp("omni") / "run")
    srv.workers_at_start = srv.workers()
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


STAMPS: dict = {}


@pytest.fixture(scope="module")
def first(server):
    """The reference session: a scripted camera, a prompt interaction and a ping at the start, a
    camera interaction once chunk 0 arrived."""
    return run(server.url, json.dumps(start_msg()),
               during=[interaction("p1", prompt="a beach"), json.dumps({"type": "session.ping"})],
               after_first_chunk=[interaction("c1", multi_modal_data={"camera": {"keys": ["a", "w"]}})], stamps=STAMPS)


def media_of(msgs) -> list[bytes]:
    return [m for m in msgs if isinstance(m, bytes)]


def metas_of(msgs) -> list[O.ChunkMetadata]:
    return [m for m in msgs if isinstance(m, O.ChunkMetadata)]


def decode(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data), format="mp4") as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


def test_message_sequence_is_productions(first):
    kinds = [type(m).__name__ if not isinstance(m, bytes) else "bytes" for m in first]
    assert kinds[0] == "VideoStart" and kinds[-1] == "SessionDone"
    # every chunk: its metadata, then at once its binary frame of that many bytes
    body = [k for k in kinds if k in ("ChunkMetadata", "bytes")]
    assert body == ["ChunkMetadata", "bytes"] * CHUNKS
    for i, m in enumerate(first):
        if isinstance(m, O.ChunkMetadata):
            assert isinstance(first[i + 1], bytes) and len(first[i + 1]) == m.byte_length
    metas = metas_of(first)
    assert [m.generation_chunk_index for m in metas] == [m.transport_chunk_index for m in metas] == list(range(CHUNKS))
    assert [m.num_frames for m in metas] == [9] + [12] * (CHUNKS - 1) and {m.kind for m in metas} == {"media"}
    start, done = first[0], first[-1]
    assert start.format == "m4s" and start.config["num_frames"] == O.num_frames_for_chunks(CHUNKS)
    assert {m.request_id for m in metas} == {start.request_id} == {done.request_id}
    assert done.chunks == CHUNKS and done.stopped is False
    assert [m.event_id for m in first if isinstance(m, O.InteractionQueued)] == ["p1", "c1"]
    assert sum(isinstance(m, O.SessionPong) for m in first) == 1


def test_every_interaction_is_accounted_for_once_by_the_rule(first):
    """Two-phase receipt: queued at once, then taken by the first chunk whose cutoff (the moment it
    takes its actions, before its submit) follows the event's arrival (applied: camera; unrendered:
    prompt), or, arriving after the last cutoff, reported unapplied by session.done. The client
    shares the server's clock (same host), so the rule is checked from both sides: the taking
    chunk's cutoff is after the event was sent, the previous chunk's before its receipt came back."""
    metas, done = metas_of(first), first[-1]
    taken = {e: m.generation_chunk_index for m in metas for e in m.applied_event_ids}
    prompt_taken = {e: m.generation_chunk_index for m in metas for e in m.unrendered_event_ids}
    assert sorted([*taken, *prompt_taken, *done.unapplied_event_ids]) == ["c1", "p1"]
    assert "p1" not in taken and "c1" not in prompt_taken  # a prompt change is never claimed applied
    cutoffs = [m.interaction_cutoff_ns for m in metas]
    assert all(c < m.server_timestamps["submit"] for c, m in zip(cutoffs, metas))
    sent = dict(zip(["p1", "ping", "c1"], STAMPS["sent"]))
    for e, k in {**taken, **prompt_taken}.items():
        assert cutoffs[k] > sent[e]
        assert k == 0 or cutoffs[k - 1] < STAMPS["queued"][e]
    for e in done.unapplied_event_ids:
        assert cutoffs[-1] < STAMPS["queued"][e]


def test_every_fragment_decodes_to_exactly_its_chunks_frames(first, server):
    """Lossless and exact at chunk boundaries: the first k fragments decode to the frames of chunks
    0..k-1, whose SHA-256 equal the metadata's and whose pixels equal the saved ones (and the run's
    frames.jsonl, written at the end: checked by the last test)."""
    frags, metas = media_of(first), metas_of(first)
    assert frags[0][4:8] == b"ftyp" and all(f[4:8] == b"moof" for f in frags[1:])
    ends = np.cumsum([m.num_frames for m in metas])
    for k in range(1, CHUNKS + 1):
        assert len(decode(b"".join(frags[:k]))) == ends[k - 1]
    frames = decode(b"".join(frags))
    got = [hashlib.sha256(f.tobytes()).hexdigest() for f in frames]
    assert got == [h for m in metas for h in m.frame_sha256]
    saved = np.concatenate([np.load(server.out / "outputs" / "epoch0" / f"chunk{c:02d}.pixels.npy") for c in range(CHUNKS)])
    np.testing.assert_array_equal(np.stack(frames), saved)


def test_chunk_metadata_carries_the_server_boundaries(first, server):
    rows = [e for e in read_events(server.out / "events.jsonl") if e.session == 0]
    for m, e in zip(metas_of(first), rows):
        assert m.server_boot_id == W.boot_id() != ""  # the server runs on this host: one monotonic clock
        assert m.server_timestamps == {k: getattr(e, k) for k in m.server_timestamps}
        assert list(m.server_timestamps) == [b for b in BOUNDARIES if b != "delivered"]
        assert e.delivered is not None and e.delivered >= e.encoded


START_REFUSALS = {
    "unknown type": (json.dumps({"type": "nope"}), "Expected session.start, got: nope"),
    "bad JSON": ("{not json", O.START_BAD_JSON),
    "not an object": ("[1, 2]", O.START_NOT_OBJECT),
    "oversize start": (json.dumps(start_msg(prompt="x" * O.MAX_START_MESSAGE_CHARS)), O.START_TOO_LARGE),
    "wrong format": (json.dumps(start_msg(format="mp4")), O.BAD_FORMAT),
    "start timeout": (None, O.START_TIMEOUT),
    "geometry": (json.dumps(start_msg(width=832, height=480)), None),
    "image reference": (json.dumps(start_msg(image_reference={"image_url": "data:image/png;base64,AA=="})), None),
}


@pytest.mark.parametrize("case", list(START_REFUSALS))
def test_a_refused_start_gets_productions_error_and_the_connection_closes(server, first, case):
    text, want = START_REFUSALS[case]
    msgs = run(server.url, text)
    assert len(msgs) == 1 and isinstance(msgs[0], O.Error), msgs
    if want is not None:
        assert msgs[0].message == want
    else:
        assert msgs[0].message.startswith("Invalid session.start: ")


def test_refused_control_messages_get_productions_errors_and_the_session_goes_on(server, first):
    bad = [json.dumps({"type": "nope"}), "{not json", json.dumps({"type": "session.ping", "pad": "x" * O.MAX_CONTROL_MESSAGE_CHARS}),
           interaction("e1", prompt="one"), interaction("e1", prompt="two"), json.dumps({"type": "session.start"})]
    msgs = run(server.url, json.dumps(start_msg()), during=bad)
    errors = [m for m in msgs if isinstance(m, O.Error)]
    assert [e.message for e in errors] == ["Unknown message type: nope", O.CONTROL_BAD_JSON, O.CONTROL_TOO_LARGE,
                                           O.EVENT_ID_CONFLICT, "Unknown message type: session.start"]
    conflict = errors[3]
    assert conflict.code == "event_id_conflict" and conflict.event_id == "e1" and conflict.request_id == msgs[0].request_id
    assert isinstance(msgs[-1], O.SessionDone) and msgs[-1].chunks == CHUNKS and not msgs[-1].stopped
    SCRIPTED["frames"] = [h for m in metas_of(msgs) for h in m.frame_sha256]


SCRIPTED: dict = {}  # frame hashes of the scripted session above (its prompt events change no pixel)


def test_the_next_client_after_every_refusal_gets_the_same_video(server, first):
    """Same request, same video: a clean session after all the refusals above reproduces the frames
    of the scripted session that met the control refusals."""
    plain = run(server.url, json.dumps(start_msg()))
    hashes = [h for m in metas_of(plain) for h in m.frame_sha256]
    assert hashes == SCRIPTED["frames"] and len(hashes) == 9 + 12 * (CHUNKS - 1)
    assert server.proc.poll() is None


def test_session_stop_ends_the_session_as_stopped(server, first):
    msgs = run(server.url, json.dumps(start_msg(num_frames=O.num_frames_for_chunks(4), extra_params=None)),
               after_first_chunk=[json.dumps({"type": "session.stop"})])
    done = msgs[-1]
    assert isinstance(done, O.SessionDone) and done.stopped and 1 <= done.chunks < 4


def test_run_directory_passes_the_contract_checks(server, first):
    """Last: the server stops (SIGTERM) and leaves a complete run directory, nothing behind."""
    rc = server.stop()
    assert rc == 0 and wait_gone(server.workers_at_start) == []
    man = json.loads((server.out / "manifest.json").read_text())
    assert man["status"] == "complete" and man["protocol"]["api"] == "vllm-omni"
    assert man["protocol"]["name"] == "websocket" and man["protocol"]["media"] == "client"
    assert man["config"]["runtime"]["container"] == "fmp4"
    events = read_events(server.out / "events.jsonl")
    assert validate_events(events) == []
    whole = [e for e in events if not e.cancelled]
    assert whole and all(list(e.present()) == list(BOUNDARIES) for e in whole)
    assert list((server.out / "media").iterdir()) == []  # the media went to the clients
    rows = [json.loads(line) for line in (server.out / "frames.jsonl").read_text().splitlines()]
    assert next(r["frame_sha256"] for r in rows if r["session"] == 0) == [h for m in metas_of(first) for h in m.frame_sha256]
