"""One serve run, below the ``serve`` command (``experiments.serve``): launch the topology, run the
sessions, write the run directory.

Order of business: validate and create the run directory (so a bad output path fails before any
process starts), create the frame ring, launch the ranks, run warm-up + measured sessions, write
``events.jsonl`` as chunks are delivered (so a failure keeps what was measured), then the
summary. The ``finally`` always reaps every process and unlinks the ring.
"""

from __future__ import annotations

import datetime as _dt
import errno
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgspec
import torch
from tqdm import tqdm

from harness.candidates import Chosen, chosen, configure_resolved, resolve
from harness.config import VAE_TEMPORAL, HarnessConfig
from harness.drivers.driver import Driver, SessionResult
from harness.drivers.launcher import LocalLauncher, mps_running, shared_gpus, sharing_warning
from harness.drivers.ray_launcher import RayLauncher
from harness.drivers.replicas import Replica, describe as describe_replica, launch_replica, reap_replica, replica_config
from harness.drivers.rundir import host_load, manifest, new_run_dir, release_reserve, write_json, write_jsonl
from harness.drivers.runstate import owner_record, reap_dead_rings, release_claim
from harness.drivers.signals import ending, starting
from harness.drivers.signals import received as signals_received
from harness.engine import backends
from harness.engine.attention import check_backend
from harness.errors import HarnessError, RunFailed
from harness.hooks import DRIVER_REPORT, HookSet, trace_report
from harness.hooks.telemetry import check_telemetry
from harness.hooks.trace import write_trace
from harness.limits import check_fits
from harness.measure.events import ChunkEvent, read_events
from harness.measure.metrics import Window, served_chunks, window_for
from harness.measure.summary import DEFAULT_REFERENCE, SUMMARY_FILE, build_summary, run_summary
from harness.measure.telemetry_figures import run_telemetry
from harness.pipeline.encoder import encoder_class
from harness.pipeline.ring import FrameRing
from harness.workers.encoder_worker import check_sink_spec


@dataclass(frozen=True)
class ServeOptions:
    out: str | None = None
    candidates: tuple[str, ...] = ()
    #: parsed once, where the command line is read (``parse_hooks``); travels whole to every rank
    hooks: HookSet = HookSet()
    progress: bool = True
    faults: dict[str, str] = field(default_factory=dict)
    probes: bool = True  # control round trip measured once before the sessions
    #: the measurement protocol (name, …), merged into the manifest's ``protocol`` (experiments.serve sets it)
    protocol: dict = field(default_factory=lambda: {"name": "timing"})
    #: extra summary sections computed from the finished run: fn(events, sessions, window) -> dict
    summary_extra: Callable[[list, list, Window], dict] | None = None
    #: replaces the fixed loop over ``runtime.sessions`` (the network endpoint, the scenarios): it runs
    #: its own sessions on the launched topology and returns when done; teardown stays serve's
    session_runner: Callable[["ServeContext"], None] | None = None
    #: "local" (processes on this host) or "ray" (actors in a placement group; see drivers/ray_launcher.py)
    launcher: str = "local"
    #: keyword arguments of the launcher (ray: address, cpus_per_rank, frame_path, strategy)
    launcher_options: dict = field(default_factory=dict)
    #: clear an existing run directory at ``out`` first (otherwise a non-empty one is refused)
    overwrite: bool = False
    #: called with the run directory (absolute) once it is claimed, before any process starts
    #: (the ``serve`` command prints it, so a reader knows where to look while the run goes)
    announce: Callable[[Path], None] | None = None
    #: engine groups launched (``serve --listen --replicas N``; drivers/replicas.py), and each one's GPUs
    replicas: int = 1
    replica_gpus: tuple[tuple[int, ...], ...] = ()


@dataclass
class ServeContext:
    """What a session runner gets: the launched topology and the run directory's writers."""

    cfg: HarnessConfig
    driver: Driver
    launcher: LocalLauncher
    ring_slots: int
    run_dir: Path
    write_event: Callable[[ChunkEvent], None]  # one events.jsonl row
    add_result: Callable[[SessionResult], None]  # a finished session, for sessions/frames/hashes files
    #: every engine group (replica 0 is ``driver``/``launcher``); empty when ``ServeOptions.replicas`` is 1
    replicas: list[Replica] = field(default_factory=list)
    #: the run's manifest, written once more when the run ends (a runner may add what it learnt: a replica's end)
    manifest: dict = field(default_factory=dict)


