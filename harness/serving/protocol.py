"""The WebSocket protocol of ``serve --listen``: typed, size-limited, schema-checked JSON.

Control messages are JSON text frames, one msgspec struct each, told apart by their ``type`` tag;
unknown fields, wrong types and out-of-range values are refused by the decoder itself, so the
server never sees a half-valid message and nothing is ever unpickled. Media travel as binary
frames: each ``chunk`` header is followed by exactly one binary frame holding that chunk's
FFV1/Matroska fragment (the first fragment carries the container header, so the fragments of a
session concatenated in order are a playable file).

A session, as the client sees it::

    → start            ← started
    → actions (c = 0, 1, … ahead of need; answer every need_actions at once)
    ← chunk c, <binary fragment c>      → ack c   (carries the receipt time: the chunk's ``delivered``;
                                                   sent once the client is ready for more: it returns credit)
    …                                   → cancel  (any time; so does closing the socket)
    ← ended            (cancelled or not: the server's cleanup invariants, hashes)

When every replica is busy, ``start`` is answered with ``in_queue`` (position; again as the queue
moves) and then ``started``, or ``busy`` when the queue is full or the wait times out. While a
session runs the server may send ``stall`` (a stage silent past the stall bound, its rank named);
a session that runs past its wall-clock cap, or whose replica dies, ends with the reason.

A player session (``start`` with ``input: "player"``) has no ``need_actions`` and no ``actions``:
the client sends ``input`` (event id, keys) at any time and gets ``queued`` (its arrival time) at
once; at each chunk boundary the server applies what has arrived by the rule of
``harness.serving.player.latest_wins``, and the chunk's header lists the ids it applied (a
two-phase receipt: queued, then applied at chunk k).

The server asks for chunk c's actions (``need_actions``) when it is about to generate c and waits
for them (with a timeout that cancels), so a client must not hold them back until it has seen
chunk c−1: the driver cannot forward c−1's media while it waits. ``window`` chunks may be sent and
not yet acknowledged; beyond that the server stops producing (backpressure, not buffering).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta

#: the endpoint's paths: sessions, and the health probe
PATH = "/session"
HEALTH_PATH = "/healthz"

#: one text message; media frames are the server's and bounded by the chunk size
MAX_CONTROL_BYTES = 64 * 1024
MAX_PROMPT_CHARS = 2000
MAX_CHUNKS = 100_000

Seed = Annotated[int, Meta(ge=0, le=2**31 - 1)]
ChunkIndex = Annotated[int, Meta(ge=0, lt=MAX_CHUNKS)]
#: one latent frame's keys: a string ("wj") or, as production sends them, a list (["w", "j"])
ActionKeys = Annotated[str, Meta(max_length=16)] | Annotated[list[Annotated[str, Meta(max_length=1)]], Meta(max_length=16)]
Seconds = Annotated[float, Meta(gt=0, le=3600)]


class _Wire(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


# ---- client → server ---------------------------------------------------------------------------
class Start(_Wire, tag="start"):
    preset: Annotated[str, Meta(max_length=64)]  # must equal the server's preset name
    seed: Seed
    #: "" means "seed {seed}": the same (seed, prompt, actions) gives the same video on any session
    prompt: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)] = ""
    chunks: Annotated[int, Meta(ge=1, le=MAX_CHUNKS)] | None = None  # default: the preset's
    image: Annotated[bytes, Meta(max_length=8 << 20)] | None = None  # reserved: conditioning image
    #: the client's /proc boot id: equal to the server's means one monotonic clock, so the
    #: client's receipt stamps can be used as ``delivered`` directly
    boot_id: Annotated[str, Meta(max_length=64)] = ""
    action_timeout_s: Seconds | None = None  # at most the server's own limit
    #: a wall-clock cap for this session, at most the server's (``--session-cap``): it is cancelled past it
    session_cap_s: Annotated[float, Meta(gt=0, le=7 * 86400)] | None = None
    #: "script": the server asks each chunk's actions (need_actions); "player": the client sends
    #: ``input`` events whenever it likes and each chunk boundary applies what has arrived
    input: Literal["script", "player"] = "script"


class Actions(_Wire, tag="actions"):
    chunk: ChunkIndex
    actions: Annotated[list[ActionKeys], Meta(max_length=64)]  # one per latent frame


class Input(_Wire, tag="input"):
    """A player session's key event: from now on ``keys`` are held (``""``: none)."""

    event_id: Annotated[str, Meta(min_length=1, max_length=64)]  # unique in the session
    keys: ActionKeys
    sent_ns: Annotated[int, Meta(ge=0)]  # client's time.monotonic_ns() when it was sent


class Ack(_Wire, tag="ack"):
    chunk: ChunkIndex
    received_ns: Annotated[int, Meta(ge=0)]  # client's time.monotonic_ns() when the fragment was read


class Cancel(_Wire, tag="cancel"):
    pass


