"""vLLM-Omni's realtime video API (``WS /v1/realtime/video``), as typed messages.

Production's handler (``vllm_omni.entrypoints.openai.serving_video_output_stream``) defines the
wire; this module restates it as msgspec structs so the harness can serve it (``serve --listen
--api vllm-omni``) and speak it as a client, without vLLM installed. A session::

    → session.start        (VideoGenerationRequest fields; format "m4s")
    ← video.start          (request_id, format, config: the accepted request)
    ← video.chunk_metadata (kind "media", num_frames, generation/transport chunk index, …)
    ← <binary: that chunk's fragmented MP4; the first one starts with ftyp+moov>
    …                      → session.interaction  ← session.interaction.queued
                           → session.ping         ← session.pong
                           → session.stop
    ← video.chunk_metadata (kind "trailer") + <binary> when the muxer has closing bytes
    ← session.done         (chunks sent, stopped)
    ← error                (message; code / request_id / event_id where production sends them)

Decoding is asymmetric on purpose. Server messages decode leniently (unknown fields ignored):
production may add fields, and the harness adds its own (``HARNESS_FIELDS``) that production's
clients ignore. Client messages are checked strictly by the server, in production's order and
with production's error texts (the constants below), so a client sees the same refusals from the
harness as from vLLM-Omni.

The harness's extensions, all optional and ignored by production's clients:

- ``video.chunk_metadata`` carries the chunk's server-side boundaries (``server_timestamps``:
  submit … encoded, integer ns of the server's monotonic clock), that clock's ``server_boot_id``,
  the per-frame SHA-256 of the pixels (``frame_sha256``), and ``applied_event_ids``: the
  interactions this chunk is the first to carry (a two-phase receipt: ``queued`` when the
  message arrived, applied at chunk k). Rule: everything queued before chunk k takes its
  actions (``interaction_cutoff_ns``, just before its submit) is applied at chunk k; later camera
  events win over earlier ones; prompt events are listed in ``unrendered_event_ids`` instead (the
  engine keeps one prompt per session), and events queued after the last chunk's cutoff in
  ``session.done``'s ``unapplied_event_ids``: every queued event is accounted for exactly once.
- a camera interaction: ``event.multi_modal_data.camera = {"keys": ["w", "d"]}``: the keys
  held from the chunk that applies it on (every latent frame), until the next camera event.
  It passes production's own interaction checks (a non-empty object per modality).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

PATH = "/v1/realtime/video"
FORMAT = "m4s"

# ---- production's limits (the handler's module constants) ----------------------------------------
START_TIMEOUT_S = 10.0
STALL_TIMEOUT_S = 60.0
MAX_START_MESSAGE_CHARS = 4 * 1024 * 1024
MAX_CONTROL_MESSAGE_CHARS = 128 * 1024
#: what one WebSocket frame may hold before the transport itself closes the connection (1009),
#: as production's ASGI server does by default; above the start limit so that limit answers first
MAX_FRAME_BYTES = 16 * 1024 * 1024

#: latent frames per AR block (= per chunk) and the causal VAE's temporal expansion
LATENT_FRAMES_PER_CHUNK = 3
TEMPORAL_COMPRESSION = 4

# ---- production's error texts --------------------------------------------------------------------
START_TIMEOUT = "Timeout waiting for session.start"
START_TOO_LARGE = "session.start message too large"
START_BAD_JSON = "Invalid JSON in session.start"
START_NOT_OBJECT = "session.start must be a JSON object"
EXPECTED_START = "Expected session.start, got: {}"
BAD_FORMAT = "Invalid session.start format: expected 'm4s'."
INVALID_START = "Invalid session.start: {}"
MODEL_MISMATCH = "Model mismatch: request specifies '{}' but server is running '{}'."
STALL = "Stall timeout: no generation progress"
CONTROL_TOO_LARGE = "control message too large"
CONTROL_BAD_JSON = "Invalid JSON message"
CONTROL_NOT_OBJECT = "WebSocket messages must be JSON objects"
UNKNOWN_TYPE = "Unknown message type: {}"
NO_INTERACTION = "session.interaction requires an interaction object"
BAD_EVENT_ID = "session.interaction event_id must be a non-empty string"
NO_EVENT = "session.interaction requires event object"
EMPTY_EVENT = "session.interaction requires a non-empty event.prompt and/or non-empty event.multi_modal_data"
BAD_PROMPT = "session.interaction event.prompt must be a non-empty string when provided"
BAD_MM = "session.interaction event.multi_modal_data must be a non-empty object when provided"
BAD_MODALITY = "session.interaction multi_modal_data[{!r}] must be an object"
NO_NEGATIVE_PROMPT = "session.interaction negative_prompt is not supported in this release"
BAD_TRANSITION = "session.interaction transition_chunks must be an integer"
NEGATIVE_TRANSITION = "session.interaction transition_chunks must be >= 0"
EVENT_ID_CONFLICT = "event_id_conflict"  # production sends the code as the message too
INTERACTION_FAILED = "Failed to apply interaction"


def chunks_for_num_frames(num_frames: int) -> int:
    """Chunks a request of ``num_frames`` pixel frames generates (production's formula)."""
    return ((num_frames - 1) // TEMPORAL_COMPRESSION + 1) // LATENT_FRAMES_PER_CHUNK


def num_frames_for_chunks(chunks: int) -> int:
    """The pixel-frame count of exactly ``chunks`` chunks: (chunks·3 − 1)·4 + 1."""
    return (chunks * LATENT_FRAMES_PER_CHUNK - 1) * TEMPORAL_COMPRESSION + 1


# ---- client → server -------------------------------------------------------------------------
KeyList = list[Annotated[str, Meta(max_length=16)]]


class _Client(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    """Client messages: unset optionals are left out when encoding (production's defaults apply)."""


class ExtraParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """The ``extra_params`` this server understands; any other key is refused (production would
    pass it to the model, where the harness has nothing to pass it to)."""

    #: one entry per chunk, each the keys of its 3 latent frames: [[["w"], ["w"], []], …]
    camera_action_script: list[Annotated[list[KeyList], Meta(min_length=3, max_length=3)]] | None = None
    flow_shift: float | None = None


class SessionStart(_Client, tag="session.start", kw_only=True):
    """``session.start``: the fields of production's ``VideoGenerationRequest`` that matter here.

    Unknown fields are ignored, as production's request model ignores them; known fields that
    would change the video and that the harness cannot honour are refused by the server
    (``UNSUPPORTED_START_FIELDS``)."""

    prompt: str  # required, as in production
    model: str | None = None
    image_reference: dict[str, Any] | list[dict[str, Any]] | None = None
    width: Annotated[int, Meta(ge=1)] | None = None
    height: Annotated[int, Meta(ge=1)] | None = None
    num_frames: Annotated[int, Meta(ge=1)] | None = None
    fps: Annotated[float, Meta(ge=1)] | None = None
    seed: int | None = None
    flow_shift: float | None = None
    extra_params: ExtraParams | None = None
    format: str = FORMAT


#: request fields production honours and this server does not (refused when set)
UNSUPPORTED_START_FIELDS = ("negative_prompt", "num_inference_steps", "guidance_scale", "guidance_scale_2",
                            "true_cfg_scale", "boundary_ratio", "lora", "video_reference", "audio_reference",
                            "size", "seconds", "video_params", "quality", "sampling_params")


class CameraInput(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    keys: Annotated[KeyList, Meta(max_length=16)]  # held from the applying chunk on, every latent frame


class InteractionModalities(msgspec.Struct, kw_only=True, omit_defaults=True):
    camera: CameraInput | None = None


class InteractionEvent(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt: str | None = None
    multi_modal_data: InteractionModalities | None = None


class Interaction(msgspec.Struct, kw_only=True, omit_defaults=True):
    event: InteractionEvent
    event_id: str | None = None
    transition_chunks: int | None = None


class SessionInteraction(_Client, tag="session.interaction", kw_only=True):
    interaction: Interaction


class SessionPing(_Client, tag="session.ping", kw_only=True):
    pass


class SessionStop(_Client, tag="session.stop", kw_only=True):
    pass


ClientMessage = SessionStart | SessionInteraction | SessionPing | SessionStop


# ---- server → client -------------------------------------------------------------------------
class _Server(msgspec.Struct, tag_field="type", kw_only=True):
    """Server messages: unknown fields are ignored when decoding (production may add some)."""


class VideoStart(_Server, tag="video.start", kw_only=True):
    request_id: str
    format: str = FORMAT
    config: dict[str, Any] = {}
    #: harness extension: request fields accepted and not used (``image_reference`` under
    #: ``--image-reference ignore``); the video does not depend on them
    ignored_fields: list[str] = []


class ChunkMetadata(_Server, tag="video.chunk_metadata", kw_only=True):
    """Announces the binary frame that follows. The first block is production's; the second is
    the harness's extension (absent from production's server: then empty)."""

    request_id: str
    kind: str  # "media" | "trailer"
    num_frames: int
    byte_length: int
    generation_chunk_index: int | None = None  # None for the trailer
    transport_chunk_index: int | None = None
    started_event_ids: list[str] = []
    active_event_ids: list[str] = []
    completed_event_ids: list[str] = []
    # -- harness extension --
    applied_event_ids: list[str] = []
    #: prompt interactions this chunk acknowledged without carrying them (the engine keeps one
    #: prompt per session): reported, never claimed applied
    unrendered_event_ids: list[str] = []
    server_boot_id: str = ""
    server_timestamps: dict[str, int] = {}  # boundary → ns, server's monotonic clock
    frame_sha256: list[str] = []
    #: the server's ns at which this chunk took the queued interactions (just before its submit):
    #: an event is applied by the first chunk whose cutoff follows its arrival
    interaction_cutoff_ns: int | None = None


#: the fields ChunkMetadata adds to production's
HARNESS_FIELDS = ("applied_event_ids", "unrendered_event_ids", "server_boot_id", "server_timestamps", "frame_sha256",
                  "interaction_cutoff_ns")


class InteractionQueued(_Server, tag="session.interaction.queued", kw_only=True):
    request_id: str
    event_id: str


class SessionPong(_Server, tag="session.pong", kw_only=True):
    pass


class SessionDone(_Server, tag="session.done", kw_only=True):
    request_id: str | None = None
    chunks: int
    stopped: bool
    #: harness extension: interactions queued after the last chunk's submit, which no chunk applied
    #: (with ``applied_event_ids`` and ``unrendered_event_ids``, every queued event is accounted for once)
    unapplied_event_ids: list[str] = []


class Error(_Server, tag="error", omit_defaults=True, kw_only=True):  # unset optionals left out, as production does
    message: str
    code: int | str | None = None
    request_id: str | None = None
    event_id: str | None = None


ServerMessage = VideoStart | ChunkMetadata | InteractionQueued | SessionPong | SessionDone | Error

_enc = msgspec.json.Encoder()
_server_dec = msgspec.json.Decoder(ServerMessage)


def encode(msg: _Client | _Server) -> str:
    return _enc.encode(msg).decode()


def decode_server(text: str | bytes) -> ServerMessage:
    """A server message, unknown fields ignored; ``msgspec.ValidationError`` for an unknown type."""
    return _server_dec.decode(text)
