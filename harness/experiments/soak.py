"""The soak: many WebSocket sessions against one ``serve --listen``, with disconnects mixed in.

Sessions run one after another through the bundled client, cycling through ways of leaving
(``KINDS``): none (the session runs to its end), before any start, right after the start, in the
middle of the first chunk (its header read, its media in flight), between chunks, after the last
chunk's header, and a cancel. After every session the server's resident memory (the server process
and every worker it started) is sampled; at the end the server is stopped and checked:

* every session is recorded with its true outcome: ``sessions.jsonl`` says cancelled exactly for
  the sessions whose client left or cancelled, a session that ran to its end has every chunk
  delivered, one left after its last header has that chunk undelivered;
* resident memory drifts by at most ``MAX_DRIFT`` between the first and last thirds of the sessions
  (``rss_drift``: the medians of the two thirds, so that one sample taken while a rank that does
  not reply is still ending its session moves nothing; the first third includes the allocator's
  warm-up, as the issue's definition has it), judged on the sum over the server and its workers;
  each process's own drift (``SoakResult.processes``) says which one moved;
* nothing is left behind: no worker process, no ring segment in /dev/shm, no temporary in the run
  directory (``*.tmp``, ``*.part``, ``.write-probe-*``).

``scripts/soak.py`` runs it at length (≥ 200 sessions); tests/hostile/test_soak.py runs 21.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from harness.config import load_preset
from harness.drivers.procwatch import rss_bytes, start_time, wait_gone
from harness.experiments.scenario.server_process import ServerProcess, preset_of
from harness.measure.events import read_run
from harness.serving.client import ViewerOptions, run_sessions, status

#: how each session's client leaves; "header:last" is the last chunk's header
KINDS = ("complete", "no-start", "start", "header:0", "chunk:0", "header:last", "cancel")
#: resident memory may grow this much (a fraction) from the first third of the sessions to the last
MAX_DRIFT = 0.01
TEMPORARY = ("*.tmp", "*.part", ".write-probe-*", ".*.tmp")


@dataclass
class SoakSession:
    kind: str
    outcome: str  # the client's: complete | disconnected | cancelled | closed | error | busy | left
    session: int | None  # the server's index, when the client saw "started"
    error: str = ""
    rss: int = 0  # bytes, the server and its workers, once the server is idle after this session
    rss_by_pid: dict[int, int] = field(default_factory=dict)
    rss_by_process: dict[str, int] = field(default_factory=dict)  # keyed by ``process_names``


@dataclass(frozen=True)
class Drift:
    """Resident bytes: the medians of the first and last thirds of the sessions, their relative
    difference, and the least and most of any sample."""
    first: float
    last: float
    drift: float
    low: int
    high: int


@dataclass
class SoakResult:
    sessions: list[SoakSession] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    total: Drift | None = None  # the server and its workers together: what MAX_DRIFT bounds
    processes: dict[str, Drift] = field(default_factory=dict)  # each one's own, by process_names


def plan(n: int) -> list[str]:
    return [KINDS[i % len(KINDS)] for i in range(n)]


def expected_cancelled(kind: str) -> bool | None:
    """What ``sessions.jsonl`` must say of a session whose client did ``kind`` (None: no session)."""
    return None if kind == "no-start" else kind != "complete"


def rss_drift(samples: list[int]) -> Drift:
    """The drift of one series of resident sizes (one sample a session) between its first and last
    thirds: medians, not means, so that a lone outlier of either third does not decide it."""
    k = max(1, len(samples) // 3)
    first, last = statistics.median(samples[:k]), statistics.median(samples[-k:])
    return Drift(first, last, (last - first) / first, min(samples), max(samples))


def _options(kind: str, chunks: int) -> ViewerOptions:
    point = kind.replace("last", str(chunks - 1))
    if kind == "cancel":
        return ViewerOptions(cancel_at="header:0", receive_timeout_s=120)
    return ViewerOptions(disconnect_at=None if kind == "complete" else point, receive_timeout_s=120)


async def _leave_before_start(url: str) -> SoakSession:
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url) as ws:
            await ws.close()
    return SoakSession("no-start", "left", None)


async def one_session(url: str, kind: str, seed: int, chunks: int) -> SoakSession:
    if kind == "no-start":
        return await _leave_before_start(url)
    rep = (await run_sessions(url, sessions=1, seed=seed, preset="tiny", chunks=chunks, prompt="",
                              opts=_options(kind, chunks)))[0]
    return SoakSession(kind, rep.outcome, rep.session, rep.error)


def process_names(server: ServerProcess) -> dict[int, str]:
    """pid → ``server``, ``dit0``…, ``vae0``…, ``encoder``: the launcher starts the DiT ranks, then
    the VAE ranks, then the encoder stage, so the workers in start order are named in that order."""
    cfg = load_preset(preset_of(server.argv))
    roles = [f"dit{r}" for r in range(cfg.parallel.sp)] + [f"vae{r}" for r in range(cfg.parallel.vae_ranks)] + ["encoder"]
    workers = sorted(server.workers(), key=lambda p: (start_time(p), p))
    return {server.pid: "server", **{p: roles[i] if i < len(roles) else f"worker{i}" for i, p in enumerate(workers)}}


def server_rss(server: ServerProcess) -> dict[int, int]:
    """Resident bytes of the server and each of its workers."""
    return {p: r for p in [server.pid, *server.workers()] if (r := rss_bytes(p)) is not None}


async def wait_idle(url: str, timeout_s: float = 60.0) -> None:
    """Until the server runs no session (a client that left early leaves its session to be
    cancelled): memory is sampled at the same point of every session, not mid-teardown."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (await status(url)).busy and loop.time() < deadline:
        await asyncio.sleep(0.05)