@dataclass
class ServeResult:
    run_dir: Path
    sessions: list[SessionResult]
    summary: dict
    ring_prefix: str
    pids: list[int]


def ring_slot_bytes(cfg: HarnessConfig) -> int:
    return cfg.video.frames_per_chunk * VAE_TEMPORAL * cfg.video.height * cfg.video.width * 3


def serve(cfg: HarnessConfig, opts: ServeOptions, on_session: Callable[[SessionResult], None] | None = None) -> ServeResult:
    """Refuse bad input, claim the run directory, launch and run the sessions; whatever happens,
    reap every process and write how the run ended (the steps below, in order)."""
    cfg, opts, picked, memory_estimate = _preflight(cfg, opts)
    run = _open_run(cfg, opts, memory_estimate)
    run.chosen = picked
    try:  # from here every exit path (a signal during start-up included) ends in the finally below
        if opts.announce is not None:
            opts.announce(run.run_dir.resolve())
        _launch_and_run(run, on_session)
        run.status = "complete"
    except BaseException as e:
        cause = _failure(run, e)
        if cause is not e:
            raise cause from e
        raise
    finally:
        summary = _close_run(run)
    return ServeResult(run.run_dir, run.results, summary, run.prefix, run.pids)


@dataclass
class _Run:
    """What the steps of one ``serve`` share, from the run directory to the last file written."""

    cfg: HarnessConfig
    opts: ServeOptions
    run_dir: Path
    man: dict  # the manifest, rewritten as the run goes
    prefix: str  # the frame ring's shared-memory name prefix
    results: list[SessionResult] = field(default_factory=list)
    status: str = "running"
    error: str | None = None
    probes: dict = field(default_factory=dict)
    ring: FrameRing | None = None
    chosen: tuple[Chosen, ...] = ()  # the candidates as preflight resolved them, for every rank
    launcher: Any = None
    events_f: Any = None
    driver: Driver | None = None
    pids: list[int] = field(default_factory=list)
    enc: msgspec.json.Encoder = field(default_factory=msgspec.json.Encoder)
    replicas: list[Replica] = field(default_factory=list)  # every engine group, when more than one
    rows: threading.Lock = field(default_factory=threading.Lock)  # replicas' drivers write rows from their own threads

    def on_chunk(self, ev: ChunkEvent, _reply=None) -> None:
        line = self.enc.encode(ev) + b"\n"
        with self.rows:
            self.events_f.write(line)
            self.events_f.flush()


def _preflight(cfg: HarnessConfig, opts: ServeOptions) -> tuple[HarnessConfig, ServeOptions, tuple[Chosen, ...], int | None]:
    """Everything refused before anything is allocated or started; the configured config, the
    options, the candidates resolved (once, here) and the memory estimate."""
    if opts.replicas > 1 and opts.session_runner is None:
        raise HarnessError("--replicas serves sessions from clients: it needs --listen")
    backends.check(cfg)  # e.g. --engine vllm-omni without the extra: the install command, now
    check_telemetry(cfg.runtime.telemetry_hz, cfg.runtime.device)  # no GPU, no NVML: one line, before any process
    pairs = resolve(opts.candidates, cfg)  # refuses unknown/conflicting/inapplicable ids before anything starts
    cfg = configure_resolved(pairs, cfg)
    check_sink_spec(cfg.runtime.sink)  # a bad sink fails here, not as a dead encoder after launch
    encoder_class(cfg.runtime.encoder, cfg.runtime.container)  # likewise an unknown encoder (for its container)
    check_backend(cfg.runtime.attention, cfg.runtime.device)  # and an attention backend, not in every DiT rank
    memory_estimate = check_fits(cfg, device_memory(cfg))  # before the ring or any rank takes memory
    if not isinstance(opts.hooks, HookSet):  # a caller's mistake, not the user's: strings are parsed at the command line
        raise TypeError(f"ServeOptions.hooks must be a HookSet (parse_hooks), not {type(opts.hooks).__name__}")
    return cfg, opts, chosen(pairs), memory_estimate


