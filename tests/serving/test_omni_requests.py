"""What ``--api vllm-omni`` accepts, without a socket: ``session.start`` and ``session.interaction``
checked in production's order with its texts, the preset's own refusals, the wire's tolerance for
unknown server fields, and the command line refusing what does not fit before anything starts."""

from __future__ import annotations

import json

import pytest

from harness.cli import main
from harness.config import load_preset
from harness.serving import omni_protocol as O
from harness.serving.omni_requests import (InteractionRequest, Refusal, StartPolicy, StartRequest, frames_to_chunks,
                                           parse_interaction, parse_start)
from harness.serving.omni_server import OmniOptions

CFG = load_preset("tiny")
OK = {"type": "session.start", "prompt": "p", "width": 128, "height": 64, "num_frames": 21, "fps": 16, "seed": 1,
      "extra_params": {"flow_shift": 5.0, "camera_action_script": [[["w"], ["W", "j"], []], [[], [], ["d"]]]}}


def start(policy=StartPolicy(), **kw):
    return parse_start(json.dumps({**OK, **kw}), CFG, policy)


def test_a_benchmark_style_start_is_accepted_and_mapped_to_chunks():
    req = start(model="robbyant/lingbot-world", unknown_field="ignored, as production's request model does")
    assert isinstance(req, StartRequest) and req.chunks == 2 and req.seed == 1
    assert req.script == (("w", "wj", ""), ("", "", "d"))  # keys in canonical order, either case
    assert req.config["num_frames"] == 21 and "type" not in req.config and not req.image_ignored


def test_num_frames_maps_to_whole_chunks_only():
    assert [frames_to_chunks(O.num_frames_for_chunks(c), 3) for c in (1, 2, 10)] == [1, 2, 10]
    assert O.chunks_for_num_frames(45) == 4 and O.num_frames_for_chunks(4) == 45
    assert "not a whole number of chunks" in frames_to_chunks(44, 3) and "e.g. 33 for 3" in frames_to_chunks(44, 3)


@pytest.mark.parametrize("raw, want", [
    ("x" * (O.MAX_START_MESSAGE_CHARS + 1), O.START_TOO_LARGE),
    ("{", O.START_BAD_JSON),
    ("3", O.START_NOT_OBJECT),
    (json.dumps({"type": "session.ping"}), "Expected session.start, got: session.ping"),
    (json.dumps({"prompt": "p"}), "Expected session.start, got: None"),
    (json.dumps({**OK, "format": "mp4"}), O.BAD_FORMAT),
])
def test_productions_start_refusals_in_its_order(raw, want):
    assert parse_start(raw, CFG, StartPolicy()) == want


@pytest.mark.parametrize("kw, part", [
    ({"prompt": None}, "Expected `str`, got `null`"),
    ({"width": 832, "height": 480}, "does not match the server's 128x64"),
    ({"fps": 24}, "fps 24 does not match"),
    ({"num_frames": 22}, "not a whole number of chunks"),
    ({"seed": -1}, "out of this server's range"),
    ({"flow_shift": 3.0}, "flow_shift 3 does not match"),
    ({"negative_prompt": "blur", "num_inference_steps": 8}, "negative_prompt, num_inference_steps not supported"),
    ({"extra_params": {"video_codec_options": {}}}, "unknown field `video_codec_options`"),
    ({"extra_params": {"camera_action_script": [[["w"], [], []]]}}, "has 1 chunks, num_frames asks for 2"),
    ({"extra_params": {"camera_action_script": [[["q"], [], []]] * 2}}, "invalid key(s) 'q'"),
    ({"image_reference": {"image_url": "https://x/y.jpg"}}, "image_reference is not supported"),
])
def test_what_the_preset_cannot_generate_is_refused_in_productions_style(kw, part):
    err = start(**kw)
    assert isinstance(err, str) and err.startswith("Invalid session.start: ") and part in err, err


def test_model_and_image_policies():
    assert start(StartPolicy(model="a"), model="b") == O.MODEL_MISMATCH.format("b", "a")
    assert isinstance(start(StartPolicy(model="a"), model="a"), StartRequest)
    req = start(StartPolicy(image_reference="ignore"), image_reference={"image_url": "data:image/png;base64,AA=="})
    assert isinstance(req, StartRequest) and req.image_ignored


