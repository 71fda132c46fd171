"""``serve``: the command (``main``: the embedded driver, or the endpoint with ``--listen``) and its
measurement protocols (DESIGN §4): how many sessions a serve runs and what its summary adds. The
run itself — launch, sessions, run directory — is ``drivers.serve_run``.

- ``timing``: 1 warm-up + the measured sessions of the config (``--sessions`` counts them all);
  steady chunks 5–8 (clipped to shorter sessions by ``metrics.window_for``).
- ``long-tail``: 1 warm-up + 250 measured sessions unless ``--sessions`` says otherwise, i.e.
  1000 steady intervals at the default window; the summary gains ``long_tail``: P50/P95/P99/max
  with session-bootstrap intervals and the slowest steady samples broken down by boundary and
  stage (``measure.tails``).

The protocol is recorded in the manifest (``protocol.name``, sessions, window) and its name in
``summary.json``.
"""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path
from typing import Literal

import msgspec

from harness.config import HarnessConfig, override
from harness.drivers.config_options import launcher_options, resolve_config
from harness.drivers.serve_run import ServeOptions, ServeResult, serve
from harness.errors import HarnessError
from harness.hooks import parse_hooks
from harness.measure import figures as F
from harness.measure import tails
from harness.measure.headline import run_headline
from harness.measure.metrics import steady_intervals, window_for
from harness.measure.slices import SliceSpec, slices
from harness.serving.omni_server import omni_listen_main
from harness.serving.server import listen_main

ProtocolName = Literal["timing", "long-tail"]
PROTOCOLS: tuple[str, ...] = ("timing", "long-tail")
WARMUP_SESSIONS = 1
LONG_TAIL_MEASURED = 250
TAIL_BOUNDARIES: tuple[str, ...] = ("cpu_ready", "encoded", "delivered")
TAIL_REFERENCE = "cpu_ready"


class MeasurementProtocol(msgspec.Struct, frozen=True, kw_only=True):
    name: ProtocolName
    #: every session, the warm-up one included (the meaning of --sessions)
    sessions: int
    warmup_sessions: int = WARMUP_SESSIONS
    chunks_per_session: int
    window_first_chunk: int
    window_last_chunk: int
    #: long-tail only: how many slowest samples the summary breaks down
    slowest: int = 0
    reference: str = TAIL_REFERENCE

    @property
    def measured_sessions(self) -> int:
        return self.sessions - self.warmup_sessions


def protocol_for(name: str, cfg: HarnessConfig, sessions: int | None = None,
                 slowest: int = tails.DEFAULT_SLOWEST) -> MeasurementProtocol:
    """The protocol ``name`` on ``cfg``; ``sessions`` (all of them, warm-up included) overrides its default."""
    if name not in PROTOCOLS:
        raise HarnessError(f"unknown protocol {name!r} (known: {', '.join(PROTOCOLS)})")
    if sessions is not None and sessions < 1:
        raise HarnessError(f"--sessions must be ≥ 1, got {sessions}")
    if name == "long-tail":
        n = sessions if sessions is not None else WARMUP_SESSIONS + LONG_TAIL_MEASURED
        if n <= WARMUP_SESSIONS:
            raise HarnessError(f"the long-tail protocol needs measured sessions after the warm-up; --sessions {n} has none")
    else:
        n, slowest = sessions if sessions is not None else cfg.runtime.sessions, 0
    w = window_for(cfg.video.chunks_per_session)
    return MeasurementProtocol(name=name, sessions=n, chunks_per_session=cfg.video.chunks_per_session,
                    window_first_chunk=w.first_chunk, window_last_chunk=w.last_chunk, slowest=slowest)


def apply(cfg: HarnessConfig, proto: MeasurementProtocol) -> HarnessConfig:
    return override(cfg, runtime={"sessions": proto.sessions})


def summary_extra(proto: MeasurementProtocol):
    """What the protocol adds to ``summary.json`` (None: nothing)."""
    if proto.name != "long-tail":
        return None

    def long_tail(events, sessions, window) -> dict:
        t = tails.tail_summary(events, sessions, window, reference=proto.reference, boundaries=TAIL_BOUNDARIES, k=proto.slowest)
        return {"long_tail": msgspec.to_builtins(t), "slices": msgspec.to_builtins(tail_slices(events, sessions, window, proto.reference))}

    return long_tail


#: the long-tail protocol's time slices: 25 measured sessions each (250 sessions: 10 slices)
LONG_TAIL_SLICE = SliceSpec("sessions", 25)


