"""``python -m harness scenario {slow-consumer,cancel,crash,bad-input}``: the serving path under
stress (DESIGN §7). Each scenario prints a compact table of what it saw and the invariants it
checked, and exits 1 when one breaks.

Two ways in (``--over``):

* ``inprocess`` — one launched topology (serve with a session runner) that the scenario drives
  through ``Driver.run_session`` directly, with the file sink; many sessions, one launch.
* ``websocket`` — a ``serve --listen`` subprocess on loopback (or ``--connect`` to a running one)
  driven by the bundled client (``harness.serving.client``); server-side figures come from its ``ended``
  messages and, when the scenario launched it, from its run directory and /proc.

Every session of a scenario uses the prompt ``scenario seed {seed}``, so two sessions with the same
seed must produce the same latents and frames, bit for bit — that is how "delivered exactly once and
in order" and "the next session is unaffected" are judged.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

SCENARIOS = ("slow-consumer", "cancel", "crash", "bad-input")
REPO_ROOT = Path(__file__).resolve().parents[2]
MS = 1_000_000


from harness.measure.clock import now  # noqa: E402  (one clock for every timestamp)


def prompt_for(seed: int) -> str:
    return f"scenario seed {seed}"


# ---- parameters and the report -------------------------------------------------------------------
def add_scenario_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", choices=SCENARIOS)
    g = p.add_argument_group("scenario")
    g.add_argument("--over", choices=["inprocess", "websocket"], default="inprocess",
                   help="drive the launched topology directly (file sink) or through serve --listen and the bundled client")
    g.add_argument("--connect", metavar="HOST:PORT", help="websocket: use this running server instead of launching one")
    g.add_argument("--rate", type=float, default=0.5, help="slow-consumer: consumer speed as a fraction of video.fps (default 0.5)")
    g.add_argument("--slow-sessions", type=int, default=2, help="slow-consumer: throttled sessions (default 2)")
    g.add_argument("--points", help="cancel: comma list of cancel points to run (default: all; --points list prints them)")
    g.add_argument("--cancel-chunks", type=int, default=3, help="cancel: chunks of each cancelled session (default 3)")
    g.add_argument("--verify-chunks", type=int, default=2, help="cancel: chunks of the session checked after each cancel (default 2)")
    g.add_argument("--ranks", default="dit:1,vae:1", help="crash: ranks to SIGKILL, one run each (default dit:1,vae:1)")
    g.add_argument("--fault-chunk", type=int, default=2, help="crash: the chunk at which the rank dies (default 2)")
    g.add_argument("--detect-bound", type=float, default=5.0, help="crash: seconds from the death to a clear error (default 5)")
    g.add_argument("--window", type=int, help="websocket: the launched server's window of unacknowledged chunks")
    g.add_argument("--rss-slack-mib", type=float, default=48.0, help="slow-consumer: allowed RSS growth across throttled sessions")


@dataclass
class Params:
    seed: int = 0
    chunks: int | None = None  # slow-consumer session length (None: the preset's)
    rate: float = 0.5
    slow_sessions: int = 2
    cancel_chunks: int = 3
    verify_chunks: int = 2
    points: tuple[str, ...] | None = None
    ranks: tuple[str, ...] = ("dit:1", "vae:1")
    fault_chunk: int = 2
    detect_bound_s: float = 5.0
    teardown_bound_s: float = 60.0
    rss_slack_mib: float = 48.0
    workdir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()))
    #: bad-input: run every n-th command-line case as a real subprocess and the others through
    #: ``harness.cli.main`` in this process (same parsing, same error path, no interpreter start-up)
    subprocess_every: int = 1


@dataclass
class Report:
    scenario: str
    over: str
    header: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    seconds: float = 0.0
    #: checks that compare rates measured at different moments: the scenario command judges them
    #: (DESIGN §7), but on a loaded machine they measure the machine as much as the harness
    rate_checks: set[str] = field(default_factory=set)

    def check(self, name: str, ok: bool, detail: str = "", *, rate: bool = False) -> bool:
        self.checks.append((name, bool(ok), detail))
        if rate:
            self.rate_checks.add(name)
        return bool(ok)

    @property
    def ok(self) -> bool:
        return all(ok for _, ok, _ in self.checks) and bool(self.checks)

    @property
    def failures(self) -> list[str]:
        return [f"{n}: {d}" for n, ok, d in self.checks if not ok]

    @property
    def correctness_failures(self) -> list[str]:
        """Failures of the invariants that do not depend on how fast the machine is right now."""
        return [f"{n}: {d}" for n, ok, d in self.checks if not ok and n not in self.rate_checks]

    def text(self) -> str:
        out = [f"scenario {self.scenario} ({self.over}) — {self.seconds:.1f} s"]
        if self.rows:
            cells = [[_cell(v) for v in r] for r in [self.header] + self.rows]
            widths = [max(len(r[i]) for r in cells) for i in range(len(self.header))]
            for r in cells:
                out.append("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
        out += [f"  note: {n}" for n in self.notes]
        for name, ok, detail in self.checks:
            rate = " (rate)" if name in self.rate_checks else ""
            out.append(f"  [{'ok' if ok else 'FAIL'}] {name}{rate}" + (f" — {detail}" if detail else ""))
        out.append(f"  {'PASS' if self.ok else 'FAIL'}: {sum(ok for _, ok, _ in self.checks)}/{len(self.checks)} invariants hold")
        return "\n".join(out)


def _cell(v, width: int = 72) -> str:
    text = str(v)
    return text if len(text) <= width else text[:width - 1] + "…"


def _ms(ns) -> str:
    return "-" if ns is None else f"{max(ns, 0) / MS:.0f}"


def _p50(values) -> float | None:
    return statistics.median(values) if values else None


# ---- the in-process topology ---------------------------------------------------------------------
class Bench:
    """A launched topology as a scenario drives it, from serve's driver thread."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self._next = 0
        self._drivers: dict[str, object] = {}

    @property
    def cfg(self):
        return self.ctx.cfg

    def run(self, seed: int, chunks: int, *, sink: str | None = None, control=None, scheduler: str | None = None):
        from harness.drivers.driver import SessionControl
        from harness.pipeline import messages as M

        s, self._next = self._next, self._next + 1
        L = self.ctx.launcher
        if sink is not None:
            L.send(L.lead("encoder"), M.SetSink(session=s, sink=sink))
        control = control or SessionControl()
        control.prompt = control.prompt or prompt_for(seed)
        res = self.driver(scheduler).run_session(session=s, epoch=s, seed=seed, chunks=chunks, control=control)
        self.ctx.add_result(res)
        return res

    def driver(self, scheduler: str | None):
        """The topology's driver, or one with another schedule over the same workers (the
        schedule lives only in the driver)."""
        if scheduler is None or scheduler == self.cfg.runtime.scheduler:
            return self.ctx.driver
        if scheduler not in self._drivers:
            from harness.config import override
            from harness.drivers.driver import Driver

            cfg = override(self.cfg, runtime={"scheduler": scheduler})
            self._drivers[scheduler] = Driver(cfg, self.ctx.launcher, self.ctx.run_dir, on_chunk=self.ctx.driver.on_chunk)
        return self._drivers[scheduler]

    def encoder_pid(self) -> int:
        return self.ctx.launcher.lead("encoder").process.pid

    def close(self) -> None:
        for d in self._drivers.values():
            d.close()


