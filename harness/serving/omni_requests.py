"""What the server of ``--api vllm-omni`` accepts: ``session.start`` and ``session.interaction``
checked in production's order with production's error texts, then against the server's preset.

Pure functions (text in, a typed request or one error out), so every refusal is testable without
a socket. Production's handler (vLLM-Omni's ``OmniStreamingVideoOutputHandler``) is the reference
for the order of the checks and the wording; the harness's own refusals, where production has none
(the server runs one preset, so width, height, fps, num_frames and flow_shift must fit it), use
production's ``Invalid session.start: …`` form.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from harness.engine.camera import normalize_action
from harness.errors import HarnessError
from harness.limits import session_frames_error
from harness.serving import omni_protocol as O
from harness.serving.protocol import one_line

#: seeds the harness's noise accepts (production's int64 range is wider)
MAX_SEED = 2**31 - 1
IMAGE_POLICIES = ("refuse", "ignore")


@dataclass(frozen=True)
class StartPolicy:
    """What the server's operator decided about requests: ``model`` is the served model name
    (None: any name is accepted, as production does without one); ``image_reference`` is
    ``refuse`` (default) or ``ignore`` (accepted and not used: a session is conditioned on the
    synthetic image of its seed; the manifest and video.start say so)."""

    model: str | None = None
    image_reference: str = "refuse"


@dataclass(frozen=True)
class StartRequest:
    start: O.SessionStart
    chunks: int
    seed: int
    #: per chunk, the keys of each latent frame ("" = none), from ``camera_action_script``
    script: tuple[tuple[str, ...], ...]
    image_ignored: bool
    config: dict = field(default_factory=dict)  # the accepted request, as video.start echoes it


def invalid(why: str) -> str:
    return O.INVALID_START.format(why)


def parse_start(raw: str, cfg, policy: StartPolicy) -> StartRequest | str:
    """The accepted request, or the one error line to send (production's text where it has one)."""
    if len(raw) > O.MAX_START_MESSAGE_CHARS:
        return O.START_TOO_LARGE
    try:
        msg = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return O.START_BAD_JSON
    if not isinstance(msg, dict):
        return O.START_NOT_OBJECT
    if msg.get("type") != "session.start":
        return O.EXPECTED_START.format(msg.get("type"))
    if msg.get("format", O.FORMAT) != O.FORMAT:
        return O.BAD_FORMAT
    try:
        start = msgspec.convert(msg, O.SessionStart)
    except msgspec.ValidationError as e:
        return invalid(one_line(e))
    if start.model is not None and policy.model is not None and start.model != policy.model:
        return O.MODEL_MISMATCH.format(start.model, policy.model)
    return _fit_preset(msg, start, cfg, policy)


def _fit_preset(msg: dict, start: O.SessionStart, cfg, policy: StartPolicy) -> StartRequest | str:
    """The harness's own refusals: what this server's preset (fixed at launch) cannot generate."""
    v, lat = cfg.video, cfg.video.frames_per_chunk
    unsupported = [k for k in O.UNSUPPORTED_START_FIELDS if msg.get(k) not in (None, False)]
    if unsupported:
        return invalid(f"{', '.join(unsupported)} not supported by this server (it generates its preset {cfg.name!r} as is)")
    if start.image_reference is not None and policy.image_reference != "ignore":
        return invalid("image_reference is not supported by this server (a session is conditioned on the synthetic "
                       "image of its seed); its operator may accept and ignore it (--image-reference ignore)")
    if (start.width, start.height) not in ((None, None), (v.width, v.height)):
        return invalid(f"width x height {start.width}x{start.height} does not match the server's {v.width}x{v.height} "
                       f"(preset {cfg.name!r}; the KV cache geometry is fixed at launch)")
    if start.fps is not None and start.fps != v.fps:
        return invalid(f"fps {start.fps:g} does not match the server's {v.fps}")
    shift = start.flow_shift if start.flow_shift is not None else (start.extra_params.flow_shift if start.extra_params else None)
    if shift is not None and shift != cfg.schedule.flow_shift:
        return invalid(f"flow_shift {shift:g} does not match the server's {cfg.schedule.flow_shift:g} (fixed at launch)")
    seed = cfg.runtime.seed if start.seed is None else start.seed
    if not 0 <= seed <= MAX_SEED:
        return invalid(f"seed {seed} is out of this server's range 0-{MAX_SEED}")
    chunks = v.chunks_per_session if start.num_frames is None else frames_to_chunks(start.num_frames, lat)
    if isinstance(chunks, str):
        return invalid(chunks)
    if err := session_frames_error(chunks, lat):
        return invalid(err)
    script = _script(start, chunks, lat)
    if isinstance(script, str):
        return invalid(script)
    config = msgspec.to_builtins(start)
    config.pop("type", None)
    return StartRequest(start=start, chunks=chunks, seed=seed, script=script,
                        image_ignored=start.image_reference is not None, config=config)


def frames_to_chunks(num_frames: int, latent_per_chunk: int) -> int | str:
    """Whole chunks in ``num_frames`` pixel frames — (chunks·L − 1)·4 + 1 — or why not."""
    chunks = ((num_frames - 1) // O.TEMPORAL_COMPRESSION + 1) // latent_per_chunk
    if chunks < 1 or (chunks * latent_per_chunk - 1) * O.TEMPORAL_COMPRESSION + 1 != num_frames:
        near = max(1, chunks)
        return (f"num_frames {num_frames} is not a whole number of chunks: (chunks*{latent_per_chunk} - 1)*"
                f"{O.TEMPORAL_COMPRESSION} + 1, e.g. {(near * latent_per_chunk - 1) * O.TEMPORAL_COMPRESSION + 1} for {near}")
    return chunks


def _script(start: O.SessionStart, chunks: int, lat: int) -> tuple[tuple[str, ...], ...] | str:
    raw = start.extra_params.camera_action_script if start.extra_params else None
    if raw is None:
        return ()
    if len(raw) < chunks:
        return f"extra_params.camera_action_script has {len(raw)} chunks, num_frames asks for {chunks}"
    if lat != O.LATENT_FRAMES_PER_CHUNK:
        return f"camera_action_script holds 3 latent frames per chunk; this server's preset has {lat}"
    try:
        return tuple(tuple(normalize_action(keys, f) for f, keys in enumerate(chunk)) for chunk in raw[:chunks])
    except HarnessError as e:
        return f"extra_params.camera_action_script: {e}"


@dataclass(frozen=True)
class InteractionRequest:
    event_id: str
    prompt: str | None
    keys: str | None  # camera keys held from the applying chunk on (canonical order), or None


@dataclass(frozen=True)
class Refusal:
    message: str
    code: str | None = None
    event_id: str | None = None


def parse_interaction(msg: dict[str, Any]) -> InteractionRequest | Refusal:
    """Production's checks of ``session.interaction``, in its order, then what the harness can apply."""
    interaction = msg.get("interaction")
    if not isinstance(interaction, dict):
        return Refusal(O.NO_INTERACTION)
    event_id = interaction.get("event_id")
    if event_id is None:
        event_id = uuid.uuid4().hex
    elif not isinstance(event_id, str) or not event_id:
        return Refusal(O.BAD_EVENT_ID)
    event = interaction.get("event")
    if not isinstance(event, dict):
        return Refusal(O.NO_EVENT)
    prompt, mm = event.get("prompt"), event.get("multi_modal_data")
    has_prompt = isinstance(prompt, str) and bool(prompt.strip())
    has_mm = isinstance(mm, dict) and bool(mm)
    if not has_prompt and not has_mm:
        return Refusal(O.EMPTY_EVENT)
    if prompt is not None and not has_prompt:
        return Refusal(O.BAD_PROMPT)
    if mm is not None and not has_mm:
        return Refusal(O.BAD_MM)
    for modality, payload in (mm or {}).items():
        if not isinstance(payload, dict):
            return Refusal(O.BAD_MODALITY.format(modality))
    if event.get("negative_prompt") is not None:
        return Refusal(O.NO_NEGATIVE_PROMPT)
    tc = interaction.get("transition_chunks")
    if tc is not None:
        if isinstance(tc, bool) or not isinstance(tc, (int, float)) or (isinstance(tc, float) and not tc.is_integer()):
            return Refusal(O.BAD_TRANSITION)
        if tc < 0:
            return Refusal(O.NEGATIVE_TRANSITION)
    keys = None
    if has_mm:
        keys = _camera_keys(mm)
        if isinstance(keys, Refusal):
            return Refusal(keys.message, keys.code, event_id)
    return InteractionRequest(event_id=event_id, prompt=prompt if has_prompt else None, keys=keys)


def _camera_keys(mm: dict) -> str | Refusal:
    """The harness applies one modality, ``camera`` (the documented extension); production would
    hand any other to its engine, so here it fails as an engine refusal does there."""
    other = sorted(set(mm) - {"camera"})
    if other:
        return Refusal(f"{O.INTERACTION_FAILED}: multi_modal_data {other} not supported (this server applies 'camera')",
                       "interaction_failed")
    try:
        cam = msgspec.convert(mm["camera"], O.CameraInput)
        return normalize_action(cam.keys)
    except (msgspec.ValidationError, HarnessError) as e:
        return Refusal(f"{O.INTERACTION_FAILED}: multi_modal_data['camera']: {one_line(e)}", "interaction_failed")