def _open_run(cfg: HarnessConfig, opts: ServeOptions, memory_estimate: int | None) -> _Run:
    """The run directory with its first manifest (status ``running``, and who owns the run)."""
    run_dir = new_run_dir(opts.out, cfg.name, opts.overwrite)
    reap_dead_rings()  # segments of runs whose whole process group was killed
    prefix = f"harness-{os.getpid()}-{secrets.token_hex(3)}"
    man = manifest(cfg, candidates=opts.candidates, hooks=opts.hooks.items(), placement=None, devices=None,
                   extra={"status": "running", "owner": owner_record(), "memory_estimate_bytes": memory_estimate,
                          "engine": backends.describe(cfg), "host": {"cpus": os.cpu_count(), "load_start": host_load()}})
    man["protocol"].update(opts.protocol, window=msgspec.to_builtins(window_for(cfg.video.chunks_per_session)))
    try:
        _write_manifest(run_dir, man, starting=True)
    except BaseException:
        release_claim(run_dir)
        raise
    return _Run(cfg, opts, run_dir, man, prefix)


def _launch_and_run(run: _Run, on_session: Callable[[SessionResult], None] | None) -> None:
    """The frame ring, the ranks, the control probe, then the sessions."""
    cfg, opts = run.cfg, run.opts
    with starting():  # serve --listen's graceful stop would otherwise wait for every rank to be ready
        run.ring = FrameRing.create(run.prefix, cfg.runtime.ring_slots, ring_slot_bytes(cfg))
        run.man["ring"] = {"slots": cfg.runtime.ring_slots, "slot_bytes": run.ring.spec.slot_bytes}
        cfg0 = replica_config(cfg, opts.replica_gpus[0]) if opts.replica_gpus else cfg
        run.launcher = make_launcher(opts, cfg0, str(run.run_dir), msgspec.to_builtins(run.ring.spec), run.chosen)
        run.events_f = open(run.run_dir / "events.jsonl", "wb")
        run.launcher.start()
        run.driver = Driver(cfg, run.launcher, run.run_dir, on_chunk=run.on_chunk, replica=0 if opts.replicas > 1 else None)
        _launch_replicas(run, cfg0)
    _record_placement(run.man, run.launcher, cfg)
    if run.replicas:
        run.man["replicas"] = [describe_replica(r) for r in run.replicas]
    write_json(run.run_dir / "manifest.json", run.man)
    if opts.probes:
        rt = sorted(run.driver.control_round_trip_ns(20))
        run.probes["control_round_trip_ns_p50"] = rt[len(rt) // 2]
    _run_sessions(cfg, opts, run.driver, run.launcher, run.run_dir, run.on_chunk, run.results, on_session, run.replicas, run.man)


def _launch_replicas(run: _Run, cfg0: HarnessConfig) -> None:
    """Replicas 1…N−1 beside replica 0 (drivers/replicas.py); the manifest lists them all."""
    cfg, opts = run.cfg, run.opts
    if opts.replicas <= 1:
        return
    run.replicas.append(Replica(0, cfg0, run.launcher, run.driver, None, opts.replica_gpus[0] if opts.replica_gpus else ()))
    for i in range(1, opts.replicas):
        run.replicas.append(launch_replica(
            i, cfg, opts.replica_gpus[i] if opts.replica_gpus else (), run.prefix, ring_slot_bytes(cfg),
            lambda c, spec: make_launcher(opts, c, str(run.run_dir), spec, run.chosen),
            lambda c, launcher, i=i: Driver(c, launcher, run.run_dir, on_chunk=run.on_chunk, replica=i)))


def _failure(run: _Run, e: BaseException) -> BaseException:
    """The error to raise for a run that failed with ``e`` (the rank behind a symptom, a full disk
    said as such); the run's status and error are recorded from it."""
    cause = explain_failure(run.launcher, e) if run.launcher is not None else e
    run.status, run.error = ending(cause)
    if isinstance(cause, OSError) and cause.errno in _DISK_FULL:
        cause = RunFailed(f"run directory {run.run_dir}: {cause.strerror}")
    return cause


def _reap(run: _Run) -> None:
    """Every process, the ring and the events file, whatever state the run reached."""
    if run.driver is not None:
        run.driver.close()
    # After a failure, collective peers of a dead rank may never reach their Shutdown message.
    for rep in reversed(run.replicas[1:]):  # before replica 0, whose Ray launcher owns the Ray instance
        run.pids += reap_replica(rep, grace_s=10.0 if run.status != "failed" else 3.0)
    if run.launcher is not None:
        run.launcher.shutdown(grace_s=10.0 if run.status != "failed" else 3.0)
        run.pids += run.launcher.pids()
    if run.ring is not None:
        run.ring.close()
        run.ring.unlink()
    if run.events_f is not None:
        try:
            run.events_f.close()
        except OSError:  # the flush of a line a full disk refused: that failure is already the run's error
            pass


def _close_run(run: _Run) -> dict:
    """Reap, then the summary and the final manifest (how the run ended); returns the summary."""
    _reap(run)
    release_reserve(run.run_dir)  # a full disk still takes the summary and the manifest
    # serve --listen ends by a signal as its normal way out (graceful: the live session is
    # cancelled, the rest served): complete, and the manifest says which signal
    run.man["stopped_by"] = signals_received()
    ran_ok = run.status == "complete"
    summary, unwritten = {}, None
    try:
        summary = _finish(run.run_dir, run.cfg, run.results, run.status, run.error, run.probes, run.opts,
                          [st for d in _drivers(run) for st in d.stalls])
    except OSError as e:  # e.g. a full disk: say so, and claim no summary
        unwritten = f"summary not written: {e.strerror or e}"
        (run.run_dir / "summary.json").unlink(missing_ok=True)
        run.status, run.error = "failed", f"{run.error}; {unwritten}" if run.error else unwritten
    run.man.update(status=run.status, error=run.error, ended=_dt.datetime.now(_dt.timezone.utc).isoformat(),
                   summary="summary.json" if unwritten is None else None)
    run.man.setdefault("host", {})["load_end"] = host_load()
    _write_manifest(run.run_dir, run.man)
    release_claim(run.run_dir)  # the run has written its last file there
    if ran_ok and unwritten:  # nothing else is in flight: this is the run's error
        raise RunFailed(f"run directory {run.run_dir}: {unwritten}")
    return summary


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _write_manifest(run_dir: Path, man: dict, starting: bool = False) -> None:
    """Write the manifest; when the disk refuses, the one on disk (if any) still names its owner,
    so a reader sees a ``running`` run whose owner is gone as abandoned (runstate.run_status)."""
    try:
        write_json(run_dir / "manifest.json", man)
    except OSError as e:
        if starting:
            raise RunFailed(f"run directory {run_dir}: cannot write manifest.json: {e.strerror}") from None


def _drivers(run: _Run) -> list[Driver]:
    return [r.driver for r in run.replicas] or ([run.driver] if run.driver else [])


def _record_placement(man: dict, launcher, cfg: HarnessConfig) -> None:
    man["placement"] = {p.name: p.ready.device for p in launcher.procs}
    man["devices"] = sorted({p.ready.device_name for p in launcher.procs})
    man["applied_candidates"] = {p.name: p.ready.info.get("candidates", "") for p in launcher.procs if p.role != "encoder"}
    man["launcher"] = launcher.describe() if hasattr(launcher, "describe") else {"name": "local"}
    places = {r: [p.ready.device for p in launcher.procs if p.role == r] for r in ("dit", "vae")}
    mps = mps_running()
    man["gpu_sharing"] = {"shared": shared_gpus(places), "mps": mps}
    for note in (sharing_warning(places, cfg.runtime.scheduler, mps), cpu_sharing_note(cfg)):
        if note:
            print(note, file=sys.stderr)


def cpu_sharing_note(cfg: HarnessConfig) -> str | None:
    """Case E on CPU: the DiT and VAE ranks are processes sharing the host's cores, as ranks on one
    GPU without MPS share it, so decode overlaps the DiT only as far as spare cores allow."""
    if cfg.runtime.scheduler != "case-e" or cfg.runtime.device != "cpu":
        return None
    return (f"note: Case E on CPU: the DiT and VAE ranks are processes sharing this host's {os.cpu_count()} cores, "
            "so decode cannot overlap the DiT beyond the spare cores; on a small box Case E is slower than Case D")


def _run_sessions(cfg: HarnessConfig, opts: ServeOptions, driver: Driver, launcher, run_dir: Path, on_chunk,
                  results: list[SessionResult], on_session, replicas: list[Replica] = (),
                  manifest: dict | None = None) -> None:
    def add_result(res: SessionResult) -> None:
        results.append(res)
        if on_session:
            on_session(res)

    if opts.session_runner is not None:
        opts.session_runner(ServeContext(cfg, driver, launcher, cfg.runtime.ring_slots, run_dir, on_chunk, add_result,
                                         list(replicas), manifest if manifest is not None else {}))
        return
    bar = _progress(cfg, opts.progress)
    for s in range(cfg.runtime.sessions):
        add_result(driver.run_session(session=s, epoch=s, seed=cfg.runtime.seed + s))
        if bar is not None:
            bar.update(cfg.video.chunks_per_session)
    if bar is not None:
        bar.close()


def device_memory(cfg: HarnessConfig) -> int | None:
    """Bytes of the smallest GPU the DiT ranks use (None on CPU, or when no GPU is visible here)."""
    if cfg.runtime.device != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    n = torch.cuda.device_count()
    idx = cfg.parallel.dit_devices or tuple(range(cfg.parallel.sp))
    sizes = [torch.cuda.get_device_properties(i).total_memory for i in idx if 0 <= i < n]
    return min(sizes) if sizes else None


def make_launcher(opts: ServeOptions, cfg: HarnessConfig, run_dir: str, ring_spec: dict, candidates: tuple[Chosen, ...]):
    if opts.launcher == "ray":
        # each of the replicas' placement groups takes its share of the cluster's CPUs, not all of them
        return RayLauncher(cfg, run_dir, ring_spec, candidates, opts.hooks, dict(opts.faults),
                           **{"share": opts.replicas, **opts.launcher_options})
    if opts.launcher != "local":
        raise HarnessError(f"unknown launcher {opts.launcher!r} (known: local, ray)")
    return LocalLauncher(cfg, run_dir, ring_spec, candidates, opts.hooks, dict(opts.faults))


def _finish(run_dir: Path, cfg: HarnessConfig, results: list[SessionResult], status: str, error: str | None,
            probes: dict, opts: ServeOptions, stalls: list[dict] = ()) -> dict:
    write_jsonl(run_dir / "sessions.jsonl", [r.start for r in results])
    write_jsonl(run_dir / "outputs" / "hashes.jsonl", [h for r in results for h in r.chunk_hashes])
    write_jsonl(run_dir / "frames.jsonl", [{"session": r.start.session, "frame_sha256": r.frame_sha256} for r in results])
    path = run_dir / "events.jsonl"
    # stopped during start-up, before the file was opened; a failed run's last line may be cut (a full disk)
    events = read_events(path, tolerate_partial_tail=status != "complete") if path.exists() else []
    starts = [r.start for r in results]
    # a short session keeps the part of the window it has; a --listen client picks its own length
    window = window_for(min(cfg.video.chunks_per_session, served_chunks(events, starts) or cfg.video.chunks_per_session))
    figures = build_summary(events, starts, window=window)
    if opts.hooks.trace and events:
        t = time.perf_counter_ns()
        write_trace(events, run_dir / "trace.json")
        write_json(run_dir / DRIVER_REPORT, trace_report(run_dir / "trace.json", len(events), time.perf_counter_ns() - t))
    run = dict(status=status, error=error or None, hooks=list(opts.hooks.items()), candidates=list(opts.candidates),
               probes=probes, sessions_completed=len(results), stalls=list(stalls),
               stall_report_s=cfg.runtime.stall_report_s, protocol=opts.protocol.get("name", "timing"))
    if cfg.runtime.telemetry_hz:
        tel = run_telemetry(run_dir, events, starts, window, cfg.runtime.telemetry_hz, DEFAULT_REFERENCE)
        run["telemetry"] = None if tel is None else msgspec.to_builtins(tel)
    summary = run_summary(figures, **run)
    if opts.summary_extra is not None and events:
        try:
            summary = run_summary(figures, **run, **opts.summary_extra(events, starts, window))
        except Exception as e:  # _finish runs in a finally: never mask the run's own error, never lose its summary
            summary = run_summary(figures, **run, summary_extra_error=f"{type(e).__name__}: {e}")
    write_json(run_dir / SUMMARY_FILE, summary)
    return msgspec.to_builtins(summary)


def _progress(cfg: HarnessConfig, enabled: bool):
    """A progress bar on an interactive stderr only: redirected to a log it would write a ``\\r`` line
    per update."""
    if not enabled or not sys.stderr.isatty():
        return None
    return tqdm(total=cfg.runtime.sessions * cfg.video.chunks_per_session, unit="chunk", desc="serve", leave=False)


def explain_failure(launcher, err: BaseException) -> BaseException:
    """The error to report for a failed run. The local launcher names a rank that died in ``poll``
    itself; a Ray launcher has no process sentinels and re-checks its actors afterwards."""
    explain = getattr(launcher, "explain_failure", None)
    return err if explain is None else explain(err)
