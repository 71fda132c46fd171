"""The event schema: one record per chunk per session, one timestamp per boundary (DESIGN §4).

This module is the contract between the processes that record time and the pure code that turns
it into figures. Every timestamp is an integer from ``time.monotonic_ns()`` on the one host clock;
a boundary that did not happen is ``None`` and is left out of ``events.jsonl`` — a missing value is
never replaced by a guess, so every derived figure can say how many samples it had to skip.

Storage in a run directory:

- ``events.jsonl``: one ``ChunkEvent`` per line.
- ``sessions.jsonl``: one ``SessionStart`` per line. TTFC needs the moment the session began,
  which belongs to no chunk (a session cancelled before its first chunk has no chunk at all).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence, TypeVar

import msgspec

#: Chunk boundaries in data-flow order; a chunk crosses them in exactly this order.
BOUNDARIES: tuple[str, ...] = (
    "submit",
    "dit_start",
    "dit_end",
    "latent_ready",
    "decode_submit",
    "decode_start",
    "decode_end",
    "gpu_ready",
    "cpu_ready",
    "received",
    "encoded",
    "delivered",
)

EVENTS_FILE = "events.jsonl"
SESSIONS_FILE = "sessions.jsonl"


class EventFormatError(ValueError):
    """A line of an events/sessions file does not decode to the schema."""


class ChunkEvent(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Everything measured about one chunk of one session.

    ``blocked_ns`` maps a stage name (e.g. ``"dit"``, ``"vae"``, ``"encode"``) to the time that
    stage's producer spent blocked on a full queue or ring while handling this chunk.
    """

    session: int
    epoch: int
    chunk: int
    frames: int
    submit: int | None = None
    dit_start: int | None = None
    dit_end: int | None = None
    latent_ready: int | None = None
    decode_submit: int | None = None
    decode_start: int | None = None
    decode_end: int | None = None
    gpu_ready: int | None = None
    cpu_ready: int | None = None
    received: int | None = None
    encoded: int | None = None
    delivered: int | None = None
    gpu_ms: dict[str, float] = {}
    blocked_ns: dict[str, int] = {}
    cancelled: bool = False
    #: the engine group that served the session (``serve --listen --replicas N``; absent otherwise)
    replica: int | None = None

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.session, self.epoch, self.chunk)

    def at(self, boundary: str) -> int | None:
        if boundary not in _BOUNDARY_SET:
            raise KeyError(f"unknown boundary {boundary!r}")
        return getattr(self, boundary)

    def present(self) -> dict[str, int]:
        """The boundaries this chunk reached, in data-flow order."""
        return {b: t for b in BOUNDARIES if (t := getattr(self, b)) is not None}