def _interaction(**kw) -> dict:
    return {"type": "session.interaction", "interaction": kw}


@pytest.mark.parametrize("msg, want", [
    ({"type": "session.interaction"}, O.NO_INTERACTION),
    (_interaction(event_id="", event={"prompt": "p"}), O.BAD_EVENT_ID),
    (_interaction(event_id="e"), O.NO_EVENT),
    (_interaction(event={}), O.EMPTY_EVENT),
    (_interaction(event={"prompt": " ", "multi_modal_data": {"camera": {"keys": ["w"]}}}), O.BAD_PROMPT),
    (_interaction(event={"prompt": "p", "multi_modal_data": {}}), O.BAD_MM),
    (_interaction(event={"multi_modal_data": {"camera": ["w"]}}), O.BAD_MODALITY.format("camera")),
    (_interaction(event={"prompt": "p", "negative_prompt": "n"}), O.NO_NEGATIVE_PROMPT),
    (_interaction(event={"prompt": "p"}, transition_chunks=1.5), O.BAD_TRANSITION),
    (_interaction(event={"prompt": "p"}, transition_chunks=-1), O.NEGATIVE_TRANSITION),
])
def test_productions_interaction_refusals(msg, want):
    assert parse_interaction(msg) == Refusal(want)


def test_interactions_the_harness_applies_and_those_it_cannot():
    cam = parse_interaction(_interaction(event_id="c", event={"multi_modal_data": {"camera": {"keys": ["d", "W"]}}}))
    assert cam == InteractionRequest(event_id="c", prompt=None, keys="wd")
    anon = parse_interaction(_interaction(event={"prompt": "a beach"}, transition_chunks=3))
    assert anon.prompt == "a beach" and anon.keys is None and len(anon.event_id) == 32  # production names it
    audio = parse_interaction(_interaction(event_id="a", event={"multi_modal_data": {"audio": {"x": 1}}}))
    assert audio.code == "interaction_failed" and audio.event_id == "a" and audio.message.startswith(O.INTERACTION_FAILED)
    bad = parse_interaction(_interaction(event_id="k", event={"multi_modal_data": {"camera": {"keys": ["z"]}}}))
    assert bad.code == "interaction_failed" and "invalid key(s) 'z'" in bad.message


def test_server_messages_decode_with_unknown_fields_and_keep_productions_nulls():
    text = json.dumps({"type": "video.chunk_metadata", "request_id": "r", "kind": "trailer", "num_frames": 0,
                       "byte_length": 7, "generation_chunk_index": None, "some_future_field": {"a": 1}})
    m = O.decode_server(text)
    assert isinstance(m, O.ChunkMetadata) and m.generation_chunk_index is None and m.applied_event_ids == []
    assert json.loads(O.encode(m))["generation_chunk_index"] is None  # production sends the null
    assert json.loads(O.encode(O.Error(message="x"))) == {"type": "error", "message": "x"}  # and leaves unset optionals out


def test_the_default_timeouts_are_productions():
    assert OmniOptions().start_timeout_s == O.START_TIMEOUT_S == 10.0
    assert OmniOptions().stall_timeout_s == O.STALL_TIMEOUT_S == 60.0


@pytest.mark.parametrize("argv, part", [
    (["serve", "--preset", "tiny", "--api", "vllm-omni"], "--api vllm-omni is the network endpoint's protocol: add --listen"),
    (["serve", "--preset", "tiny", "--listen", "127.0.0.1:0", "--start-timeout", "2"], "options of --api vllm-omni"),
    (["serve", "--preset", "tiny", "--listen", "127.0.0.1:0", "--api", "vllm-omni", "--action-timeout", "2"],
     "--action-timeout is for --api harness"),
    (["serve", "--preset", "tiny", "--listen", "127.0.0.1:0", "--api", "vllm-omni", "--start-timeout", "0"],
     "--start-timeout must be in (0, 3600]"),
    (["serve", "--preset", "tiny", "--listen", "127.0.0.1:0", "--api", "vllm-omni", "--encoder", "ffmpeg"],
     "runtime.container fmp4 is encoded by the pyav encoder"),
])
def test_the_command_line_refuses_in_one_line_before_anything_starts(argv, part, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path / "run")]) != 0
    err = capsys.readouterr().err.strip()
    assert part in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