class StatusRequest(_Wire, tag="status"):
    #: the server's operator token (``operator.token`` in its run directory): with it, ``last`` is the
    #: last session whoever ran it; without it, only the connection that ran that session sees it
    token: Annotated[str, Meta(max_length=64)] = ""


ClientMessage = Union[Start, Actions, Input, Ack, Cancel, StatusRequest]


# ---- server → client ---------------------------------------------------------------------------
class Started(_Wire, tag="started"):
    session: int
    epoch: int
    seed: int
    preset: str
    chunks: int
    latent_frames_per_chunk: int  # actions per chunk
    fps: int
    width: int
    height: int
    window: int
    action_timeout_s: float
    input: str = "script"
    same_clock: bool = False  # the client's boot id is the server's: one monotonic clock on both sides
    replica: int = 0  # the engine group serving this session for its whole life (``--replicas``)
    session_cap_s: float | None = None  # the session is cancelled when it runs longer than this (wall clock)


class NeedActions(_Wire, tag="need_actions"):
    session: int
    chunk: int


class Queued(_Wire, tag="queued"):
    """The first receipt of an ``input`` event, sent the moment it arrived. ``late``: it arrived
    after the session's last chunk boundary, so no chunk will apply it."""

    session: int
    event_id: str
    received_ns: int  # server clock
    late: bool = False


class ChunkHeader(_Wire, tag="chunk"):
    """Announces the binary frame that follows: chunk ``chunk``'s Matroska fragment."""

    session: int
    chunk: int
    frames: int
    nbytes: int
    pixel_sha256: str
    frame_sha256: list[str]
    event: dict  # the chunk's boundaries so far (submit … encoded), integer ns, server clock
    #: player sessions: the second receipt — the input events applied at this chunk's boundary,
    #: in arrival order, and that boundary (the driver took the chunk's actions; server clock)
    applied: list[str] = []
    boundary_ns: int | None = None


class ChunkHash(_Wire, tag="hash"):
    chunk: int
    latent_sha256: str
    pixels_sha256: str


class Ended(_Wire, tag="ended"):
    """A session is over. The cleanup figures let a client (or a scenario) check the server's
    invariants after a cancel: no KV block, ring slot or media file left behind."""

    session: int
    cancelled: bool
    reason: str  # "" when it ran to the end
    chunks: int  # requested
    chunks_generated: int  # submitted to the DiT (finished or discarded)
    chunks_sent: int
    chunks_acked: int
    frames_sent: int
    kv_blocks_used: int
    ring_free: int
    ring_slots: int
    media_discarded: bool
    max_unacked: int  # most chunks in flight to the client at once (≤ window)
    client_blocked_ns: int  # producer time spent waiting for acknowledgements
    delivered_clock: str  # "client" (same host clock) or "ack-receipt" (server time the ack arrived)
    hashes: list[ChunkHash] = []  # per chunk, sessions that ran to the end
    #: player sessions: per chunk generated, the input events its boundary applied (delivered or not)
    applied: list[list[str]] = []
    replica: int = 0  # the engine group that served it


class InQueue(_Wire, tag="in_queue"):
    """The answer to a ``start`` when every replica is busy: the session waits, ``position`` 1 being
    next (sent again whenever the queue moves). ``started`` follows once a replica frees, or ``busy``
    when the wait passes ``timeout_s``; the client may leave (cancel, or close) at any time."""

    position: int
    limit: int  # sessions that may wait at once (``--queue``)
    timeout_s: float  # the longest wait (``--queue-timeout``)


class Stall(_Wire, tag="stall"):
    """A stage of the session's replica owes a reply and has made no progress for ``after_s``
    (``runtime.stall_report_s``): the session is not over; it fails only after ``rank_timeout_s``."""

    session: int
    stage: str  # "dit", "vae" or "encoder": whose reply is owed
    rank: str  # the rank to blame: a stopped one when there is one (e.g. "encoder (pid 123, stopped)")
    chunk: int
    after_s: float
    message: str


class Error(_Wire, tag="error"):
    message: str  # one line
    fatal: bool = False  # the server is going down (e.g. a rank died)


class Busy(_Wire, tag="busy"):
    message: str


class Status(_Wire, tag="status"):
    preset: str
    busy: bool
    sessions_served: int
    last: Ended | None = None
    waiting: int = 0  # sessions in the admission queue


ServerMessage = Union[Started, NeedActions, Queued, ChunkHeader, Ended, InQueue, Stall, Error, Busy, Status]

_enc = msgspec.json.Encoder()
_client_dec = msgspec.json.Decoder(ClientMessage)
_server_dec = msgspec.json.Decoder(ServerMessage)


def encode(msg: _Wire) -> str:
    return _enc.encode(msg).decode()


def decode_client(text: str | bytes) -> ClientMessage:
    return _client_dec.decode(text)


def decode_server(text: str | bytes) -> ServerMessage:
    return _server_dec.decode(text)


def one_line(e: BaseException | str) -> str:
    text = str(e) if not isinstance(e, str) else e
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return first[:500]


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
