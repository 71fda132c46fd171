"""``python -m harness load``: sessions that arrive on their own against a streaming server.

Open loop (``measure.arrivals``): every arrival's offset is fixed by the process and its seed before
the run, and an arrival starts its session at its time whatever earlier sessions are doing (only
``--max-concurrency`` may hold it back, and then the wait is recorded). Each arriving session is a
full player of the harness's client (``serving.client.run_session``: scripted actions, paced
playout, acknowledgements) or of vLLM-Omni's API (``serving.omni_client.run_session``), on its own
connection, and every one ends with an outcome:

- ``served``: ran to its end; ``refused``: the server answered ``busy``; ``queue_timeout``: not
  admitted within ``--queue-timeout`` (the client leaves; a server-side queue that answers with a
  timeout is read the same way when its refusal says so); ``failed``: anything else (an error, a
  dropped connection, no end within ``--session-timeout``).

The run directory (the harness contract, DESIGN §10) holds ``manifest.json`` (arrival process,
seed, SLO, status on every exit path), ``load.jsonl`` (one ``measure.goodput.LoadRecord`` per
arrival), ``events.jsonl``/``sessions.jsonl`` of the sessions the server admitted (epoch = arrival
index + 1: the server warmed up before it listened, so every arrival is measured) and
``summary.json`` (the usual figures at ``delivered``, plus ``load`` and ``slices``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import shlex
import sys
from pathlib import Path

import aiohttp
import msgspec

from harness.drivers.rundir import command_line, new_run_dir, release_reserve, versions, write_json, write_jsonl
from harness.drivers.runstate import owner_record
from harness.errors import HarnessError, RunFailed
from harness.experiments import load_sessions as S
from harness.experiments.scenario.server_process import ServerProcess
from harness.measure import arrivals as A
from harness.measure.clock import now
from harness.measure.events import ChunkEvent, SessionStart
from harness.measure.figures import console_table, label
from harness.measure.goodput import EarlyStop, LoadRecord, Slo, early_stop, load_summary, parse_slo
from harness.measure.metrics import window_for
from harness.measure.slices import SliceSpec, parse_slice, slices
from harness.measure.summary import SUMMARY_FILE, build_summary, run_summary
from harness.serving import client as C
from harness.serving import omni_client as OC
from harness.serving import omni_protocol as O
from harness.serving.cli_options import add_serve_command
from harness.serving.protocol import boot_id, one_line

REFERENCE = "delivered"
DEFAULT_PRESET = "tiny"


class LoadPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``load`` was asked, validated (written whole into the manifest)."""

    api: str
    connect: str | None  # the session URL of an existing server; None: load starts one
    serve_argv: tuple[str, ...]  # the serve options of the server load starts
    preset: str | None
    arrivals: A.ArrivalSpec
    offsets_s: tuple[float, ...]
    seed: int
    duration_s: float | None
    sessions: int | None
    max_concurrency: int | None
    chunks: int | None
    slo: Slo
    slo_text: str
    early_stop: float | None
    queue_timeout_s: float
    session_timeout_s: float
    slice: SliceSpec | None
    out: str | None
    overwrite: bool = False