class Topology:
    """serve() in a background thread whose session runner executes submitted jobs, so that
    several scenarios (or many cancel points) share one launch. ``close()`` tears down and
    returns serve's result (its ring prefix and worker pids are what the leak checks need)."""

    def __init__(self, cfg, out: str | None, faults: dict | None = None, candidates: tuple[str, ...] = ()) -> None:
        self.cfg, self.out, self.faults, self.candidates = cfg, out, dict(faults or {}), candidates
        self._jobs: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.result = None
        self.run_dir: Path | None = None
        self.pids: list[int] = []

    def __enter__(self) -> Topology:
        from harness.drivers.serve import ServeOptions, serve

        def runner(ctx) -> None:
            bench = Bench(ctx)
            self.run_dir, self.pids = ctx.run_dir, ctx.launcher.pids()
            self._ready.set()
            try:
                while True:
                    job = self._jobs.get()
                    if job is None:
                        return
                    fn, fut = job
                    try:
                        fut.set_result(fn(bench))
                    except BaseException as e:
                        fut.set_exception(e)
                        raise  # a failed job may have left the topology unusable: tear it down
            finally:
                bench.close()

        def main() -> None:
            try:
                self.result = serve(self.cfg, ServeOptions(out=self.out, candidates=self.candidates, progress=False,
                                                           probes=False, faults=self.faults, session_runner=runner,
                                                           protocol={"name": "scenario"}))
            except BaseException as e:
                self._error = e
            finally:
                self._ready.set()

        self._thread = threading.Thread(target=main, name="scenario-serve", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def run(self, fn: Callable):
        if not self._thread.is_alive():
            raise RuntimeError(f"the topology is gone: {self._error}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, fut))
        return fut.result()

    def close(self):
        self._jobs.put(None)
        self._thread.join()
        return self.result

    def __exit__(self, *_):
        self.close()


def leak_checks(report: Report, pids: list[int], ring_prefix: str | None) -> None:
    """After a topology is gone: every worker reaped, every ring segment unlinked."""
    from harness.drivers.procwatch import wait_gone
    from harness.pipeline.ring import leftover_segments

    left = wait_gone(pids, 10.0)
    report.check("no leaked processes", not left, f"{len(pids)} workers reaped" if not left else f"still running: {left}")
    if ring_prefix:
        segs = leftover_segments(ring_prefix)
        report.check("no leaked shared memory", not segs, "ring segments unlinked" if not segs else f"left: {segs}")


# ---- the websocket server ------------------------------------------------------------------------
def _stop_with_parent() -> None:
    """In the server child before exec: SIGTERM it (a graceful stop) if this process dies first,
    so a scenario stopped by a signal leaves no server behind."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerProcess:
    """``python -m harness serve --listen 127.0.0.1:0`` as a subprocess, for the scenarios and tests."""

    #: pid of every server this process started: whose ring segments a leak check may call ours
    started: list[int] = []

    def __init__(self, serve_args: list[str], out: Path, extra: list[str] | None = None, start_timeout_s: float = 300.0):
        self.out = Path(out)
        self.argv = [sys.executable, "-m", "harness", "serve", "--listen", "127.0.0.1:0", "--out", str(self.out),
                     *serve_args, *(extra or [])]
        self.stderr_path = self.out.parent / (self.out.name + ".server.err")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._err = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(self.argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=self._err,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_stop_with_parent)
        ServerProcess.started.append(self.proc.pid)
        self.stdout_lines: list[str] = []
        deadline = time.monotonic() + start_timeout_s
        self.url = None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().decode()
            if not line:
                break
            self.stdout_lines.append(line.rstrip())
            if line.startswith("listening on "):
                self.url = line.split()[-1]
                break
        if self.url is None:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"server did not start: {self.stderr()[-500:]}")
        self._drain = threading.Thread(target=self._read_rest, daemon=True)
        self._drain.start()

    def _read_rest(self) -> None:
        for line in iter(self.proc.stdout.readline, b""):
            self.stdout_lines.append(line.decode().rstrip())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.stderr_path.read_text(errors="replace")

    def workers(self) -> list[int]:
        from harness.drivers.procwatch import workers_of

        return workers_of(self.pid, recursive=True)

    def operator_token(self) -> str:
        """The token that lets this process (the server's operator) read any session's outcome."""
        try:
            return (self.out / "operator.token").read_text().strip()
        except OSError:
            return ""

    def encoder_pid(self) -> int:
        """The launcher starts the encoder stage last."""
        from harness.drivers.procwatch import start_time

        return max(self.workers(), key=lambda p: (start_time(p), p))

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def wait(self, timeout_s: float) -> int:
        rc = self.proc.wait(timeout=timeout_s)
        self._drain.join(5)
        self._err.close()
        return rc


def serve_argv(args: argparse.Namespace) -> list[str]:
    """The serve options of a scenario's command line, for the server subprocess."""
    out = []
    for flag, name in (("--config", "config"), ("--preset", "preset"), ("--scheduler", "scheduler"), ("--mode", "mode"),
                       ("--chunks", "chunks"), ("--seed", "seed"), ("--hooks", "hooks"), ("--sp", "sp"),
                       ("--vae-ranks", "vae_ranks"), ("--device", "device"), ("--encoder", "encoder"),
                       ("--ring-slots", "ring_slots"), ("--dit-gpus", "dit_gpus"), ("--vae-gpus", "vae_gpus")):
        v = getattr(args, name, None)
        if isinstance(v, (tuple, list)):
            v = ",".join(map(str, v))
        if v not in (None, ""):
            out += [flag, str(v)]
    for c in getattr(args, "candidate", []) or []:
        out += ["--candidate", c]
    if getattr(args, "window", None):
        out += ["--window", str(args.window)]
    return out


def _ws(coro):
    return asyncio.run(coro)


def _decoded_hashes(path) -> list[str]:
    from harness.pipeline.decode import decode_pyav

    return [hashlib.sha256(f.tobytes()).hexdigest() for f in decode_pyav(path).frames]


# ---- shared per-session figures ------------------------------------------------------------------
def _intervals(times: list[int | None]) -> list[int]:
    return [b - a for a, b in zip(times, times[1:]) if a is not None and b is not None]


def _peak_overlap(spans: list[tuple[int, int]]) -> int:
    edges = sorted([(a, 1) for a, b in spans] + [(b, -1) for a, b in spans])
    peak = cur = 0
    for _, d in edges:
        cur += d
        peak = max(peak, cur)
    return peak


def _occupancy(events) -> int:
    """Most chunks at once between cpu_ready and encoded: a slot is held from before the first to
    after the second, so this never exceeds the ring's true occupancy."""
    return _peak_overlap([(e.cpu_ready, e.encoded) for e in events if e.cpu_ready is not None and e.encoded is not None])


def _blocked(events, key: str) -> int:
    return sum(e.blocked_ns.get(key, 0) for e in events)


def _rate(frames: list[int], times: list[int]) -> float | None:
    """Frames per second over chunks 1.. (chunk 0 includes the start-up)."""
    if len(times) < 2 or times[-1] == times[0]:
        return None
    return sum(frames[1:]) / ((times[-1] - times[0]) / 1e9)


# ==== slow-consumer ===============================================================================
def _frames_expected(latent_frames: int, chunks: int) -> int:
    """DESIGN §2: the first latent frame decodes to one pixel frame, every later one to four."""
    return latent_frames * chunks * 4 - 3


def _slow_plan(p: Params, fps: int) -> list[tuple[str, int, float | None]]:
    """(role, seed, consumer fps or None). Every seed of a throttled session also runs unthrottled:
    the reference first, the recovery last."""
    slow = [("slow", p.seed + (i % 2), p.rate * fps) for i in range(p.slow_sessions)]
    last_seed = slow[-1][1] if slow else p.seed
    return [("reference", p.seed, None)] + slow + [("restored", last_seed, None)]


def _judge_slow(report: Report, sessions: list[dict], rate_fps: float, p: Params, expect_ring_block: bool) -> None:
    """``sessions``: role, seed, frame_sha256, decoded (hashes of the media the consumer got),
    intervals (delivery, ns), fps, blocked (ns by kind), occupancy, slots, peaks (RSS bytes by group)."""
    refs = {s["seed"]: s for s in sessions if s["role"] != "slow"}
    slow = [s for s in sessions if s["role"] == "slow"]
    bad = []
    for s in sessions:
        want = refs[s["seed"]]["frame_sha256"]
        if s["frame_sha256"] != want or s["decoded"] != want:
            bad.append(f"session {s['session']} ({s['role']}): {len(s['decoded'])} decoded / {len(want)} expected frames differ")
        if len(want) != s["expected_frames"]:
            bad.append(f"session {s['session']}: {len(want)} frames, expected {s['expected_frames']}")
    report.check("every frame delivered exactly once, in order", not bad and bool(slow),
                 "; ".join(bad) if bad else f"{len(slow)} throttled sessions match the unthrottled run of their seed, "
                 "hash for hash, in the hashes and in the decoded media")
    over = [f"session {s['session']}: {s['occupancy']} > {s['slots']}" for s in sessions if s["occupancy"] > s["slots"]]
    free = [f"session {s['session']}: {s['ring_free']} free of {s['slots']}" for s in sessions
            if s["ring_free"] is not None and s["ring_free"] != s["slots"]]
    report.check("ring occupancy bounded by its slots", not over and not free,
                 "; ".join(over + free) or f"peak {max(s['occupancy'] for s in sessions)} of {sessions[0]['slots']} slots, all free after each session")
    if slow and sessions[0]["peaks"] and all(s["peaks"] for s in slow):
        # A backlog held anywhere in the driver or the encoder would show as growth over the
        # unthrottled reference; bounded queues keep the throttled sessions at the same level.
        base = sessions[0]["peaks"]
        growth = {g: max(s["peaks"].get(g, 0) for s in slow) - base.get(g, 0) for g in base}
        worst = max(growth.values()) if growth else 0
        report.check("resident memory bounded", worst <= p.rss_slack_mib * (1 << 20),
                     ", ".join(f"{g} {base[g] / 2**20:.0f} MiB unthrottled, {growth[g] / 2**20:+.1f} MiB throttled"
                               for g in base) + f" (allowed +{p.rss_slack_mib:g} MiB)")
    else:
        report.notes.append("resident memory not sampled (the server's processes are not visible from here)")
    kinds = ("ring", "sink", "client")
    unblocked = [s["session"] for s in slow if sum(s["blocked"].get(k, 0) for k in kinds if k != "sink") < 10 * MS
                 or (expect_ring_block and s["blocked"].get("ring", 0) <= 0)]
    report.check("producer blocked time recorded (≥ 10 ms per throttled session)", not unblocked,
                 f"throttled sessions {unblocked} show no blocked time"
                 + (" at the ring: too few chunks for the backlog to outgrow the ring (more --chunks or fewer --ring-slots)"
                    if expect_ring_block else "") if unblocked else
                 "; ".join(f"session {s['session']}: " + ", ".join(f"{k} {s['blocked'].get(k, 0) / 1e9:.2f} s" for k in kinds
                                                                      if s["blocked"].get(k)) for s in slow))
    ref, rest = sessions[0], sessions[-1]
    ref_p50 = _p50(ref["intervals"])
    slow_p50 = _p50([i for s in slow for i in s["intervals"]])
    rest_p50 = _p50(rest["intervals"])
    if None in (ref_p50, slow_p50, rest_p50):
        report.check("full rate restored when the consumer catches up", False, "sessions too short to measure intervals (need ≥ 3 chunks)")
        return
    report.check("the consumer was the bottleneck", slow_p50 >= 1.2 * ref_p50,
                 f"throttled delivery interval P50 {slow_p50 / MS:.0f} ms vs unthrottled {ref_p50 / MS:.0f} ms "
                 f"(consumer at {rate_fps:.1f} frames/s)" + ("" if slow_p50 >= 1.2 * ref_p50 else "; lower --rate"), rate=True)
    fast_enough = rest_p50 <= max(1.5 * ref_p50, ref_p50 + 150 * MS) and rest_p50 <= 0.85 * slow_p50
    report.check("full rate restored when the consumer catches up", fast_enough,
                 f"after the throttled sessions: P50 {rest_p50 / MS:.0f} ms (reference {ref_p50 / MS:.0f} ms, throttled {slow_p50 / MS:.0f} ms)",
                 rate=True)


def _slow_rows(report: Report, sessions: list[dict]) -> None:
    report.header = ["session", "role", "seed", "consumer fps", "frames", "P50 interval ms", "delivered fps",
                     "blocked ring/sink/client s", "peak slots", "peak RSS MiB"]
    for s in sessions:
        report.rows.append([s["session"], s["role"], s["seed"], "-" if s["consumer_fps"] is None else f"{s['consumer_fps']:.1f}",
                            len(s["decoded"]), _ms(_p50(s["intervals"])), "-" if s["fps"] is None else f"{s['fps']:.1f}",
                            "/".join(f"{s['blocked'].get(k, 0) / 1e9:.2f}" for k in ("ring", "sink", "client")),
                            f"{s['occupancy']}/{s['slots']}",
                            " ".join(f"{g}:{v / 2**20:.0f}" for g, v in s["peaks"].items()) or "-"])


def slow_consumer_inprocess(bench: Bench, p: Params) -> Report:
    from harness.drivers.procwatch import RssSampler

    report = Report("slow-consumer", "inprocess")
    t0 = time.monotonic()
    cfg = bench.cfg
    chunks = p.chunks or cfg.video.chunks_per_session
    vid = cfg.video
    expected = sum(vid.pixel_frames(c) for c in range(chunks))
    groups = lambda: {"driver": [os.getpid()], "encoder": [bench.encoder_pid()]}  # noqa: E731
    sessions = []
    with RssSampler(groups) as rss:
        for role, seed, consumer in _slow_plan(p, vid.fps):
            rss.mark(f"{role}-{len(sessions)}")
            res = bench.run(seed, chunks, sink=f"throttled:{consumer:g}" if consumer else "file")
            media = bench.ctx.run_dir / "media" / f"session{res.start.session}.mkv"
            ev = res.events
            sessions.append(dict(
                session=res.start.session, role=role, seed=seed, consumer_fps=consumer, frame_sha256=res.frame_sha256,
                media=media, expected_frames=expected,
                intervals=_intervals([e.delivered for e in ev]), fps=_rate([e.frames for e in ev], [e.delivered for e in ev]),
                blocked={k: _blocked(ev, k) for k in ("ring", "sink")}, occupancy=_occupancy(ev), slots=bench.ctx.ring_slots,
                ring_free=res.ring_free_after, label=f"{role}-{len(sessions)}"))
        rss.mark("end")
    for s in sessions:
        s["peaks"] = rss.peaks.get(s.pop("label"), {})
        # decoded only now: decoding in this (the driver's) process would blur its RSS figures
        media = s.pop("media")
        s["decoded"] = _decoded_hashes(media) if media.exists() else []
    _slow_rows(report, sessions)
    _judge_slow(report, sessions, p.rate * vid.fps, p, expect_ring_block=True)
    report.seconds = time.monotonic() - t0
    return report


def slow_consumer_ws(url: str, p: Params, server: ServerProcess | None = None, preset: str | None = None) -> Report:
    from harness.serving.client import ViewerOptions, run_session, status
    from harness.drivers.procwatch import RssSampler
    from harness.measure.events import read_events

    report = Report("slow-consumer", "websocket")
    t0 = time.monotonic()
    st = _ws(status(url))
    preset = preset or st.preset
    files = Path(tempfile.mkdtemp(prefix="slow-", dir=p.workdir))
    groups = (lambda: {"server": [server.pid], "encoder": [server.encoder_pid()]}) if server else (lambda: {})  # noqa: E731
    sessions = []
    with RssSampler(groups) as rss:
        for role, seed, consumer in _slow_plan(p, 16):
            label = f"{role}-{len(sessions)}"
            rss.mark(label)

            rep = _ws(run_session(url, preset=preset, seed=seed, chunks=p.chunks, prompt=prompt_for(seed),
                                  opts=ViewerOptions(read_rate=p.rate if consumer else None, out_dir=files)))
            if rep.outcome != "complete" or rep.ended is None:
                report.check(f"session {len(sessions)} ({role}) completes", False, rep.error or rep.outcome)
                report.seconds = time.monotonic() - t0
                return report
            fps = rep.started.fps
            end = rep.ended
            sessions.append(dict(
                session=rep.session, role=role, seed=seed, consumer_fps=p.rate * fps if consumer else None,
                frame_sha256=rep.frame_sha256, decoded=_decoded_hashes(rep.media_path),
                expected_frames=_frames_expected(rep.started.latent_frames_per_chunk, end.chunks),
                intervals=_intervals(rep.receipts_ns), fps=_rate([h.frames for h in rep.headers], rep.receipts_ns),
                blocked={"client": end.client_blocked_ns}, occupancy=0, slots=end.ring_slots, ring_free=end.ring_free,
                label=label, max_unacked=end.max_unacked, window=rep.started.window))
        rss.mark("end")
    if server is not None and (server.out / "events.jsonl").exists():
        events = read_events(server.out / "events.jsonl")
        for s in sessions:
            mine = [e for e in events if e.session == s["session"]]
            s["occupancy"] = _occupancy(mine)
            s["blocked"].update(ring=_blocked(mine, "ring"), sink=_blocked(mine, "sink"))
    else:
        report.notes.append("ring occupancy from the server's events not available (not launched here)")
    for s in sessions:
        s["peaks"] = rss.peaks.get(s.pop("label"), {})
    _slow_rows(report, sessions)
    over = [f"session {s['session']}: {s['max_unacked']} > {s['window']}" for s in sessions if s["max_unacked"] > s["window"]]
    report.check("chunks in flight to the client bounded by the window", not over,
                 "; ".join(over) or f"at most {max(s['max_unacked'] for s in sessions)} unacknowledged (window {sessions[0]['window']})")
    _judge_slow(report, sessions, p.rate * fps, p, expect_ring_block=False)
    shutil.rmtree(files, ignore_errors=True)
    report.seconds = time.monotonic() - t0
    return report


# ==== cancel ======================================================================================
@dataclass
class CancelPoint:
    name: str
    target: str  # what it aims at, for the table
    when: Callable[[int, list[dict]], bool] | None  # (start_ns, driver stamps) → cancel now; None: at the first poll
    expect_cancelled: bool = True
    scheduler: str | None = None
    sink: str | None = None
    keep_partial: bool = False
    verify: bool = True  # False: the next point's session follows at once ("twice in a row")


#: the driver-visible boundary that ends the stage a delayed point aims into
_STAGE_END = {"submit": "latent_ready", "decode_submit": "cpu_ready", "cpu_ready": "delivered"}


def _at(chunk: int, boundary: str, delay_ns: float = 0):
    """Fire ``delay_ns`` after ``boundary`` of ``chunk`` — or as soon as that stage is seen to be
    over, so an estimate that runs long on a busy machine still cancels inside the session."""
    end = _STAGE_END.get(boundary) if delay_ns else None

    def when(_start: int, st: list[dict]) -> bool:
        if chunk >= len(st) or boundary not in st[chunk]:
            return False
        return now() >= st[chunk][boundary] + delay_ns or (end is not None and end in st[chunk])
    return when


def cancel_points(fwd: float, dec: float, n: int, fps: int = 16, lag: float = 0) -> list[CancelPoint]:
    """Timings from the reference session (ns): ``fwd`` one DiT forward, ``dec`` one chunk's decode,
    ``lag`` from the driver's submit to the DiT rank starting; ``n`` chunks per cancelled session.
    "step k" points aim at the middle of forward k (0-3 denoise, 4 commit)."""
    last = n - 1
    mid = min(1, last)
    step = lambda k: lag + (k + 0.5) * fwd  # noqa: E731
    pts = [
        CancelPoint("before-first-chunk", "nothing submitted yet", None),
        CancelPoint("start+1ms", "1 ms after the session started", lambda s, st: now() >= s + MS),
        CancelPoint("dit0:submitted", "chunk 0 just submitted to the DiT", _at(0, "submit")),
        CancelPoint("dit0:step0", "chunk 0, denoise step 0", _at(0, "submit", step(0))),
        CancelPoint("dit0:step1", "chunk 0, denoise step 1", _at(0, "submit", step(1))),
        CancelPoint("dit0:step2", "chunk 0, denoise step 2", _at(0, "submit", step(2))),
        CancelPoint("dit0:step3", "chunk 0, denoise step 3", _at(0, "submit", step(3))),
        CancelPoint("dit0:commit", "chunk 0, the commit forward", _at(0, "submit", step(4))),
        CancelPoint(f"dit{mid}:step2", f"chunk {mid} mid-DiT, with cached context", _at(mid, "submit", step(2))),
        CancelPoint(f"dit{last}:step3", "last chunk mid-DiT", _at(last, "submit", step(3))),
        CancelPoint("decode0+0", "chunk 0 just sent to the VAE", _at(0, "decode_submit")),
        CancelPoint(f"decode{mid}+half", f"chunk {mid} half-way through its decode", _at(mid, "decode_submit", 0.5 * dec)),
        CancelPoint(f"decode{last}+0.9", "last chunk late in its decode", _at(last, "decode_submit", 0.9 * dec)),
        CancelPoint("encode0", "chunk 0's frames just handed to the encoder", _at(0, "cpu_ready")),
        CancelPoint(f"encode{mid}+2ms", f"chunk {mid} being encoded", _at(mid, "cpu_ready", 2 * MS)),
        CancelPoint("delivered0", "between chunks: chunk 0 delivered", _at(0, "delivered")),
        CancelPoint("last-latent", "all chunks generated, last one decoding", _at(last, "latent_ready")),
        CancelPoint("last-encode", "last chunk's frames at the encoder", _at(last, "cpu_ready")),
        CancelPoint("after-last-chunk", "too late: every chunk delivered (a no-op)", _at(last, "delivered"),
                    expect_cancelled=False),
        CancelPoint("case-e:dit-while-decoding", f"Case E: DiT of chunk {mid + 1 if mid < last else last} while "
                    f"chunk {mid} decodes", lambda s, st: len(st) > mid + 1 and "submit" in st[mid + 1]
                    and "cpu_ready" not in st[mid], scheduler="case-e"),
        CancelPoint("case-e:latent-waiting", f"Case E: chunk {mid}'s latent waiting for the decoder",
                    lambda s, st: "latent_ready" in st[mid] and "decode_submit" not in st[mid], scheduler="case-e"),
        CancelPoint("slow-sink-backlog", "consumer behind (throttled sink), chunks queued at the encoder",
                    _at(mid, "cpu_ready"), sink=f"throttled:{fps / 2:g}"),
        CancelPoint("keep-partial-media", "chunk 0 delivered; partial media kept (policy)", _at(0, "delivered"),
                    keep_partial=True),
        CancelPoint("twice-1", "first of two cancelled sessions in a row (mid-DiT)", _at(0, "submit", step(1)), verify=False),
        CancelPoint("twice-2", "second one, right after (mid-decode)", _at(0, "decode_submit", 0.3 * dec)),
    ]
    return pts


class _Trigger:
    def __init__(self, when) -> None:
        self.when, self.fired_ns = when, None

    def __call__(self, start_ns: int, stamps: list[dict]) -> bool:
        if self.fired_ns is None and (self.when is None or self.when(start_ns, stamps)):
            self.fired_ns = now()
        return self.fired_ns is not None


def _where(t: int | None, events, start_ns: int) -> str:
    """Where in the pipeline a moment fell, from the session's own events."""
    if t is None:
        return "never fired"
    spans = []
    for e in events:
        c = e.chunk
        for a, b, what in (("submit", "dit_start", f"→dit{c}"), ("dit_start", "dit_end", f"dit{c}"),
                           ("dit_end", "latent_ready", f"→drv{c}"), ("latent_ready", "decode_submit", f"latent{c} waiting"),
                           ("decode_submit", "decode_start", f"→vae{c}"), ("decode_start", "cpu_ready", f"decode{c}"),
                           ("cpu_ready", "received", f"→enc{c}"), ("received", "encoded", f"encode{c}"),
                           ("encoded", "delivered", f"sink{c}")):
            ta, tb = getattr(e, a), getattr(e, b)
            if ta is not None and tb is not None and ta <= t < tb:
                if what.startswith("dit") and tb > ta:
                    what += f" step {min(4, int(5 * (t - ta) / (tb - ta)))}"
                spans.append(what)
    if spans:
        return ", ".join(spans)
    if not events or all(e.submit is None or t < e.submit for e in events):
        return f"before chunk 0 (+{(t - start_ns) / MS:.1f} ms)"
    return "between stages"


def cancel_inprocess(bench: Bench, p: Params) -> Report:
    from harness.drivers.driver import SessionControl

    report = Report("cancel", "inprocess")
    t0 = time.monotonic()
    n, v = p.cancel_chunks, p.verify_chunks
    media_dir = bench.ctx.run_dir / "media"
    ref = bench.run(p.seed, max(n, v))
    ref_pairs = [(h["latent_sha256"], h["pixels_sha256"]) for h in ref.chunk_hashes]
    ref_frames = ref.frame_sha256
    per_chunk = [e.frames for e in ref.events]
    fwd = statistics.median((e.dit_end - e.dit_start) / 5 for e in ref.events)
    dec = statistics.median(e.decode_end - e.decode_start for e in ref.events)
    lag = statistics.median(e.dit_start - e.submit for e in ref.events)
    report.notes.append(f"reference session {ref.start.session} (seed {p.seed}, {len(ref.events)} chunks): submit → DiT start "
                        f"≈ {lag / MS:.1f} ms, DiT forward ≈ {fwd / MS:.1f} ms, decode ≈ {dec / MS:.0f} ms per chunk "
                        "(cancel points aim with these; 'fired in' is where each landed)")
    points = cancel_points(fwd, dec, n, bench.cfg.video.fps, lag)
    if p.points:
        unknown = sorted(set(p.points) - {c.name for c in points})
        if unknown:
            report.check("known cancel points", False, f"unknown: {', '.join(unknown)}")
            return report
        points = [c for c in points if c.name in p.points]
    report.header = ["#", "point", "aimed at", "fired in", "cancelled", "chunks gen/enc", "KV used", "ring free", "media",
                     "next session"]
    problems: dict[str, list[str]] = {k: [] for k in ("cancelled", "kv", "ring", "media", "next")}
    verified = 0
    for i, pt in enumerate(points):
        trig = _Trigger(pt.when)
        res = bench.run(p.seed + 1 + i, n, sink=pt.sink, scheduler=pt.scheduler,
                        control=SessionControl(should_cancel=trig, keep_partial_media=pt.keep_partial))
        s = res.start.session
        encoded = sum(1 for e in res.events if e.encoded is not None)
        kv = res.kv_after.get("blocks_used")
        if res.cancelled != pt.expect_cancelled:
            problems["cancelled"].append(f"{pt.name}: cancelled={res.cancelled}")
        if kv != 0:
            problems["kv"].append(f"{pt.name}: {kv} blocks used")
        if res.ring_free_after != bench.ctx.ring_slots:
            problems["ring"].append(f"{pt.name}: {res.ring_free_after} of {bench.ctx.ring_slots} free")
        mkv, part = media_dir / f"session{s}.mkv", media_dir / f"session{s}.mkv.part"
        media = "-"
        if part.exists():
            problems["media"].append(f"{pt.name}: {part.name} left behind")
        if res.cancelled and not pt.keep_partial:
            media = "removed" if not mkv.exists() and res.media is not None and res.media.discarded else "KEPT"
            if media != "removed":
                problems["media"].append(f"{pt.name}: cancelled session's media not removed")
        elif mkv.exists():
            got = _decoded_hashes(mkv)
            media = f"{len(got)} frames"
            if got != res.frame_sha256:
                problems["media"].append(f"{pt.name}: {mkv.name} does not decode to the {len(res.frame_sha256)} delivered frames")
        else:
            problems["media"].append(f"{pt.name}: no media for a kept/complete session")
        nxt = "-"
        if pt.verify:
            chk = bench.run(p.seed, v)
            pairs = [(h["latent_sha256"], h["pixels_sha256"]) for h in chk.chunk_hashes]
            same = pairs == ref_pairs[:v] and chk.frame_sha256 == ref_frames[:sum(per_chunk[:v])]
            verified += 1
            nxt = "identical" if same else "DIFFERS"
            if not same:
                problems["next"].append(f"after {pt.name}")
            if chk.kv_after.get("blocks_used") != 0 or chk.ring_free_after != bench.ctx.ring_slots:
                problems["kv"].append(f"verification after {pt.name} left state behind")
        report.rows.append([i + 1, pt.name, pt.target, _where(trig.fired_ns, res.events, res.start.start_ns),
                            "yes" if res.cancelled else "no", f"{len(res.events)}/{encoded}", kv,
                            f"{res.ring_free_after}/{bench.ctx.ring_slots}", media, nxt])
    report.check(f"{len(points)} distinct cancel points", len(points) >= 20 or bool(p.points),
                 "covering before the first chunk, mid-DiT between steps, mid-decode, mid-encode, between chunks, "
                 "after the last chunk, Case E overlap, a slow consumer, twice in a row")
    report.check("cancel takes effect (and is a no-op once the session is over)", not problems["cancelled"],
                 "; ".join(problems["cancelled"]))
    report.check("all KV blocks free after every session", not problems["kv"], "; ".join(problems["kv"]))
    report.check("all ring slots free after every session", not problems["ring"], "; ".join(problems["ring"]))
    report.check("cancelled media removed, kept media valid", not problems["media"], "; ".join(problems["media"]))
    report.check("the next session is bit-identical to a fresh run", not problems["next"] and verified > 0,
                 "; ".join(problems["next"]) or f"{verified} verification sessions: latents, pixels and frame hashes "
                 f"equal reference session {ref.start.session}")
    report.seconds = time.monotonic() - t0
    return report


@dataclass
class WsCancelPoint:
    name: str
    target: str
    opts: dict
    expect: str = "cancelled"  # the session's outcome on the server: cancelled | complete
    verify: bool = True


def ws_cancel_points(ttfc_s: float, n: int) -> list[WsCancelPoint]:
    last = n - 1
    return [
        WsCancelPoint("cancel-right-after-start", "before the server picked the session up", dict(cancel_at="start")),
        WsCancelPoint("cancel-on-started", "before chunk 0", dict(cancel_at="started")),
        WsCancelPoint("cancel-mid-chunk0", f"{0.5 * ttfc_s:.2f} s after start (chunk 0 in DiT/VAE)",
                      dict(cancel_at=f"after:{0.5 * ttfc_s:.3f}")),
        WsCancelPoint("cancel-on-header0", "chunk 0 announced, its media in flight", dict(cancel_at="header:0")),
        WsCancelPoint("cancel-after-chunk0", "chunk 0 read; chunk 1 in progress", dict(cancel_at="chunk:0")),
        WsCancelPoint("cancel-twice-at-once", "two cancel messages back to back", dict(cancel_at="chunk:0", cancel_repeat=2)),
        WsCancelPoint("disconnect-right-after-start", "socket closed right after start", dict(disconnect_at="start")),
        WsCancelPoint("disconnect-mid-chunk1", "socket closed after chunk 0 (chunk 1 in progress)", dict(disconnect_at="chunk:0")),
        WsCancelPoint("disconnect-mid-media", "socket closed with chunk 1's media in flight", dict(disconnect_at=f"header:{min(1, last)}")),
        WsCancelPoint("actions-timeout", "client withholds chunk 1's actions (server times out)",
                      dict(withhold_actions_from=min(1, last), action_timeout_s=0.5)),
        WsCancelPoint("cancel-after-last-chunk", "too late: last chunk read (a no-op)", dict(cancel_at=f"chunk:{last}"),
                      expect="complete"),
        WsCancelPoint("twice-1", "first of two cancelled sessions in a row", dict(cancel_at="chunk:0"), verify=False),
        WsCancelPoint("twice-2", "second one, right after", dict(cancel_at="started")),
    ]


async def ended_of(url: str, rep, served_before: int, timeout_s: float = 60.0, token: str = ""):
    """The server's account of a session the client left without waiting for it: the ``last``
    of the first idle status after the server finished one more session than before (another
    connection sees it only with the server's operator token)."""
    from harness.serving.client import status

    if rep.ended is not None:
        return rep.ended
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = await status(url, token=token)
        if not st.busy and st.sessions_served > served_before and st.last is not None:
            return st.last
        await asyncio.sleep(0.05)
    return None


def cancel_ws(url: str, p: Params, server: ServerProcess | None = None) -> Report:
    from harness.serving.client import ViewerOptions, run_session, status, verify_media

    report = Report("cancel", "websocket")
    t0 = time.monotonic()
    n, v = p.cancel_chunks, p.verify_chunks
    files = Path(tempfile.mkdtemp(prefix="cancel-", dir=p.workdir))
    preset = _ws(status(url)).preset

    def session(seed: int, chunks: int, **opts):
        return _ws(run_session(url, preset=preset, seed=seed, chunks=chunks, prompt=prompt_for(seed),
                               opts=ViewerOptions(out_dir=files, **opts)))

    ref = session(p.seed, max(n, v))
    if ref.outcome != "complete":
        report.check("reference session completes", False, ref.error or ref.outcome)
        return report
    ref_pairs = [(h.latent_sha256, h.pixels_sha256) for h in ref.ended.hashes]
    ref_frames = ref.frame_sha256
    per_chunk = [h.frames for h in ref.headers]
    ttfc = (ref.t_first_media_ns - ref.t_start_ns) / 1e9
    points = ws_cancel_points(ttfc, n)
    if p.points:
        points = [c for c in points if c.name in p.points]
    report.header = ["#", "point", "aimed at", "client saw", "server", "reason", "KV used", "ring free", "media", "next session"]
    problems: dict[str, list[str]] = {k: [] for k in ("outcome", "kv", "ring", "media", "next")}
    verified = 0
    for i, pt in enumerate(points):
        served = _ws(status(url)).sessions_served
        rep = session(p.seed + 1 + i, n, **pt.opts)
        end = _ws(ended_of(url, rep, served, token=server.operator_token() if server else ""))
        if end is None:
            problems["outcome"].append(f"{pt.name}: the server never finished the session")
            report.rows.append([i + 1, pt.name, pt.target, rep.outcome, "?", "", "", "", "", ""])
            continue
        server_outcome = "cancelled" if end.cancelled else "complete"
        if server_outcome != pt.expect:
            problems["outcome"].append(f"{pt.name}: {server_outcome}")
        if end.kv_blocks_used != 0:
            problems["kv"].append(f"{pt.name}: {end.kv_blocks_used}")
        if end.ring_free != end.ring_slots:
            problems["ring"].append(f"{pt.name}: {end.ring_free}/{end.ring_slots}")
        if end.cancelled and not end.media_discarded:
            problems["media"].append(f"{pt.name}: server kept cancelled media")
        leftover = sorted(f.name for f in files.glob("*.part"))
        if leftover:
            problems["media"].append(f"{pt.name}: client left {leftover}")
        nxt = "-"
        if pt.verify:
            chk = session(p.seed, v)
            pairs = [(h.latent_sha256, h.pixels_sha256) for h in chk.ended.hashes] if chk.ended else []
            bad_media = verify_media(chk) if chk.outcome == "complete" else chk.error or chk.outcome
            same = (chk.outcome == "complete" and pairs == ref_pairs[:v] and not bad_media
                    and chk.frame_sha256 == ref_frames[:sum(per_chunk[:v])])
            verified += 1
            nxt = "identical" if same else "DIFFERS"
            if not same:
                problems["next"].append(f"after {pt.name}" + (f" ({bad_media})" if bad_media else ""))
        report.rows.append([i + 1, pt.name, pt.target, rep.outcome, server_outcome, end.reason or "-", end.kv_blocks_used,
                            f"{end.ring_free}/{end.ring_slots}", "removed" if end.media_discarded else "-", nxt])
    report.check("cancel and disconnect end the session on the server (a late cancel is a no-op)",
                 not problems["outcome"], "; ".join(problems["outcome"]))
    report.check("all KV blocks free after every session", not problems["kv"], "; ".join(problems["kv"]))
    report.check("all ring slots free after every session", not problems["ring"], "; ".join(problems["ring"]))
    report.check("no partial media claimed valid", not problems["media"], "; ".join(problems["media"]))
    report.check("the next session is bit-identical to a fresh run", not problems["next"] and verified > 0,
                 "; ".join(problems["next"]) or f"{verified} verification sessions equal the reference "
                 "(latents, pixels, frame hashes, decoded media)")
    shutil.rmtree(files, ignore_errors=True)
    report.seconds = time.monotonic() - t0
    return report


# ==== crash =======================================================================================
#: deaths are seen by polling every 5 ms, so an error can reach us a little "before" the death
WATCH_SLACK_NS = 50 * MS


def _names(message: str, key: str, first_death) -> bool:
    """The error leads with the faulted rank, and the pid it names is the process that died first."""
    head = message.split(";")[0].removeprefix("error: ")
    return head.startswith(_rank_name(key)) and (first_death is None or f"pid {first_death[0]})" in head)


def _rank_name(key: str) -> str:
    role, _, rank = key.partition(":")
    return f"{role} rank {rank}"


def _run_dir_checks(report: Report, run_dir: Path, rank: str, completed_sessions: int | None) -> None:
    import json

    from harness.measure.events import EventFormatError, read_events, validate_events

    try:
        man = json.loads((run_dir / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        report.check(f"{rank}: manifest readable", False, str(e))
        return
    try:
        events = read_events(run_dir / "events.jsonl")
        problems = validate_events(events)
    except (OSError, EventFormatError) as e:
        events, problems = [], [str(e)]
    summary_ok = (run_dir / "summary.json").exists() and json.loads((run_dir / "summary.json").read_text()).get("status") == "failed"
    named = _rank_name(rank) in (man.get("error") or "")
    bad_media = [p.name for p in (run_dir / "media").glob("*")
                 if p.name.endswith(".part") or (completed_sessions is not None and p.suffix == ".mkv"
                                                 and int(p.stem.removeprefix("session")) >= completed_sessions)]
    ok = man.get("status") == "failed" and named and not problems and summary_ok and not bad_media
    report.check(f"{rank}: run directory valid up to the failure", ok,
                 f"manifest status {man.get('status')!r}{'' if named else ' (error does not name the rank)'}, "
                 f"{len(events)} events parse and validate" + (f" — {problems[:2]}" if problems else "")
                 + ("" if summary_ok else ", summary.json missing or not 'failed'")
                 + (f", unfinished media left: {bad_media}" if bad_media else ""))


def crash_inprocess(cfg, p: Params, out_root: Path) -> Report:
    from harness.config import override
    from harness.drivers.launcher import RankFailed
    from harness.drivers.serve import ServeOptions, serve
    from harness.drivers.procwatch import DeathWatch, shm_names, wait_gone

    report = Report("crash", "inprocess")
    t0 = time.monotonic()
    report.header = ["rank", "dies at", "error", "detect ms", "teardown ms", "processes", "shm"]
    chunks = p.fault_chunk + 2
    cfg = override(cfg, video={"chunks_per_session": max(chunks, 1)}, runtime={"sessions": 1})
    for key in p.ranks:
        shm_before = shm_names(f"harness-{os.getpid()}-")
        detect: dict = {}

        def runner(ctx, detect=detect):
            try:
                res = ctx.driver.run_session(session=0, epoch=0, seed=p.seed, chunks=chunks)
                ctx.add_result(res)
            except RankFailed:
                detect["t"] = now()
                raise

        err, t_ret = None, None
        with DeathWatch(os.getpid()) as watch:
            try:
                serve(cfg, ServeOptions(out=str(out_root / key.replace(":", "")), progress=False, probes=False,
                                        faults={key: f"die-at-chunk:{p.fault_chunk}"}, session_runner=runner,
                                        protocol={"name": "scenario-crash"}))
            except RankFailed as e:
                err = e
            except Exception as e:  # anything else is a finding too
                err = e
            t_ret = now()
        first = watch.first_death()
        ours = sorted(watch.ours)
        left = wait_gone(ours, 10.0)
        shm_left = sorted(shm_names(f"harness-{os.getpid()}-") - shm_before)
        msg = "" if err is None else str(err).splitlines()[0]
        t_det = detect.get("t")
        det_ns = None if (first is None or t_det is None) else t_det - first[1]  # may be < 0 by the watch's period
        tear_ns = None if t_det is None else t_ret - t_det
        report.rows.append([key, f"chunk {p.fault_chunk}", msg or "(no error)", _ms(det_ns), _ms(tear_ns),
                            f"{len(ours)} reaped" if not left else f"ALIVE {left}", "clean" if not shm_left else shm_left])
        report.check(f"{key}: a clear error naming the rank", isinstance(err, RankFailed) and _names(msg, key, first),
                     msg or "no error raised")
        report.check(f"{key}: surfaced within {p.detect_bound_s:g} s of the death",
                     det_ns is not None and -WATCH_SLACK_NS <= det_ns <= p.detect_bound_s * 1e9,
                     f"{max(det_ns, 0) / MS:.1f} ms" if det_ns is not None else "death or error not observed")
        report.check(f"{key}: no hang (teardown within {p.teardown_bound_s:g} s)", tear_ns is not None and tear_ns <= p.teardown_bound_s * 1e9,
                     f"{tear_ns / 1e9:.2f} s" if tear_ns is not None else "-")
        report.check(f"{key}: all processes reaped, shared memory gone", not left and not shm_left and bool(ours),
                     f"{len(ours)} workers" + (f"; alive {left}" if left else "") + (f"; shm {shm_left}" if shm_left else ""))
        _run_dir_checks(report, out_root / key.replace(":", ""), key, completed_sessions=0)
    report.seconds = time.monotonic() - t0
    return report


def crash_ws(serve_args: list[str], p: Params, out_root: Path) -> Report:
    from harness.serving.client import ViewerOptions, run_session
    from harness.drivers.procwatch import DeathWatch, shm_names, wait_gone

    report = Report("crash", "websocket")
    t0 = time.monotonic()
    report.header = ["rank", "dies at", "client got", "server rc", "detect ms", "server exit ms", "processes", "shm"]
    chunks = p.fault_chunk + 2
    for key in p.ranks:
        out = out_root / f"ws-{key.replace(':', '')}"
        server = ServerProcess(serve_args, out, extra=["--fault", f"{key}=die-at-chunk:{p.fault_chunk}"])
        workers = server.workers()
        with DeathWatch(server.pid, recursive=True, exclude_existing=False) as watch:
            rep = _ws(run_session(server.url, preset=_preset_of(serve_args), seed=p.seed, chunks=chunks,
                                  prompt=prompt_for(p.seed), opts=ViewerOptions()))
            try:
                rc = server.wait(p.teardown_bound_s)
            except subprocess.TimeoutExpired:
                rc = None
            t_exit = now()
        if rc is None:
            server.stop(5)
        first = watch.first_death()
        left = wait_gone(workers, 10.0)
        shm_left = sorted(shm_names(f"harness-{server.pid}-"))
        err_lines = [ln for ln in server.stderr().splitlines() if ln.startswith("error:")]
        det_ns = None if first is None else rep.t_end_ns - first[1]
        exit_ns = None if first is None else t_exit - first[1]
        report.rows.append([key, f"chunk {p.fault_chunk}", rep.error or rep.outcome, rc, _ms(det_ns), _ms(exit_ns),
                            f"{len(workers)} reaped" if not left else f"ALIVE {left}", "clean" if not shm_left else shm_left])
        report.check(f"{key}: the client gets a clear error naming the rank",
                     rep.outcome == "error" and _names(rep.error, key, first), rep.error or rep.outcome)
        report.check(f"{key}: the server exits 1 with one error line naming the rank",
                     rc == 1 and len(err_lines) == 1 and _names(err_lines[0], key, first),
                     f"rc {rc}; {err_lines or 'no error line'}")
        report.check(f"{key}: surfaced within {p.detect_bound_s:g} s of the death, no hang",
                     det_ns is not None and -WATCH_SLACK_NS <= det_ns <= p.detect_bound_s * 1e9 and rc is not None,
                     f"client told after {_ms(det_ns)} ms, server gone after {_ms(exit_ns)} ms")
        report.check(f"{key}: all processes reaped, shared memory gone", not left and not shm_left and bool(workers),
                     f"{len(workers)} workers" + (f"; alive {left}" if left else "") + (f"; shm {shm_left}" if shm_left else ""))
        _run_dir_checks(report, out, key, completed_sessions=0)
    report.seconds = time.monotonic() - t0
    return report


def _preset_of(serve_args: list[str]) -> str:
    if "--preset" in serve_args:
        return serve_args[serve_args.index("--preset") + 1]
    if "--config" in serve_args:
        from harness.config import load_config

        return load_config(serve_args[serve_args.index("--config") + 1]).name
    return "tiny"


# ==== bad-input ===================================================================================
@dataclass
class CliCase:
    name: str
    argv: list[str]
    expect: str  # a piece of the one-line error
    rc: int = 2


def cli_cases(work: Path, serve_args: list[str]) -> list[CliCase]:
    work.mkdir(parents=True, exist_ok=True)
    bad_toml = work / "malformed.toml"
    bad_toml.write_text('name = "x"\n[model\ndim = 64\n')
    unknown = work / "unknown-key.toml"
    unknown.write_text('name = "x"\n[model]\nbogus_key = 1\n')
    wrong = work / "wrong-type.toml"
    wrong.write_text('name = "x"\n[video]\nfps = "fast"\n')
    blocker = work / "a-file"
    blocker.write_text("")
    base = _without(serve_args, "--sp", "--vae-ranks", "--device")
    out = lambda name: ["--out", str(work / name), "--no-progress"]  # noqa: E731
    cases = [
        CliCase("malformed TOML", ["serve", "--config", str(bad_toml), *out("c1")], "invalid config"),
        CliCase("unknown config key", ["serve", "--config", str(unknown), *out("c2")], "bogus_key"),
        CliCase("wrong value type", ["serve", "--config", str(wrong), *out("c3")], "Expected `int`"),
        CliCase("unknown preset", ["serve", "--preset", "no-such-preset", *out("c4")], "unknown preset"),
        CliCase("heads/tokens not divisible by SP (--sp 3)", ["serve", *base, "--sp", "3", *out("c5")], "not divisible by sp=3"),
        CliCase("latent width not divisible by VAE ranks (--vae-ranks 3)", ["serve", *base, "--vae-ranks", "3", *out("c6")],
                "not divisible by vae_ranks=3"),
        CliCase("unknown candidate", ["serve", *base, "--candidate", "H9z", *out("c7")], "unknown candidate"),
        CliCase("conflicting candidates (one switch set twice)", ["serve", *base, "--candidate", "H1b:flash", "--candidate",
                                                                  "H1b:math", *out("c8")], "given twice"),
        CliCase("bad candidate argument", ["serve", *base, "--candidate", "H1b:turbo", *out("c9")], "takes one of"),
        CliCase("candidate that needs CUDA, on CPU", ["serve", *base, "--candidate", "H1b:cudnn", "--device", "cpu", *out("c10")],
                "needs cuda"),
        CliCase("zero sessions", ["serve", *base, "--sessions", "0", *out("c11")], "must be ≥ 1"),
        CliCase("bad sink spec", ["serve", *base, "--sink", "throttled:0", *out("c12")], "positive finite"),
        CliCase("unwritable output directory", ["serve", *base, "--out", str(blocker / "run"), "--no-progress"], "not writable"),
        CliCase("--listen on a public address without --allow-remote", ["serve", *base, "--listen", "0.0.0.0:8765", *out("c14")],
                "not a loopback address"),
        CliCase("--listen with a bad port", ["serve", *base, "--listen", "127.0.0.1:http", *out("c15")], "is not a number"),
        CliCase("client: bad --connect", ["client", "--connect", "nowhere"], "expected HOST:PORT"),
        CliCase("client: nobody listening", ["client", "--connect", "127.0.0.1:9"], "cannot reach"),
    ]
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        cases.append(CliCase("--device cuda without a GPU", ["serve", *base, "--device", "cuda", *out("c16")], "no CUDA device"))
    return cases


def _without(argv: list[str], *flags: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


def _run_cli(case: CliCase) -> tuple[int, str, float]:
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "harness", *case.argv], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return p.returncode, p.stderr, time.monotonic() - t


def _run_cli_here(case: CliCase) -> tuple[int, str, float]:
    import contextlib
    import io
    import traceback

    from harness.cli import main as cli_main

    t = time.monotonic()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = cli_main(case.argv)
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 2
        except BaseException:  # noqa: BLE001 — an escaping exception is the finding
            traceback.print_exc(file=err)
            rc = -1
    return rc, err.getvalue(), time.monotonic() - t


def _claimed_valid(path: Path) -> list[str]:
    """Files under a failed run's directory that would pass for finished output."""
    import json

    out = []
    man = path / "manifest.json"
    if man.exists():
        try:
            if json.loads(man.read_text()).get("status") == "complete":
                out.append("manifest says complete")
        except ValueError:
            out.append("manifest.json unreadable")
    out += [p.name for p in path.glob("media/*.mkv")]
    return out


def bad_input_cli(p: Params, serve_args: list[str]) -> tuple[list[list], list[str]]:
    """Every CLI case as a subprocess (a few at a time); rows and problems."""
    work = Path(tempfile.mkdtemp(prefix="bad-input-", dir=p.workdir))
    cases = cli_cases(work, serve_args)
    rows, problems = [], []
    every = max(1, p.subprocess_every)
    sub = [c for i, c in enumerate(cases) if i % every == 0]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(4, (os.cpu_count() or 2)))) as pool:
        done = dict(zip((c.name for c in sub), pool.map(_run_cli, sub)))
    results = [done[c.name] if c.name in done else _run_cli_here(c) for c in cases]
    for case, (rc, err, secs) in zip(cases, results):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        errs = [ln for ln in lines if ln.startswith("error:")]
        why = []
        if rc != case.rc:
            why.append(f"exit {rc}, expected {case.rc}")
        if len(errs) != 1 or not lines or lines[-1] != errs[0]:
            why.append(f"not one error line: {lines[-3:]}")
        elif case.expect not in errs[0]:
            why.append(f"{errs[0]!r} does not say {case.expect!r}")
        if "Traceback" in err:
            why.append("traceback printed")
        if "--out" in case.argv:
            d = Path(case.argv[case.argv.index("--out") + 1])
            if d.is_dir():
                claimed = _claimed_valid(d)
                if claimed:
                    why.append(f"half-written output looks valid: {claimed}")
        how = "subprocess" if case.name in done else "cli.main"
        rows.append([case.name, how, rc, (errs[0] if errs else (lines[-1] if lines else ""))[:90], f"{secs:.1f}",
                     "ok" if not why else "FAIL"])
        if why:
            problems.append(f"{case.name}: {'; '.join(why)}")
    shutil.rmtree(work, ignore_errors=True)
    return rows, problems


def bad_input_engine(cfg) -> tuple[list[list], list[str]]:
    """Invalid actions and poses against the engine itself (a one-rank tiny DiT in this process):
    each a one-line HarnessError, and the session's state untouched (the next valid chunk runs)."""
    import numpy as np
    import torch

    from harness.config import override
    from harness.engine.conditions import SessionConditions
    from harness.engine.dit_engine import DitEngine
    from harness.engine.groups import RankGroup
    from harness.errors import HarnessError

    cfg = override(cfg, parallel={"sp": 1, "vae_ranks": 1}, runtime={"device": "cpu", "dtype": "float32"})
    eng = DitEngine(cfg, group=RankGroup.single(), device=torch.device("cpu"), seed=0)
    s = eng.start_session(SessionConditions(prompt="bad input", seed=0))
    f = cfg.video.frames_per_chunk
    rigid = np.tile(np.eye(4), (f, 1, 1))
    shear = rigid.copy()
    shear[0, 0, 1] = 0.5
    nan = rigid.copy()
    nan[1, 2, 3] = np.nan
    mirror = rigid.copy()
    mirror[2, 0, 0] = -1
    cases = [
        ("actions: invalid key", dict(actions=["W", "X", ""]), "invalid key"),
        ("actions: wrong count", dict(actions=["W"]), f"expected {f} actions"),
        ("actions: not strings", dict(actions=[1, 2, 3]), "must be a string"),
        ("poses: wrong shape", dict(poses=np.eye(4)), "shape"),
        ("poses: not rigid (shear)", dict(poses=shear), "not orthonormal"),
        ("poses: NaN", dict(poses=nan), "non-finite"),
        ("poses: reflection", dict(poses=mirror), "reflection"),
    ]
    rows, problems = [], []
    before = eng.kv_stats()["blocks_used"]
    for name, kw, expect in cases:
        try:
            eng.generate_chunk(s, **kw)
            msg, ok = "(accepted)", False
        except HarnessError as e:
            msg = str(e)
            ok = expect in msg and "\n" not in msg
        rows.append([name, "engine", "-", msg[:90], "-", "ok" if ok else "FAIL"])
        if not ok:
            problems.append(f"{name}: {msg!r}")
    state_ok = eng.kv_stats()["blocks_used"] == before and s.chunk == 0
    lat = eng.generate_chunk(s, ["W"] * f)
    rows.append(["after the refusals: a valid chunk", "engine", "-", f"latent {tuple(lat.shape)}, finite={bool(torch.isfinite(lat).all())}",
                 "-", "ok" if state_ok and torch.isfinite(lat).all() else "FAIL"])
    if not state_ok:
        problems.append("a refused chunk changed the session's KV/pose state")
    eng.end_session(s)
    return rows, problems


def bad_input_nan(cfg, out: Path) -> tuple[list[list], list[str]]:
    """A NaN latent reaching the VAE: the VAE rank refuses it with a one-line error that names the
    session and chunk, the run fails (exit 1), everything is reaped and nothing claims validity."""
    import numpy as np

    from harness.drivers.launcher import RankFailed
    from harness.drivers.serve import ServeOptions, serve
    from harness.drivers.procwatch import DeathWatch, shm_names, wait_gone
    from harness.pipeline import messages as M

    def runner(ctx) -> None:
        L, v = ctx.launcher, ctx.cfg.video
        latent = np.zeros((16, v.frames_per_chunk, v.latent_h, v.latent_w), np.float32)
        latent[3, 1, 2, 5] = np.nan
        L.fanout("vae", M.StartSession(session=0, epoch=0, seed=0))
        L.fanout("vae", M.DecodeChunk(session=0, epoch=0, chunk=0, latent=M.Tensor.of(latent)))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            L.poll(1.0)  # raises RankFailed when the VAE refuses
        raise AssertionError("the VAE accepted a NaN latent")

    shm_before = shm_names(f"harness-{os.getpid()}-")
    err: BaseException | None = None
    with DeathWatch(os.getpid()) as watch:
        try:
            serve(cfg, ServeOptions(out=str(out), progress=False, probes=False, session_runner=runner,
                                    protocol={"name": "scenario-bad-input"}))
        except BaseException as e:  # noqa: BLE001 — the error is what is being judged
            err = e
    left = wait_gone(sorted(watch.ours), 10.0)
    shm_left = sorted(shm_names(f"harness-{os.getpid()}-") - shm_before)
    msg = "" if err is None else str(err).splitlines()[0]
    ok = isinstance(err, RankFailed) and "non-finite" in msg and "vae rank" in msg and "\n" not in str(err).strip()
    claimed = _claimed_valid(out)
    row = ["NaN latent reaching the VAE", "topology", 1 if isinstance(err, RankFailed) else "?", msg[:90], "-",
           "ok" if ok and not left and not shm_left and not claimed else "FAIL"]
    problems = []
    if not ok:
        problems.append(f"NaN latent: {msg or 'no error'}")
    if left or shm_left:
        problems.append(f"NaN latent: left processes {left} / shm {shm_left}")
    if claimed:
        problems.append(f"NaN latent: {claimed}")
    return [row], problems


def bad_input_ws(url: str, p: Params) -> Report:
    """Malformed, oversized, unknown and ill-timed messages against a live server: each a one-line
    error (or, for an oversized frame, a close with code 1009), and the server serves on."""
    report = Report("bad-input", "websocket")
    t0 = time.monotonic()
    rows, problems = _ws(_bad_ws(url, p))
    report.header = ["case", "answer", "ok"]
    report.rows = rows
    report.check("every bad message gets a clear one-line answer, the connection survives", not problems, "; ".join(problems))
    report.seconds = time.monotonic() - t0
    return report


async def _bad_ws(url: str, p: Params):
    import aiohttp
    from aiohttp import WSMsgType

    from harness.serving.client import ViewerOptions, run_session, status
    from harness.serving import protocol as W

    rows, problems = [], []
    st = await status(url)
    preset = st.preset

    async def answer(ws, timeout=30.0):
        while True:
            m = await ws.receive(timeout=timeout)
            if m.type != WSMsgType.TEXT:
                return m
            msg = W.decode_server(m.data)
            if isinstance(msg, (W.Error, W.Busy)):
                return msg

    def judge(name: str, got, expect: str) -> None:
        text = getattr(got, "message", None)
        if text is None:
            text = f"closed (code {getattr(got, 'data', None)}: {getattr(got, 'extra', '')})"
        ok = expect in text and "\n" not in text
        rows.append([name, text[:100], "ok" if ok else "FAIL"])
        if not ok:
            problems.append(f"{name}: {text!r}")

    start = lambda **kw: W.encode(W.Start(preset=preset, seed=p.seed, prompt=prompt_for(p.seed), **kw))  # noqa: E731
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url) as ws:
            for name, text, expect in [
                ("not JSON", "hello{", "malformed"),
                ("JSON, not an object", "[1, 2, 3]", "Expected `object`"),
                ("unknown message type", '{"type": "launch"}', "Invalid value 'launch'"),
                ("missing field", f'{{"type": "start", "preset": "{preset}"}}', "missing required field `seed`"),
                ("wrong field type", f'{{"type": "start", "preset": "{preset}", "seed": "zero"}}', "Expected `int`"),
                ("unknown field", f'{{"type": "start", "preset": "{preset}", "seed": 1, "evil": true}}', "unknown field `evil`"),
                ("value out of range", f'{{"type": "start", "preset": "{preset}", "seed": -1}}', "Expected `int` >= 0"),
                ("prompt too long", f'{{"type": "start", "preset": "{preset}", "seed": 1, "prompt": "{"x" * 5000}"}}',
                 "length <= 2000"),
                ("preset mismatch", W.encode(W.Start(preset="lingbot-704x1280", seed=1)), "does not match the server"),
                ("conditioning image", W.encode(W.Start(preset=preset, seed=1, image=b"\x00" * 16)), "not supported"),
                ("actions without a session", W.encode(W.Actions(chunk=0, actions=["W", "W", "W"])), "without a running session"),
                ("ack without a session", W.encode(W.Ack(chunk=0, received_ns=1)), "without a session"),
                ("cancel without a session", W.encode(W.Cancel()), "no running session"),
            ]:
                await ws.send_str(text)
                judge(name, await answer(ws), expect)
            await ws.send_bytes(b"\x80\x04pickle-me")
            judge("binary message (never unpickled)", await answer(ws), "binary messages are not accepted")

            # in a session: wrong actions, wrong acks, a second start, a second client
            await ws.send_str(start(chunks=2, action_timeout_s=30.0))
            started = None
            while started is None:
                m = await ws.receive(timeout=60)
                msg = W.decode_server(m.data)
                if isinstance(msg, W.Started):
                    started = msg
            f = started.latent_frames_per_chunk
            for name, msg, expect in [
                ("actions: invalid key", W.Actions(chunk=0, actions=["W", "Q!", ""][:f] + [""] * (f - 3)), "invalid key"),
                ("actions: wrong count", W.Actions(chunk=0, actions=["W"] * (f + 1)), f"expected {f} actions"),
                ("actions: chunk out of range", W.Actions(chunk=7, actions=[""] * f), "session has 2 chunks"),
                ("ack for a chunk never sent", W.Ack(chunk=1, received_ns=1), "was not sent"),
                ("second start on the same connection", W.Start(preset=preset, seed=2), "already running"),
            ]:
                await ws.send_str(W.encode(msg))
                judge(name, await answer(ws), expect)
            other = await run_session(url, preset=preset, seed=3, chunks=1, opts=ViewerOptions())
            judge("second concurrent session (capacity 1)", W.Busy(message=other.error) if other.outcome == "busy"
                  else W.Error(message=f"outcome {other.outcome}"), "busy")
            await ws.send_str(W.encode(W.Cancel()))
            ended = None
            while ended is None:
                m = await ws.receive(timeout=60)
                if m.type == WSMsgType.TEXT:
                    msg = W.decode_server(m.data)
                    if isinstance(msg, W.Ended):
                        ended = msg
            ok = ended.cancelled and ended.kv_blocks_used == 0 and ended.ring_free == ended.ring_slots
            rows.append(["that session, cancelled", f"cancelled={ended.cancelled} KV used {ended.kv_blocks_used} "
                         f"ring {ended.ring_free}/{ended.ring_slots}", "ok" if ok else "FAIL"])
            if not ok:
                problems.append("the session with bad messages did not end clean")

        async with http.ws_connect(url) as ws:
            await ws.send_str('{"type": "status", "pad": "' + "x" * (W.MAX_CONTROL_BYTES + 10) + '"}')
            m = await ws.receive(timeout=30)
            code = ws.close_code
            ok = m.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.CLOSING) and code == 1009
            rows.append([f"oversized message (> {W.MAX_CONTROL_BYTES} bytes)", f"closed with code {code}", "ok" if ok else "FAIL"])
            if not ok:
                problems.append(f"oversized message: {m.type} code {code}")

    rep = await run_session(url, preset=preset, seed=p.seed, chunks=2, prompt=prompt_for(p.seed), opts=ViewerOptions())
    ok = rep.outcome == "complete" and not rep.errors
    rows.append(["afterwards: a normal session", f"{rep.outcome}, {len(rep.headers)} chunks", "ok" if ok else "FAIL"])
    if not ok:
        problems.append(f"the server did not serve normally afterwards: {rep.error or rep.outcome}")
    return rows, problems


def bad_input_inprocess(cfg, p: Params, serve_args: list[str], out_root: Path) -> Report:
    report = Report("bad-input", "inprocess")
    t0 = time.monotonic()
    report.header = ["case", "run as", "exit", "error (one line)", "s", "ok"]
    rows, problems = bad_input_cli(p, serve_args)
    report.check(f"{len(rows)} command-line cases: one-line error, non-zero exit, nothing claimed valid",
                 not problems, "; ".join(problems))
    erows, eproblems = bad_input_engine(cfg)
    report.check("invalid actions and poses refused by the engine, state untouched", not eproblems, "; ".join(eproblems))
    nrows, nproblems = bad_input_nan(cfg, out_root / "nan-latent")
    report.check("NaN latents refused before decode", not nproblems, "; ".join(nproblems))
    report.rows = rows + erows + nrows
    report.seconds = time.monotonic() - t0
    return report


# ==== command line ================================================================================
def params_from(args: argparse.Namespace, workdir: Path) -> Params:
    from harness.errors import HarnessError

    if not 0 < args.rate:
        raise HarnessError(f"--rate must be positive, got {args.rate}")
    for name in ("slow_sessions", "cancel_chunks", "verify_chunks"):
        if getattr(args, name) < 1:
            raise HarnessError(f"--{name.replace('_', '-')} must be ≥ 1")
    ranks = tuple(r.strip() for r in args.ranks.split(",") if r.strip())
    for r in ranks:
        role, _, idx = r.partition(":")
        if role not in ("dit", "vae") or not idx.isdigit():
            raise HarnessError(f"--ranks: {r!r} is not ROLE:RANK with ROLE dit or vae")
    return Params(seed=args.seed or 0, chunks=args.chunks, rate=args.rate, slow_sessions=args.slow_sessions,
                  cancel_chunks=args.cancel_chunks, verify_chunks=args.verify_chunks,
                  points=tuple(x.strip() for x in args.points.split(",")) if args.points else None, ranks=ranks,
                  fault_chunk=args.fault_chunk, detect_bound_s=args.detect_bound, rss_slack_mib=args.rss_slack_mib,
                  workdir=workdir)


def main(args: argparse.Namespace) -> int:
    from harness.drivers.options import resolve_config
    from harness.errors import HarnessError

    if args.points == "list":  # the points of the chosen transport; timings are illustrative
        points = (cancel_points(20 * MS, 500 * MS, args.cancel_chunks) if args.over == "inprocess"
                  else ws_cancel_points(1.0, args.cancel_chunks))
        for pt in points:
            print(f"{pt.name:<28} {pt.target}")
        return 0
    if getattr(args, "launcher", "local") != "local":
        raise HarnessError("scenarios run on the local launcher only (they watch worker processes through /proc)")
    cfg = resolve_config(args)
    work = Path(tempfile.mkdtemp(prefix="harness-scenario-"))
    out_root = Path(args.out) if args.out else REPO_ROOT / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-scenario-{args.scenario}"
    p = params_from(args, work)
    if args.scenario == "crash":
        max_rank = {"dit": cfg.parallel.sp, "vae": cfg.parallel.vae_ranks}
        for r in p.ranks:
            role, _, idx = r.partition(":")
            if int(idx) >= max_rank[role]:
                raise HarnessError(f"--ranks: {r} does not exist (sp={cfg.parallel.sp}, vae_ranks={cfg.parallel.vae_ranks})")
    try:
        report = _dispatch(args, cfg, p, out_root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(report.text())
    print(f"output: {out_root}")
    return 0 if report.ok else 1


def _dispatch(args, cfg, p: Params, out_root: Path) -> Report:
    sargs = serve_argv(args)
    if args.over == "inprocess":
        if args.scenario == "crash":
            return crash_inprocess(cfg, p, out_root)
        if args.scenario == "bad-input":
            return bad_input_inprocess(cfg, p, sargs, out_root)
        fn = slow_consumer_inprocess if args.scenario == "slow-consumer" else cancel_inprocess
        topo = Topology(cfg, str(out_root), candidates=tuple(args.candidate))
        with topo:
            report = topo.run(lambda bench: fn(bench, p))
        leak_checks(report, topo.pids, topo.result.ring_prefix if topo.result else None)
        return report
    if args.scenario == "crash":
        if args.connect:
            raise_usage("crash --over websocket launches its own faulty servers; --connect cannot be used")
        return crash_ws(sargs, p, out_root)
    server = None if args.connect else ServerProcess(sargs, out_root)
    url = server.url if server else _url(args.connect)
    try:
        if args.scenario == "slow-consumer":
            report = slow_consumer_ws(url, p, server)
        elif args.scenario == "cancel":
            report = cancel_ws(url, p, server)
        else:
            report = bad_input_ws(url, p)
    finally:
        if server is not None:
            workers = server.workers()
            rc = server.stop()
    if server is not None:
        from harness.drivers.procwatch import shm_names, wait_gone

        left = wait_gone(workers, 10.0)
        shm = sorted(shm_names(f"harness-{server.pid}-"))
        report.check("server stops cleanly: no leaked processes or shared memory", rc == 0 and not left and not shm,
                     f"rc {rc}, {len(workers)} workers reaped" + (f"; alive {left}" if left else "") + (f"; shm {shm}" if shm else ""))
    return report


def _url(connect: str) -> str:
    from harness.serving.client import session_url

    return session_url(connect)


def raise_usage(msg: str):
    from harness.errors import HarnessError

    raise HarnessError(msg)
