"""Hand-built Case D event tables (``event_tables``), and one real comparison (``h5a_compare``: H5a
vs Case D on the tiny preset, ``--until-resolved --max-rounds 2``: 2 rounds, 3 sessions (1 warm-up) × 7 chunks per launch) shared by the compare
and report tests — 4 serve launches, the costly part of this suite."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.cli import main
from harness.measure.events import ChunkEvent, SessionStart
from harness.measure.stages import STAGES


def children_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().split(")")[-1].split()
            except OSError:
                continue
            if int(stat[1]) == pid and stat[0] != "Z":
                out.append(int(d.name))
    return out


def harness_workers(pid: int) -> list[int]:
    def is_worker(p: int) -> bool:
        try:
            return b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()  # not the resource tracker
        except OSError:
            return False

    return [p for p in children_of(pid) if is_worker(p)]


@pytest.fixture(scope="session")
def h5a_compare(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "h5a"
    # --until-resolved with a budget of 2 rounds: one look, after round 2 (the sequential path, at no extra launch)
    rc = main(["compare", "--candidate", "H5a", "--until-resolved", "--max-rounds", "2", "--preset", "tiny", "--sessions", "3",
               "--chunks", "7", "--out", str(out), "--no-progress"])
    return rc, out, harness_workers(os.getpid())


MS = 1_000_000
#: Case D chunk: every segment's nominal duration (ms); a chunk is submitted `gap` ms after the
#: previous chunk's cpu_ready.
NOMINAL = {"dit_queue": 1, "dit": 40, "latent_ipc": 1, "decode_wait": 1, "decode_queue": 1, "decode": 30,
           "convert": 2, "d2h": 2, "ipc": 1, "encode": 5, "sink": 1}
GAP = 1


def case_d_session(session: int, *, start: int, n_chunks: int = 10, slow: dict[int, dict[str, int]] | None = None):
    """One Case D session; ``slow[chunk][stage]`` adds ms to that chunk's stage (``gap`` included)."""
    slow = slow or {}
    events, t, prev_cpu = [], start + 10 * MS, None
    for c in range(n_chunks):
        extra = slow.get(c, {})
        if prev_cpu is not None:
            t = prev_cpu + (GAP + extra.get("gap", 0)) * MS
        stamps = {"submit": t}
        for name, a, b in STAGES:
            t += (NOMINAL[name] + extra.get(name, 0)) * MS
            stamps[b] = t
        prev_cpu = stamps["cpu_ready"]
        t = prev_cpu
        events.append(ChunkEvent(session=session, epoch=session, chunk=c, frames=9 if c == 0 else 12, **stamps))
    return events, SessionStart(session=session, epoch=session, start_ns=start)


def table(slow_by_session: dict[int, dict[int, dict[str, int]]], n_sessions: int = 4, n_chunks: int = 10):
    events, starts = [], []
    for s in range(n_sessions):
        e, st = case_d_session(s, start=s * 10_000 * MS, n_chunks=n_chunks, slow=slow_by_session.get(s))
        events += e
        starts.append(st)
    return events, starts


@pytest.fixture
def event_tables():
    return SimpleNamespace(table=table, NOMINAL=NOMINAL, GAP=GAP, MS=MS)
