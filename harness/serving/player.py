"""A player, not a script: key events at their own times, and the rule that turns them into a chunk's actions.

A *trace* is a list of ``(t, keys)`` events: at ``t`` seconds after the session started, the
player's held keys become ``keys`` (``""``: nothing held). It comes from a file (JSON lines
``{"t": 0.5, "keys": "wj"}`` or CSV with a ``t,keys`` header; an ``id`` field or column is
optional) or is built in: ``hold-and-turn``, ``taps`` and ``random:SEED`` (holds of random length,
pauses and turns). Every event has an id unique in its trace.

**The rule** (``latest_wins``), the one the server applies and the figures assume: the key state
is held across chunks; at each chunk boundary — the moment the driver takes the chunk's actions,
just before it submits the chunk — the latest event received since the previous boundary sets the
state, that state applies to every latent frame of the chunk, and every event received since the
previous boundary is *applied at this chunk* (the ones a later event superseded included: they had
their chance and lost it). Chosen over a per-latent-frame queue because it is how a game samples
input (the state at the frame it draws), it adds no queueing delay behind earlier events, and a
chunk's latent frames are generated together anyway: spreading events over them would date an
event to a frame the model does not produce before the others. Its cost: a tap shorter than a
chunk interval may be superseded before any chunk shows it.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from pathlib import Path

import msgspec

from harness.engine.keys import normalize_action
from harness.errors import HarnessError

BUILT_IN = ("hold-and-turn", "taps", "random:SEED")
MAX_EVENTS = 100_000
MAX_T_S = 3600.0
#: a built-in trace runs this long; the player stops at the session's last chunk anyway
BUILT_IN_SPAN_S = 120.0
MAX_ID_CHARS = 64


class TraceEvent(msgspec.Struct, frozen=True):
    t_s: float  # seconds after the session started (the client's receipt of ``started``)
    keys: str  # canonical (keys.KEYS order); "" releases every key
    event_id: str


def latest_wins(held: str, pending: list[tuple[str, str]]) -> tuple[str, list[str]]:
    """The rule at one chunk boundary. ``held``: the keys in force; ``pending``: (event id, keys)
    received since the previous boundary, in arrival order. Returns the keys of every latent frame
    of this chunk and the ids applied at it."""
    keys = pending[-1][1] if pending else held
    return keys, [eid for eid, _ in pending]


# ---- built-in traces -------------------------------------------------------------------------
def _from_holds(holds: list[tuple[float, str]], prefix: str) -> list[TraceEvent]:
    """(duration, keys) one after another from t = 0.25 s, until BUILT_IN_SPAN_S."""
    out, t = [], 0.25
    while t < BUILT_IN_SPAN_S:
        for dur, keys in holds:
            out.append(TraceEvent(round(t, 4), keys, f"{prefix}{len(out)}"))
            t += dur
    return out


def hold_and_turn() -> list[TraceEvent]:
    """Walk forward, turn left while walking, walk, stop, turn right, stop: long holds."""
    return _from_holds([(1.5, "w"), (0.6, "wj"), (1.0, "w"), (0.5, ""), (0.6, "l"), (0.8, "")], "h")


def taps() -> list[TraceEvent]:
    """Short presses (0.12 s) of w, d, j and a, 0.6 s apart: shorter than a chunk interval."""
    return _from_holds([(0.12, "w"), (0.48, ""), (0.12, "d"), (0.48, ""), (0.12, "j"), (0.48, ""), (0.12, "a"),
                        (0.48, "")], "t")


#: what a player holds, with weights: mostly forward, turning while walking, looking around
_HUMAN_KEYS = (("w", 8), ("wj", 3), ("wl", 3), ("j", 2), ("l", 2), ("a", 1), ("d", 1), ("s", 1), ("i", 1), ("k", 1))


def random_trace(seed: int) -> list[TraceEvent]:
    """Holds of 0.2-2 s (log-uniform: many short, some long), each followed half the time by a
    pause of 0.1-1 s with nothing held, else by the next hold at once; same seed, same trace."""
    rng = random.Random(seed)
    keys, weights = zip(*_HUMAN_KEYS)
    out, t = [], rng.uniform(0.1, 0.6)
    while t < BUILT_IN_SPAN_S:
        k = rng.choices(keys, weights)[0]
        out.append(TraceEvent(round(t, 4), k, f"r{len(out)}"))
        t += math.exp(rng.uniform(math.log(0.2), math.log(2.0)))
        if rng.random() < 0.5:
            out.append(TraceEvent(round(t, 4), "", f"r{len(out)}"))
            t += rng.uniform(0.1, 1.0)
    return out


# ---- trace files -----------------------------------------------------------------------------
def _event(where: str, t: object, keys: object, eid: object, index: int) -> TraceEvent:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 <= t <= MAX_T_S:
        raise HarnessError(f"{where}: t must be a number of seconds in [0, {MAX_T_S:g}], got {t!r}")
    try:
        canon = normalize_action(keys, index)
    except HarnessError as e:
        raise HarnessError(f"{where}: {e}") from None
    if eid is None or eid == "":
        eid = f"e{index}"
    if not isinstance(eid, str) or len(eid) > MAX_ID_CHARS:
        raise HarnessError(f"{where}: id must be a string of at most {MAX_ID_CHARS} characters, got {eid!r}")
    return TraceEvent(float(t), canon, eid)


def _json_lines(text: str, name: str) -> list[TraceEvent]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise HarnessError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not {"t", "keys"} <= obj.keys() or obj.keys() - {"t", "keys", "id"}:
            raise HarnessError(f"{where}: expected an object with t, keys and optionally id, got {line.strip()[:80]!r}")
        out.append(_event(where, obj["t"], obj["keys"], obj.get("id"), len(out)))
    return out


def _csv(text: str, name: str) -> list[TraceEvent]:
    rows = list(csv.reader(io.StringIO(text)))
    if not rows or [c.strip() for c in rows[0]] not in (["t", "keys"], ["t", "keys", "id"]):
        raise HarnessError(f"{name}:1: expected the header t,keys (or t,keys,id), got {','.join(rows[0]) if rows else 'nothing'!r}")
    width = len(rows[0])
    out = []
    for n, row in enumerate(rows[1:], 2):
        if not row:
            continue
        where = f"{name}:{n}"
        if len(row) != width:
            raise HarnessError(f"{where}: expected {width} columns, got {len(row)}")
        try:
            t = float(row[0])
        except ValueError:
            raise HarnessError(f"{where}: t must be a number of seconds, got {row[0]!r}") from None
        out.append(_event(where, t, row[1].strip(), row[2].strip() if width == 3 else None, len(out)))
    return out


def check_trace(events: list[TraceEvent], name: str) -> list[TraceEvent]:
    if not events:
        raise HarnessError(f"{name}: the trace has no events")
    if len(events) > MAX_EVENTS:
        raise HarnessError(f"{name}: {len(events)} events, at most {MAX_EVENTS}")
    seen: set[str] = set()
    for i, ev in enumerate(events):
        if i and ev.t_s < events[i - 1].t_s:
            raise HarnessError(f"{name}: event {ev.event_id!r} at t={ev.t_s:g} s comes before the previous one "
                               f"(t={events[i - 1].t_s:g} s): times must not decrease")
        if ev.event_id in seen:
            raise HarnessError(f"{name}: event id {ev.event_id!r} is used twice")
        seen.add(ev.event_id)
    return events


def read_trace_file(path: Path) -> list[TraceEvent]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise HarnessError(f"--player {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    parse = _csv if path.suffix.lower() == ".csv" else _json_lines
    return check_trace(parse(text, str(path)), str(path))


def parse_trace(spec: str) -> list[TraceEvent]:
    """``--player TRACE``: a built-in trace's name or a trace file (``.csv``: CSV; else JSON lines)."""
    if spec == "hold-and-turn":
        return hold_and_turn()
    if spec == "taps":
        return taps()
    if spec.startswith("random:"):
        seed = spec.split(":", 1)[1]
        if not seed.isdigit():
            raise HarnessError(f"--player {spec}: random:SEED needs a non-negative integer seed")
        return random_trace(int(seed))
    path = Path(spec)
    if not path.is_file():
        raise HarnessError(f"--player {spec!r}: neither a built-in trace ({', '.join(BUILT_IN)}) nor a file")
    return read_trace_file(path)
