"""A Chrome/Perfetto trace (``trace.json``) of every chunk's stages, built from the event table.

No profiler is involved: the slices are the intervals between the boundary timestamps that the
processes recorded (DESIGN §4), so the trace is exactly as true as ``events.jsonl`` and costs
nothing at run time. Open it at ui.perfetto.dev or chrome://tracing.

Layout: one process (pid, ``process_name``) per process of the topology — driver, DiT rank 0,
VAE rank 0, encoder — and inside it one thread track per stage (``thread_name``). A stage whose
slices overlap across chunks (a queue that let the next chunk in before this one left) gets more
lanes (``ipc #2``), because the format requires slices on one track to nest. Each present stage
of a chunk is one complete ("X") slice named after the stage (``measure.stages``: the same name
means the same interval in ``summary.json`` and the report; Perfetto's per-name aggregation
gives per-stage totals), with session/epoch/chunk/frames and
the raw ns boundaries in ``args`` (plus ``gpu_ms`` / ``blocked_ns`` of the event when keyed by
the stage's name); a stage with a missing boundary has no slice. A flow
(``s``/``t``/``f``, one id per chunk) links the chunk's dit → decode → encode slices.
Times are µs (floats, ns resolution) from the earliest timestamp in the table; ``otherData.t0_ns``
keeps the origin.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Sequence

from harness.hooks.spec import path_bytes
from harness.measure.events import read_events
from harness.measure.stages import HANDOFF as HANDOFF_STAGE
from harness.measure.stages import INTERVALS

#: Case D's handoff: frames of chunk i−1 in host memory → DiT starts chunk i (same session).
HANDOFF = HANDOFF_STAGE.name

#: stage → process track; the order of first appearance is the display order.
DEFAULT_PROCESSES: dict[str, str] = {
    "dit_queue": "driver",
    "handoff": "driver",
    "latent_ipc": "driver",
    "decode_wait": "driver",
    "decode_queue": "driver",
    "ipc": "driver",
    "dit": "dit rank 0",
    "decode": "vae rank 0",
    "convert": "vae rank 0",
    "d2h": "vae rank 0",
    "encode": "encoder",
    "sink": "encoder",
}
FLOW_STAGES: tuple[str, ...] = ("dit", "decode", "encode")
_KEYS = ("session", "epoch", "chunk", "frames")
_BOUNDARY_NAMES = frozenset(b for pair in INTERVALS.values() for b in pair)


class _Slice(NamedTuple):
    stage: str
    start: int
    end: int
    event: Any


def _get(event: Any, key: str) -> Any:
    if isinstance(event, Mapping):
        return event.get(key)
    return getattr(event, key, None)


def _us(t: int, t0: int) -> float:
    return (t - t0) / 1000.0


def _boundaries(event: Any) -> dict[str, int]:
    return {b: int(t) for b in _BOUNDARY_NAMES if (t := _get(event, b)) is not None}


def _stage_slices(table: list[tuple[Any, dict[str, int]]], pmap: Mapping[str, str | None], handoff: bool) -> list[_Slice]:
    """Every present stage of every chunk that has a track, plus the handoffs between chunks."""
    slices: list[_Slice] = []
    prev_by_session: dict[tuple, tuple[Any, dict[str, int]]] = {}
    for e, b in table:
        for stage, (start, end) in INTERVALS.items():
            if pmap.get(stage) and start in b and end in b:
                slices.append(_Slice(stage, b[start], b[end], e))
        skey = (_get(e, "session"), _get(e, "epoch"))
        prev = prev_by_session.get(skey)
        # Handoff only where it is an interval: in Case E the next DiT starts before the frames land.
        if handoff and pmap.get(HANDOFF) and prev is not None and _get(prev[0], "chunk") == (_get(e, "chunk") or 0) - 1:
            a, z = prev[1].get(HANDOFF_STAGE.start), b.get(HANDOFF_STAGE.end)
            if a is not None and z is not None and z >= a:
                slices.append(_Slice(HANDOFF, a, z, e))
        prev_by_session[skey] = (e, b)
    return slices


def _process_meta(proc_order: list[str]) -> list[dict[str, Any]]:
    meta = []
    for pid, p in enumerate(proc_order, 1):
        meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": p}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    return meta


def _slice_args(s: _Slice) -> dict[str, Any]:
    e = s.event
    args = {k: _get(e, k) for k in _KEYS if _get(e, k) is not None}
    args.update(start_ns=s.start, end_ns=s.end)
    if _get(e, "cancelled"):
        args["cancelled"] = True
    for field in ("gpu_ms", "blocked_ns"):  # per-stage measurements keyed by stage name
        v = (_get(e, field) or {}).get(s.stage)
        if v is not None:
            args[field] = v
    return args


class _Lanes:
    """Thread tracks per stage: a slice goes to the first lane of its stage that is free by its
    start, or to a new lane (``stage #2``…), because slices on one track must nest."""

    def __init__(self, pid_of: dict[str, int]):
        self.pid_of = pid_of
        self.tid_next = dict.fromkeys(pid_of, 1)
        self.ends: dict[str, list[int]] = {}  # stage → end time of each lane's last slice
        self.tid: dict[tuple[str, int], int] = {}  # (stage, lane) → tid
        self.meta: list[dict[str, Any]] = []

    def place(self, s: _Slice, proc: str) -> tuple[int, int]:
        pid = self.pid_of[proc]
        ends = self.ends.setdefault(s.stage, [])
        lane = next((i for i, last in enumerate(ends) if last <= s.start), None)
        if lane is None:
            lane = len(ends)
            ends.append(s.end)
            tid = self.tid_next[proc]
            self.tid_next[proc] += 1
            self.tid[(s.stage, lane)] = tid
            name = s.stage if lane == 0 else f"{s.stage} #{lane + 1}"
            self.meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
            self.meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        else:
            ends[lane] = s.end
        return pid, self.tid[(s.stage, lane)]


def _flows(n_events: int, placed: dict[tuple[int, str], tuple[int, int, float]]) -> list[dict[str, Any]]:
    """One flow per chunk through its ``FLOW_STAGES`` slices (chunks with fewer than two have none)."""
    flows: list[dict[str, Any]] = []
    flow_id = 0
    for i in range(n_events):
        chain = [placed[(i, s)] for s in FLOW_STAGES if (i, s) in placed]
        if len(chain) < 2:
            continue
        flow_id += 1
        for j, (pid, tid, ts) in enumerate(chain):
            ph = "s" if j == 0 else ("f" if j == len(chain) - 1 else "t")
            # Same cat/pid/tid/ts as the slice: Chrome DevTools binds a flow point to the event
            # equal in all four; Perfetto binds it to the enclosing slice.
            ev = {"ph": ph, "name": "chunk", "cat": "stage", "id": flow_id, "pid": pid, "tid": tid, "ts": ts}
            if ph == "f":
                ev["bp"] = "e"  # bind to the enclosing slice, not the next one
            flows.append(ev)
    return flows


def build_trace(
    events: Iterable[Any],
    processes: Mapping[str, str] | None = None,
    *,
    handoff: bool = True,
) -> dict[str, Any]:
    """The trace as a JSON-ready dict. ``events``: ``ChunkEvent`` structs or dicts with the same
    keys. ``processes`` overrides the stage → process map (a stage mapped to ``None`` or missing
    from both maps is left out)."""
    pmap = {**DEFAULT_PROCESSES, **(processes or {})}
    events = sorted(events, key=lambda e: (_get(e, "epoch") or 0, _get(e, "session") or 0, _get(e, "chunk") or 0))
    table = [(e, _boundaries(e)) for e in events]
    all_ts = [t for _, b in table for t in b.values()]
    t0 = min(all_ts) if all_ts else 0

    proc_order = list(dict.fromkeys(p for p in pmap.values() if p))  # the map's order
    lanes = _Lanes({p: i + 1 for i, p in enumerate(proc_order)})
    stage_order = {s: i for i, s in enumerate([*INTERVALS, HANDOFF])}
    index_of = {id(e): i for i, (e, _) in enumerate(table)}
    out: list[dict[str, Any]] = []
    placed: dict[tuple[int, str], tuple[int, int, float]] = {}  # (event idx, stage) → (pid, tid, ts)
    for s in sorted(_stage_slices(table, pmap, handoff), key=lambda s: (stage_order[s.stage], s.start, s.end)):
        pid, tid = lanes.place(s, pmap[s.stage])
        ts, dur = _us(s.start, t0), (s.end - s.start) / 1000.0
        out.append({"ph": "X", "name": s.stage, "cat": "stage", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": _slice_args(s)})
        placed[(index_of[id(s.event)], s.stage)] = (pid, tid, ts)

    return {
        "traceEvents": _process_meta(proc_order) + lanes.meta + out + _flows(len(table), placed),
        "displayTimeUnit": "ms",
        "otherData": {"generator": "harness.hooks.trace", "t0_ns": t0, "chunks": len(table)},
    }


def trace_report(path: Path, n_events: int, build_ns: int) -> dict[str, Any]:
    """The driver's hook report (``spec.DRIVER_REPORT``): the trace it built after the run."""
    return {"requested": ["trace"], "label": "driver",
            "trace": {"file": path.name, "chunks": n_events, "build_ms": build_ns / 1e6},
            "files": {path.name: path_bytes(path)}, "overhead_ms": {"trace_after_run": build_ns / 1e6}}


def write_trace(events: Iterable[Any], path: str | Path, processes: Mapping[str, str] | None = None, **kw: Any) -> dict[str, Any]:
    trace = build_trace(events, processes, **kw)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(trace, separators=(",", ":")))
    tmp.replace(path)
    return trace


# ---- validation ----------------------------------------------------------------------------

_EPS_US = 1e-6


def validate_trace(trace: Mapping[str, Any] | str | Path) -> list[str]:
    """Every structural problem of a trace; empty when Perfetto will read it as intended.

    Checks: JSON round-trip; ``traceEvents`` list; required keys per phase type; non-negative
    durations; every pid has a ``process_name`` and every used (pid, tid) a ``thread_name``;
    slices on one track nest or are disjoint; each flow id has one ``s``, one ``f``, steps in
    between, non-decreasing times, and each flow point lies inside a slice of its track.
    """
    if isinstance(trace, (str, Path)):
        try:
            trace = json.loads(Path(trace).read_text())
        except (OSError, ValueError) as e:
            return [f"cannot read trace: {e}"]
    problems: list[str] = []
    try:
        json.loads(json.dumps(trace))
    except (TypeError, ValueError) as e:
        return [f"not JSON-serialisable: {e}"]
    evs = trace.get("traceEvents") if isinstance(trace, Mapping) else None
    if not isinstance(evs, list):
        return ["traceEvents missing or not a list"]
    proc_names: set[int] = set()
    thread_names: set[tuple[int, int]] = set()
    tracks: dict[tuple[int, int], list[tuple[float, float]]] = {}
    flows: dict[Any, list[dict]] = {}
    for i, ev in enumerate(evs):
        ph = ev.get("ph")
        for k in ("ph", "pid", "tid", "name"):
            if k not in ev:
                problems.append(f"event {i}: missing {k!r}")
        if ph == "M":
            if ev.get("name") == "process_name":
                proc_names.add(ev.get("pid"))
            elif ev.get("name") == "thread_name":
                thread_names.add((ev.get("pid"), ev.get("tid")))
            continue
        if not isinstance(ev.get("ts"), (int, float)):
            problems.append(f"event {i}: ts missing or not a number")
            continue
        if ph == "X":
            dur = ev.get("dur")
            if not isinstance(dur, (int, float)) or dur < 0:
                problems.append(f"event {i}: X slice needs dur ≥ 0, got {dur!r}")
                continue
            tracks.setdefault((ev["pid"], ev["tid"]), []).append((ev["ts"], ev["ts"] + dur))
        elif ph in ("s", "t", "f"):
            if "id" not in ev:
                problems.append(f"event {i}: flow event without id")
                continue
            flows.setdefault((ev.get("cat"), ev["id"]), []).append(ev)
        elif ph not in ("i", "I", "B", "E", "C"):
            problems.append(f"event {i}: unexpected phase {ph!r}")
    for (pid, tid), spans in sorted(tracks.items()):
        if pid not in proc_names:
            problems.append(f"pid {pid}: no process_name metadata")
        if (pid, tid) not in thread_names:
            problems.append(f"pid {pid} tid {tid}: no thread_name metadata")
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list[float] = []
        for a, z in spans:
            while stack and stack[-1] <= a + _EPS_US:
                stack.pop()
            if stack and z > stack[-1] + _EPS_US:
                problems.append(f"pid {pid} tid {tid}: slice [{a}, {z}] partially overlaps one ending at {stack[-1]}")
            stack.append(z)
    for (cat, fid), pts in flows.items():
        kinds = [p["ph"] for p in pts]
        if kinds.count("s") != 1 or kinds.count("f") != 1 or kinds[0] != "s" or kinds[-1] != "f":
            problems.append(f"flow {cat}/{fid}: expected s, t…, f in order, got {kinds}")
        ts = [p["ts"] for p in pts]
        if ts != sorted(ts):
            problems.append(f"flow {cat}/{fid}: times go backwards {ts}")
        for p in pts:
            spans = tracks.get((p["pid"], p["tid"]), [])
            if not any(a - _EPS_US <= p["ts"] <= z + _EPS_US for a, z in spans):
                problems.append(f"flow {cat}/{fid}: {p['ph']} at {p['ts']} is inside no slice of pid {p['pid']} tid {p['tid']}")
    return problems


def slices(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The X slices of a trace, with their track names resolved (for tests and reports)."""
    pname = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M" and e["name"] == "process_name"}
    tname = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M" and e["name"] == "thread_name"}
    out = []
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            out.append({**e, "process": pname.get(e["pid"]), "thread": tname.get((e["pid"], e["tid"]))})
    return out


def load_events(path: str | Path) -> Sequence[Any]:
    """``events.jsonl`` as ChunkEvents (a partial last line, from a killed run, is left out)."""
    return read_events(path, tolerate_partial_tail=True)