class SessionStart(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """When a session began (the client's start request reached the driver), and how it ended."""

    session: int
    epoch: int
    start_ns: int
    cancelled: bool = False
    replica: int | None = None  # as ChunkEvent.replica

    @property
    def key(self) -> tuple[int, int]:
        return (self.session, self.epoch)


_BOUNDARY_SET = frozenset(BOUNDARIES)
_T = TypeVar("_T", ChunkEvent, SessionStart)
_encoder = msgspec.json.Encoder()


def encode_line(record: ChunkEvent | SessionStart) -> bytes:
    """One JSONL line (newline included), for writers that append as chunks complete."""
    return _encoder.encode(record) + b"\n"


def merge(a: ChunkEvent, b: ChunkEvent) -> ChunkEvent:
    """Combine partial records of the same chunk measured in different processes.

    A boundary recorded by both with different values is a bug in the recorders, not something
    to resolve by picking one, so it raises.
    """
    if a.key != b.key:
        raise ValueError(f"cannot merge events of different chunks {a.key} and {b.key}")
    if a.frames != b.frames:
        raise ValueError(f"chunk {a.key}: frames disagree ({a.frames} vs {b.frames})")
    changes: dict[str, object] = {}
    for name in BOUNDARIES:
        ta, tb = getattr(a, name), getattr(b, name)
        if ta is not None and tb is not None and ta != tb:
            raise ValueError(f"chunk {a.key}: boundary {name} recorded twice ({ta} vs {tb})")
        changes[name] = ta if ta is not None else tb
    for field in ("gpu_ms", "blocked_ns"):
        da, db = getattr(a, field), getattr(b, field)
        clash = {k for k in da.keys() & db.keys() if da[k] != db[k]}
        if clash:
            raise ValueError(f"chunk {a.key}: {field} keys {sorted(clash)} recorded twice")
        changes[field] = {**da, **db}
    changes["cancelled"] = a.cancelled or b.cancelled
    return msgspec.structs.replace(a, **changes)


# ---- files ---------------------------------------------------------------------------------


def _write(path: str | Path, records: Iterable[msgspec.Struct]) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for r in records:
            f.write(encode_line(r))
    tmp.replace(path)  # readers never see a half-written file


def _read(path: str | Path, type_: type[_T], tolerate_partial_tail: bool) -> list[_T]:
    decoder = msgspec.json.Decoder(type_)
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    out: list[_T] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(decoder.decode(line))
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            # A process killed mid-write leaves at most one unterminated last line; that line is
            # the only thing a crashed run may lose.
            if tolerate_partial_tail and i == len(lines) and not data.endswith(b"\n"):
                break
            raise EventFormatError(f"{path}:{i}: {e}") from None
    return out


def write_events(path: str | Path, events: Iterable[ChunkEvent]) -> None:
    _write(path, events)


def read_events(path: str | Path, *, tolerate_partial_tail: bool = False) -> list[ChunkEvent]:
    return _read(path, ChunkEvent, tolerate_partial_tail)


def write_sessions(path: str | Path, sessions: Iterable[SessionStart]) -> None:
    _write(path, sessions)


def read_sessions(path: str | Path, *, tolerate_partial_tail: bool = False) -> list[SessionStart]:
    return _read(path, SessionStart, tolerate_partial_tail)


def read_run(run_dir: str | Path, *, tolerate_partial_tail: bool = False) -> tuple[list[ChunkEvent], list[SessionStart]]:
    """``events.jsonl`` and ``sessions.jsonl`` of a run (no sessions file means no session starts)."""
    run_dir = Path(run_dir)
    events = read_events(run_dir / EVENTS_FILE, tolerate_partial_tail=tolerate_partial_tail)
    spath = run_dir / SESSIONS_FILE
    sessions = read_sessions(spath, tolerate_partial_tail=tolerate_partial_tail) if spath.exists() else []
    return events, sessions


# ---- validation ----------------------------------------------------------------------------


def _where(key: tuple[int, ...]) -> str:
    return f"session {key[0]} epoch {key[1]}" + (f" chunk {key[2]}" if len(key) > 2 else "")


def order_violations(event: ChunkEvent) -> list[str]:
    """Boundaries of one chunk that are out of data-flow order (equal timestamps are allowed)."""
    out = []
    prev: tuple[str, int] | None = None
    for name, t in event.present().items():
        if t < 0:
            out.append(f"{_where(event.key)}: {name} is negative ({t})")
        if prev is not None and t < prev[1]:
            out.append(f"{_where(event.key)}: {name} ({t}) before {prev[0]} ({prev[1]})")
        # Compare against the latest earlier boundary so that one bad value is reported once per
        # neighbour, not once per every later boundary.
        if prev is None or t >= prev[1]:
            prev = (name, t)
    return out


def validate_events(events: Sequence[ChunkEvent], sessions: Sequence[SessionStart] = ()) -> list[str]:
    """Every way the table breaks the schema's ordering rules; empty when it is consistent.

    Checks: boundaries of a chunk follow the data flow; no chunk is recorded twice; within a
    session every boundary advances with the chunk index (stages are FIFO per session); frames are
    positive (zero only for a cancelled chunk that never reached host memory); a session start precedes every boundary of its chunks and is recorded once.
    """
    out: list[str] = []
    seen: set[tuple[int, int, int]] = set()
    by_session: dict[tuple[int, int], list[ChunkEvent]] = {}
    for e in events:
        if e.key in seen:
            out.append(f"{_where(e.key)}: recorded more than once")
            continue
        seen.add(e.key)
        if e.chunk < 0:
            out.append(f"{_where(e.key)}: negative chunk index")
        # A cancelled chunk that never reached the VAE has no frames: 0 is its honest count.
        if e.frames < 0 or (e.frames == 0 and not (e.cancelled and e.cpu_ready is None)):
            out.append(f"{_where(e.key)}: frames must be positive, got {e.frames}")
        out.extend(order_violations(e))
        by_session.setdefault((e.session, e.epoch), []).append(e)

    for key, chunks in sorted(by_session.items()):
        chunks.sort(key=lambda e: e.chunk)
        for b in BOUNDARIES:
            last: tuple[int, int] | None = None
            for e in chunks:
                t = e.at(b)
                if t is None:
                    continue
                if last is not None and t < last[1]:
                    out.append(f"{_where(key)}: {b} of chunk {e.chunk} ({t}) before chunk {last[0]} ({last[1]})")
                last = (e.chunk, t)

    starts: dict[tuple[int, int], SessionStart] = {}
    for s in sessions:
        if s.key in starts:
            out.append(f"{_where(s.key)}: session start recorded more than once")
            continue
        starts[s.key] = s
        if s.start_ns < 0:
            out.append(f"{_where(s.key)}: negative start_ns")
        for e in by_session.get(s.key, ()):
            present = e.present()
            if present:
                name = min(present, key=present.__getitem__)
                if present[name] < s.start_ns:
                    out.append(f"{_where(e.key)}: {name} ({present[name]}) before session start ({s.start_ns})")
    return out