class _Refusing(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of argparse's usage block and exit
        raise HarnessError(f"serve options: {message}")


def serve_argv(args) -> tuple[str, ...]:
    """The server's command line from the pass-through options, checked by serve's own parser."""
    argv = ["--preset", args.preset or DEFAULT_PRESET]
    argv += [x for kv in args.set for x in ("--set", kv)] + [x for c in args.candidate for x in ("--candidate", c)]
    if args.replicas is not None:
        argv += ["--replicas", str(args.replicas)]
    argv += shlex.split(args.serve_args or "")
    if args.api == "vllm-omni":
        argv += ["--api", "vllm-omni"]
    p = _Refusing(prog="serve", add_help=False)
    add_serve_command(p)
    ns = p.parse_args([*argv, "--listen", "127.0.0.1:0"])
    if ns.out is not None:
        raise HarnessError("--serve-args --out: the server's run directory is <load run>/server")
    return tuple(argv)


def _check_numbers(args) -> None:
    for name in ("sessions", "max_concurrency", "chunks", "replicas"):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise HarnessError(f"--{name.replace('_', '-')} must be ≥ 1, got {v}")
    for name in ("duration", "queue_timeout", "session_timeout"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            raise HarnessError(f"--{name.replace('_', '-')} must be positive, got {v}")
    if args.early_stop is not None and not 0 < args.early_stop < 1:
        raise HarnessError(f"--early-stop must be a share in (0, 1), got {args.early_stop}")


def read_arrivals(text: str) -> A.ArrivalSpec:
    kind, _, arg = text.partition(":")
    trace, suffix = None, ""
    if kind == "trace" and arg:
        path = Path(arg)
        try:
            trace, suffix = path.read_text(), path.suffix.lower()
        except (OSError, UnicodeDecodeError) as e:
            raise HarnessError(f"--arrivals {text}: cannot read the trace ({getattr(e, 'strerror', None) or e})") from None
    try:
        return A.parse_arrivals(text, trace, suffix)
    except ValueError as e:
        raise HarnessError(f"--arrivals: {e}" if not str(e).startswith("--") else str(e)) from None


def plan_from_args(args) -> LoadPlan:
    """The command line as a plan; every bad value refused here, before anything starts."""
    _check_numbers(args)
    spec = read_arrivals(args.arrivals)
    try:
        offsets = A.offsets(spec, args.seed, args.duration, args.sessions)
        slo = parse_slo(args.slo)
        sl = parse_slice(args.slice) if args.slice else None
    except ValueError as e:
        raise HarnessError(str(e)) from None
    if not offsets:
        raise HarnessError(f"--arrivals {args.arrivals}: no arrival before --duration {args.duration:g} s")
    if args.connect:
        extra = [f for f, v in (("--set", args.set), ("--candidate", args.candidate), ("--replicas", args.replicas),
                                ("--serve-args", args.serve_args)) if v]
        if extra:
            raise HarnessError(f"{', '.join(extra)}: options of the server load starts; with --connect the server is "
                               "already configured")
        connect, argv = C.session_url(args.connect, O.PATH if args.api == "vllm-omni" else C.W.PATH), ()
    else:
        connect, argv = None, serve_argv(args)
    if args.out is not None and not args.out.strip():
        raise HarnessError(f"--out {args.out!r} is empty; name a directory, or leave --out out for runs/<run_id>")
    return LoadPlan(api=args.api, connect=connect, serve_argv=argv, preset=args.preset, arrivals=spec,
                    offsets_s=tuple(offsets), seed=args.seed, duration_s=args.duration, sessions=args.sessions,
                    max_concurrency=args.max_concurrency, chunks=args.chunks, slo=slo, slo_text=args.slo,
                    early_stop=args.early_stop, queue_timeout_s=args.queue_timeout,
                    session_timeout_s=args.session_timeout, slice=sl, out=args.out, overwrite=args.overwrite)


# ---- the open loop ------------------------------------------------------------------------------
class _Loop:
    """The arrivals in flight: started at their times, each ending with an outcome; early stopping."""

    def __init__(self, plan: LoadPlan, url: str, preset: str):
        self.plan, self.url, self.preset = plan, url, preset
        self.records: list[LoadRecord] = []
        self.events: list[ChunkEvent] = []
        self.stop = asyncio.Event()
        self.decision: EarlyStop | None = None
        self.stop_reason = ""
        self.slots = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
        self.host_boot = boot_id()

    async def one(self, a: S.Arrival, http: aiohttp.ClientSession) -> None:
        p = self.plan
        limit = p.queue_timeout_s + p.session_timeout_s
        if p.api == "vllm-omni":
            coro = S.omni_session(a, self.url, p.chunks, p.slo, http, self.host_boot)
        else:
            coro = S.harness_session(a, self.url, self.preset, p.chunks, p.slo, p.queue_timeout_s, http)
        if self.slots is None:
            rec, events = await S.bounded(coro, a, p.slo, limit)
        else:
            async with self.slots:
                rec, events = await S.bounded(coro, a, p.slo, limit)
        self.records.append(rec)
        self.events += events
        self.judge()

    def judge(self) -> None:
        p = self.plan
        if p.early_stop is None or self.stop.is_set():
            return
        d = early_stop(len(self.records), sum(not r.meets_slo for r in self.records), p.early_stop)
        if d.decided:
            self.decision, self.stop_reason = d, f"the SLO share ≥ {p.early_stop:g} is decided: {d.decided} ({d.why})"
            self.stop.set()

    async def run(self) -> None:
        t0 = now()
        tasks = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            for i, off in enumerate(self.plan.offsets_s):
                due = t0 + round(off * 1e9)
                await C.sleep_unless(self.stop, (due - now()) / 1e9)
                if self.stop.is_set():
                    break
                a = S.Arrival(index=i, seed=self.plan.seed + i, planned_s=off, due_ns=due)
                tasks.append(asyncio.create_task(self.one(a, http)))
            await asyncio.gather(*tasks)  # every session is bounded (S.bounded): this ends
        if self.plan.early_stop is not None and self.decision is None:
            self.decision = early_stop(len(self.records), sum(not r.meets_slo for r in self.records), self.plan.early_stop)
        self.records.sort(key=lambda r: r.index)


# ---- the run directory ---------------------------------------------------------------------------
def load_manifest(plan: LoadPlan, status: str, server: dict) -> dict:
    return {
        "command": command_line(sys.argv),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "status": status,
        "owner": owner_record(),
        "load": msgspec.to_builtins(plan) | {"offsets_s": len(plan.offsets_s)},
        "arrivals": {"process": plan.arrivals.text, "seed": plan.seed, "unit": "poisson RATE in sessions per minute",
                     "planned": len(plan.offsets_s)},
        "slo": {"text": plan.slo_text, "definition": plan.slo.describe(), "early_stop": plan.early_stop},
        "seeds": {"run": plan.seed, "sessions": "seed + arrival index"},
        "protocol": {"name": "load", "api": plan.api, "reference_boundary": REFERENCE, "media": "client (not kept)",
                     "epochs": "arrival index + 1 (the server warmed up before it listened)",
                     "window": msgspec.to_builtins(window_for(plan.chunks or 10))},
        "server": server,
        "versions": versions(),
    }


def load_figures(plan: LoadPlan, loop: _Loop, status: str, error: str | None):
    recs = loop.records
    starts = [SessionStart(session=r.index, epoch=r.index + 1, start_ns=r.start_sent_ns, cancelled=r.outcome != "served")
              for r in recs if r.started_ns is not None and r.start_sent_ns is not None]
    figures = build_summary(loop.events, starts, window=window_for(plan.chunks or 10), reference=REFERENCE)
    load = load_summary(recs, plan.slo, plan.slo_text, plan.arrivals.text, A.offered_per_min(plan.arrivals),
                        loop.decision, loop.stop_reason)
    sl = (slices([r.planned_s for r in recs], [r.intervals_ms if r.outcome == "served" else [] for r in recs], plan.slice)
          if plan.slice and recs else None)
    summary = run_summary(figures, status=status, error=error, hooks=[], candidates=[], probes={},
                          sessions_completed=sum(r.outcome == "served" for r in recs), stalls=[], stall_report_s=0.0,
                          protocol="load", load=load, slices=sl)
    return starts, summary


def finish(run_dir: Path, plan: LoadPlan, loop: _Loop, status: str, error: str | None, man: dict) -> dict:
    release_reserve(run_dir)
    starts, summary = load_figures(plan, loop, status, error)
    write_jsonl(run_dir / "load.jsonl", loop.records)
    write_jsonl(run_dir / "events.jsonl", sorted(loop.events, key=lambda e: e.key))
    write_jsonl(run_dir / "sessions.jsonl", starts)
    write_json(run_dir / SUMMARY_FILE, summary)
    man.update(status=status, error=error, ended=_dt.datetime.now(_dt.timezone.utc).isoformat(), summary=SUMMARY_FILE)
    write_json(run_dir / "manifest.json", man)
    return msgspec.to_builtins(summary)


def _start_server(plan: LoadPlan, run_dir: Path) -> ServerProcess:
    try:
        return ServerProcess(list(plan.serve_argv), run_dir / "server")
    except RuntimeError as e:  # the server it started exited or never listened: the run failed, not the user
        raise RunFailed(one_line(str(e))) from None


def run_load(plan: LoadPlan) -> tuple[Path, dict, list[LoadRecord]]:
    """Start the server (unless --connect), offer the sessions, write the run directory; the
    manifest's status is written on every exit path."""
    run_dir = new_run_dir(plan.out, "load", plan.overwrite)
    man = load_manifest(plan, "running", {"started_by_load": plan.connect is None, "argv": list(plan.serve_argv)})
    write_json(run_dir / "manifest.json", man)
    status, error, server, loop = "failed", None, None, None
    try:
        if plan.connect is None:
            server = _start_server(plan, run_dir)
            man["server"].update(url=server.url, run_dir="server")
        url = plan.connect or server.url
        preset = plan.preset or (DEFAULT_PRESET if server else None)
        if preset is None and plan.api == "harness":
            preset = asyncio.run(C.status(url)).preset
        loop = _Loop(plan, url, preset or "")
        asyncio.run(loop.run())
        status = "complete"
    except KeyboardInterrupt as e:
        status, error = "interrupted", one_line(f"interrupted ({e})" if str(e) else "interrupted")
        raise
    except BaseException as e:
        error = one_line(f"{type(e).__name__}: {e}") if not isinstance(e, HarnessError) else str(e)
        raise
    finally:
        if server is not None:
            rc = server.stop()
            man["server"]["exit"] = rc
        loop = loop or _Loop(plan, "", "")
        summary = finish(run_dir, plan, loop, status, error, man)
    return run_dir, summary, loop.records


# ---- the console ---------------------------------------------------------------------------------
LOAD_COLUMNS = ("load_index", "load_outcome", "load_queue_wait", "load_ttfc", "load_interval_p50", "client_underruns",
                "load_continuous", "load_meets_slo")


def _f(v, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def session_rows(recs: list[LoadRecord]) -> list[str]:
    rows = [[str(r.index), r.outcome, _f(r.queue_wait_ms), _f(r.ttfc_ms), _f(r.interval_p50_ms), str(r.underruns),
             _f(r.continuous_ratio and 100 * r.continuous_ratio, "{:.1f} %"), "yes" if r.meets_slo else "no"] for r in recs]
    return console_table(LOAD_COLUMNS, rows)


def run_lines(s: dict) -> list[str]:
    ld = s["load"]
    g = ld["goodput"]
    out = [f"{label('load_offered')}: {_f(ld['offered_per_min'], '{:.2f}')} /min (process nominal "
           f"{_f(ld['nominal_per_min'], '{:.2f}')})   {label('load_served')}: {_f(ld['served_per_min'], '{:.2f}')} /min   "
           f"outcomes: {', '.join(f'{k} {v}' for k, v in ld['outcomes'].items())}",
           f"{label('load_goodput')} ({ld['slo_text']}): {_f(g['per_min'], '{:.2f}')} /min  "
           f"[{_f(g['low'], '{:.2f}')}, {_f(g['high'], '{:.2f}')}] {g['confidence']:.0%} ({g['method']}); "
           f"{ld['meeting_slo']} of {ld['sessions']} met it"]
    if ld["stopped_early"]:
        out.append(f"stopped early: {ld['stop_reason']}")
    elif ld.get("early_stop"):
        out.append(f"early stopping: not decided ({ld['early_stop']['why']})")
    for sl in (s.get("slices") or {}).get("slices", []):
        out.append(f"  slice {sl['index']} (sessions {sl['first_session']}–{sl['last_session']}): "
                   f"{label('slice_p50')} {_f(sl['p50_ms'])} [{_f(sl['low_ms'])}, {_f(sl['high_ms'])}]"
                   f"{'  DRIFTED beyond the run interval' if sl['drifted'] else ''}")
    return out


def main(args) -> int:
    plan = plan_from_args(args)
    run_dir, summary, recs = run_load(plan)
    return OC.print_run(session_rows(recs) + run_lines(summary), run_dir, summary)