def tail_slices(events, sessions, window, reference: str):
    """The steady intervals at ``reference`` per slice of measured sessions (in session order), drift flagged."""
    per = [[v / 1e6 for v in s] for s in steady_intervals(events, reference, window, sessions).per_session()]
    return slices([float(i) for i in range(len(per))], per, LONG_TAIL_SLICE, figure=f"interval P50 ms @ {reference}")


def slice_lines(summary: dict) -> list[str]:
    sl = summary.get("slices")
    if not sl or not sl["slices"]:
        return []
    out = [f"  {F.label('slice_p50')} per {sl['spec']['size']:g} sessions (run {sl['run_p50_ms']:.1f} "
           f"[{sl['run_low_ms']:.1f}, {sl['run_high_ms']:.1f}]): "
           + ", ".join(f"{x['p50_ms']:.1f}{' (' + F.label('slice_drifted') + ')' if x['drifted'] else ''}"
                       for x in sl["slices"] if x["p50_ms"] is not None)]
    return out


def serve_options(proto: MeasurementProtocol, opts: ServeOptions) -> ServeOptions:
    return replace(opts, protocol=msgspec.to_builtins(proto), summary_extra=summary_extra(proto))


def run_protocol(name: str, cfg: HarnessConfig, opts: ServeOptions, sessions: int | None = None) -> ServeResult:
    """Serve ``cfg`` under protocol ``name`` (``sessions``: the user's --sessions, if given)."""
    proto = protocol_for(name, cfg, sessions)
    return serve(apply(cfg, proto), serve_options(proto, opts))


def protocol_lines(summary: dict, top: int = 3) -> list[str]:
    """Console lines a protocol adds to serve's headline: small tables headed by ``measure.figures``
    labels, like the headline (the report shows the same tables)."""
    lt = summary.get("long_tail")
    if not lt:
        return []
    cols, rows = tails.percentile_table(lt)
    out = [f"  {F.label('tail_percentiles')}:", *F.console_table(cols, rows, indent="    ")]
    if any(c.endswith("*") for r in rows for c in r):
        out.append("    * too few samples for that percentile: it is the maximum")
    slow = tails.slowest_table(lt, top)
    if slow:
        out += [f"  slowest steady intervals @ {lt['reference']} ({len(slow)} of {len(lt['slowest'])}):",
                *F.console_table(tails.SLOWEST_COLUMNS, slow, indent="    ")]
    if lt["culprits"]:
        out.append(f"  {F.label('culprits')}: " + ", ".join(f"{k} {v}" for k, v in lt["culprits"].items()))
    return out + slice_lines(summary)


def main(args) -> int:
    """``python -m harness serve``: the protocol's sessions from the embedded driver, or — with
    ``--listen`` — the WebSocket endpoint's sessions from its clients."""
    api = getattr(args, "api", "harness")
    if api == "harness":
        omni_only = [f for f, v in (("--start-timeout", getattr(args, "start_timeout", None)),
                                    ("--stall-timeout", getattr(args, "stall_timeout", None)),
                                    ("--served-model-name", getattr(args, "served_model_name", None)),
                                    ("--image-reference ignore", getattr(args, "image_reference", "refuse") == "ignore" or None))
                     if v is not None]
        if omni_only:
            raise HarnessError(f"{', '.join(omni_only)}: options of --api vllm-omni")
    listen_only = [f for f in ("replicas", "replica_gpus", "queue", "queue_timeout", "session_cap", "max_peer_connections")
                   if getattr(args, f, None) is not None]
    if listen_only and not getattr(args, "listen", None):
        raise HarnessError(f"--{listen_only[0].replace('_', '-')} is an option of the network endpoint: add --listen HOST:PORT")
    if getattr(args, "listen", None):
        return omni_listen_main(args) if api == "vllm-omni" else listen_main(args)
    if api != "harness":
        raise HarnessError(f"--api {api} is the network endpoint's protocol: add --listen HOST:PORT")
    cfg = resolve_config(args)
    res = run_protocol(args.protocol, cfg, ServeOptions(out=args.out, overwrite=args.overwrite, candidates=tuple(args.candidate),
                                                        hooks=parse_hooks(args.hooks), progress=not args.no_progress,
                                                        announce=announce, **launcher_options(args)),
                       sessions=args.sessions)
    for line in [*run_headline(res.run_dir, res.summary, with_dir=False), *protocol_lines(res.summary), next_line(res.run_dir)]:
        print(line)
    return 0


def announce(run_dir) -> None:
    """Where the run writes, before anything starts (flushed: a redirected log shows it at once)."""
    print(f"run directory: {run_dir}", flush=True)


def next_line(run_dir) -> str:
    """What to run next on this run directory: commands that work now (the report is not written yet)."""
    d = shlex.quote(str(Path(run_dir).resolve()))
    return f"next: python -m harness report {d}   (writes report.md and its plots into the run directory)"