def run(server: ServerProcess, sessions: int, chunks: int = 2, seed: int = 1,
        progress=None) -> SoakResult:
    """``sessions`` sessions through ``server``, then stop it and check what it left."""
    res = SoakResult()
    names = process_names(server)
    for i, kind in enumerate(plan(sessions)):
        s = asyncio.run(one_session(server.url, kind, seed + i, chunks))
        asyncio.run(wait_idle(server.url))
        s.rss_by_pid = server_rss(server)
        s.rss = sum(s.rss_by_pid.values())
        s.rss_by_process = {n: s.rss_by_pid[p] for p, n in names.items() if p in s.rss_by_pid}
        res.sessions.append(s)
        if progress is not None:
            progress(i, s)
    res.total, res.processes = memory_drift(res.sessions)
    workers = server.workers()
    rc = server.stop()
    res.problems += check_client_outcomes(res.sessions)
    res.problems += check_records(server.out, res.sessions, chunks)
    res.problems += check_left_behind(server, workers, rc)
    if res.total.drift > MAX_DRIFT:
        res.problems.append(f"resident memory drifted {100 * res.total.drift:+.2f} % (allowed {100 * MAX_DRIFT:g} %)")
    return res


def memory_drift(sessions: list[SoakSession]) -> tuple[Drift, dict[str, Drift]]:
    """The drift of the sum, and of each process sampled after every session."""
    every = set.intersection(*(set(s.rss_by_process) for s in sessions))
    return (rss_drift([s.rss for s in sessions]),
            {n: rss_drift([s.rss_by_process[n] for s in sessions]) for n in sessions[0].rss_by_process if n in every})


def check_client_outcomes(sessions: list[SoakSession]) -> list[str]:
    want = {"complete": "complete", "no-start": "left", "cancel": "cancelled"}
    return [f"session {i} ({s.kind}): the client saw {s.outcome} {s.error}".rstrip()
            for i, s in enumerate(sessions) if s.outcome != want.get(s.kind, "disconnected")]


def check_records(run_dir: Path, sessions: list[SoakSession], chunks: int) -> list[str]:
    """The run directory against what each client did, session by session in order."""
    events, starts = read_run(run_dir)
    kinds = [s.kind for s in sessions if expected_cancelled(s.kind) is not None]
    problems = [] if len(starts) == len(kinds) else [f"{len(starts)} sessions recorded, {len(kinds)} started"]
    delivered: dict[int, list] = {}
    for e in events:
        delivered.setdefault(e.session, []).append((e.chunk, e.delivered))
    for start, kind in zip(starts, kinds):
        rows = sorted(delivered.get(start.session, []))
        if start.cancelled != expected_cancelled(kind):
            problems.append(f"session {start.session} ({kind}): recorded cancelled={start.cancelled}")
        if kind == "complete" and (len(rows) != chunks or any(d is None for _, d in rows)):
            problems.append(f"session {start.session} (complete): chunks delivered {rows}")
        if kind == "header:last" and rows and rows[-1][1] is not None:
            problems.append(f"session {start.session} (left after the last header): its last chunk reads delivered")
    return problems


def check_left_behind(server: ServerProcess, workers: list[int], rc: int) -> list[str]:
    problems = [] if rc == 0 else [f"the server exited {rc}"]
    if alive := wait_gone(workers, 15.0):
        problems.append(f"worker processes left: {alive}")
    if shm := server.shm_left():
        problems.append(f"ring segments left in /dev/shm: {shm}")
    if temps := sorted(str(p.relative_to(server.out)) for pat in TEMPORARY for p in server.out.rglob(pat)):
        problems.append(f"temporaries left in the run directory: {temps}")
    return problems
