"""Command line: ``python -m harness <command>``.

Every user mistake surfaces as one line on stderr and exit status 2; failures of the run itself
(a dead rank, a failed gate) exit 1. Heavy imports happen inside the commands so ``--help``
and the error paths stay fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.errors import HarnessError

EXIT_USAGE = 2
EXIT_FAIL = 1


# ---- shared serve options ------------------------------------------------------------------
def add_serve_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--config", help="TOML config file (see configs/)")
    src.add_argument("--preset", default=None, help="preset name from configs/ (default: tiny)")
    g.add_argument("--candidate", action="append", default=[], metavar="ID", help="apply an optimisation candidate (repeatable)")
    g.add_argument("--scheduler", choices=["case-d", "case-e"])
    g.add_argument("--mode", choices=["eager", "compiled", "deterministic"])
    g.add_argument("--sessions", type=int, help="sessions including the warm-up one (epoch 0)")
    g.add_argument("--chunks", type=int, help="chunks per session (default from the preset)")
    g.add_argument("--seed", type=int)
    g.add_argument("--hooks", default="", help="comma list: nvtx,dispatch,trace,profile[=A:B],capture[=BUDGET]")
    g.add_argument("--sp", type=int, help="DiT sequence-parallel ranks")
    g.add_argument("--vae-ranks", type=int, help="VAE width-sharded ranks")
    g.add_argument("--device", choices=["cpu", "cuda"])
    g.add_argument("--engine", choices=["reference", "vllm-omni"],
                   help="the DiT: the harness's reference engine (default) or vLLM-Omni's LingBot-World modules "
                        "(needs the vllm extra; SP=1 on CPU)")
    g.add_argument("--launcher", choices=["local", "ray"], default="local",
                   help="local processes, or Ray actors in a placement group (multi-node; needs harness[ray])")
    g.add_argument("--ray-address", help="Ray cluster to join (e.g. HEAD_IP:6379; default: RAY_ADDRESS, the local cluster, or a new one)")
    g.add_argument("--ray-frame-path", choices=["auto", "ring", "socket"], default="auto",
                   help="frames VAE rank 0 -> encoder: shared-memory ring on one node, socket across nodes (auto)")
    g.add_argument("--ray-cpus-per-rank", type=float, help="CPUs per rank bundle (default: a fair share, at most 1)")
    g.add_argument("--encoder", help="encoder backend (pyav, ffmpeg)")
    g.add_argument("--sink", help="sink (file, null)")
    g.add_argument("--ring-slots", type=int)
    g.add_argument("--dit-gpus", type=_gpu_list, help="GPU index per DiT rank, e.g. 0,1 (default: rank r on GPU r)")
    g.add_argument("--vae-gpus", type=_gpu_list, help="GPU index per VAE rank, e.g. 2,3 for separate placement")
    add_set_option(g)
    g.add_argument("--out", help="run directory (default runs/<run_id>); an existing non-empty one is refused")
    g.add_argument("--no-progress", action="store_true")


def _gpu_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated GPU indices, got {text!r}") from None


def add_set_option(p) -> None:
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field (repeatable), e.g. model.num_layers=4")


def base_config(args: argparse.Namespace):
    """--config or --preset (default tiny), then the --set overrides."""
    from harness.config import apply_sets, load_config, load_preset

    cfg = load_config(args.config) if args.config else load_preset(args.preset or "tiny")
    return apply_sets(cfg, getattr(args, "set", None) or [])


def resolve_config(args: argparse.Namespace):
    from harness.config import override

    cfg = base_config(args)
    for name in ("sessions", "chunks", "sp", "vae_ranks", "ring_slots"):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise HarnessError(f"--{name.replace('_', '-')} must be ≥ 1, got {v}")
    cfg = override(
        cfg,
        engine={"backend": getattr(args, "engine", None)},
        parallel={"sp": args.sp, "vae_ranks": args.vae_ranks, "dit_devices": getattr(args, "dit_gpus", None),
                  "vae_devices": getattr(args, "vae_gpus", None)},
        video={"chunks_per_session": args.chunks},
        runtime={
            "scheduler": args.scheduler, "mode": args.mode, "sessions": args.sessions, "seed": args.seed,
            "device": args.device, "encoder": args.encoder, "sink": args.sink, "ring_slots": args.ring_slots,
        },
    )
    from harness.candidates.explicit import refuse_rewrites
    from harness.engine import backends

    backends.check(cfg)  # e.g. the install command, before anything else happens
    specs = dict.fromkeys([*getattr(args, "candidate", []), *getattr(args, "baseline", [])])  # compare names repeats itself
    refuse_rewrites(list(specs), cfg, explicit_fields(args))  # resolves every candidate against the config
    return cfg


#: option → config field it sets, for refusing a candidate that would rewrite it
_OPTION_FIELDS = {"scheduler": "runtime.scheduler", "mode": "runtime.mode", "device": "runtime.device",
                  "encoder": "runtime.encoder", "sink": "runtime.sink", "ring_slots": "runtime.ring_slots",
                  "sessions": "runtime.sessions", "seed": "runtime.seed", "sp": "parallel.sp",
                  "vae_ranks": "parallel.vae_ranks", "chunks": "video.chunks_per_session"}


def explicit_fields(args: argparse.Namespace) -> dict[str, str]:
    """Config fields the user set on the command line (flags and --set), each with the option that set it."""
    out = {key: f"--{name.replace('_', '-')}" for name, key in _OPTION_FIELDS.items() if getattr(args, name, None) is not None}
    for item in getattr(args, "set", None) or []:
        out[item.partition("=")[0].strip()] = f"--set {item}"
    return out


def launcher_options(args: argparse.Namespace) -> dict:
    """ServeOptions fields that pick and configure the launcher."""
    if getattr(args, "launcher", "local") != "ray":
        return {"launcher": "local"}
    return {"launcher": "ray", "launcher_options": {"address": args.ray_address, "frame_path": args.ray_frame_path,
                                                    "cpus_per_rank": args.ray_cpus_per_rank}}


def parse_hooks(text: str) -> tuple[str, ...]:
    return tuple(h.strip() for h in text.split(",") if h.strip())


def add_listen_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("network endpoint")
    g.add_argument("--listen", metavar="HOST:PORT", help="serve clients over WebSocket (ws://HOST:PORT/session); "
                   "loopback only unless --allow-remote; --sessions then caps the sessions served")
    g.add_argument("--allow-remote", action="store_true", help="allow --listen on a non-loopback address")
    g.add_argument("--window", type=int, help="chunks sent to a client and not yet acknowledged (default 2)")
    g.add_argument("--action-timeout", type=float, help="seconds to wait for a chunk's actions before cancelling (default 10)")
    g.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="accept WebSocket requests from this Origin too (repeatable; '*' skips the Origin/Host check)")
    g.add_argument("--idle-timeout", type=float, help="seconds a connection may stay silent without a session (default 30)")
    g.add_argument("--warmup-chunks", type=int, help="chunks generated before 'listening' (default: a whole session "
                   "in compiled mode, 1 on CUDA, 0 on CPU)")
    g.add_argument("--fault", action="append", default=[], help=argparse.SUPPRESS)  # ROLE:RANK=die-at-chunk:N (scenarios)


# ---- commands ------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    if getattr(args, "listen", None):  # the WebSocket endpoint: sessions come from clients
        if getattr(args, "launcher", "local") != "local":
            raise HarnessError("--listen runs on the local launcher only (for now); drop --launcher ray")
        from harness.pipeline.server import listen_main

        return listen_main(args)
    from harness.drivers.serve import ServeOptions
    from harness.experiments.protocols import protocol_lines, run_protocol

    cfg = resolve_config(args)
    res = run_protocol(args.protocol, cfg, ServeOptions(out=args.out, overwrite=args.overwrite, candidates=tuple(args.candidate),
                                                        hooks=parse_hooks(args.hooks), progress=not args.no_progress,
                                                        **launcher_options(args)),
                       sessions=args.sessions)
    print_headline(res.run_dir, res.summary)
    for line in protocol_lines(res.summary):
        print(line)
    return 0


def print_headline(run_dir: Path, summary: dict) -> None:
    from harness.measure.headline import run_headline

    for line in run_headline(run_dir, summary):
        print(line)


def cmd_gate(args: argparse.Namespace) -> int:
    import msgspec

    from harness.drivers.runstate import refuse_unfinished
    from harness.measure.gates import gate

    for d in (args.run_a, args.run_b):
        if not (Path(d) / "outputs").is_dir():
            raise HarnessError(f"{d} is not a run directory (no outputs/)")
        refuse_unfinished(d)
    res = gate(args.run_a, args.run_b, "exact" if args.exact else "threshold")
    for f in res.files:
        metrics = "  ".join(f"{k}={v:.3g}" for k, v in f.metrics.items())
        why = f"  ({'; '.join(f.reasons)})" if f.reasons else ""
        print(f"{'ok  ' if f.passed else 'FAIL'} {f.path}  {metrics}{why}")
    print(f"{res.kind} gate: {res.verdict} ({res.n_compared} compared, {res.n_failed} failed)")
    if args.json:
        Path(args.json).write_bytes(msgspec.json.encode(res))
    return 0 if res.passed else EXIT_FAIL


def cmd_report(args: argparse.Namespace) -> int:
    from harness.drivers.runstate import refuse_unfinished
    from harness.measure.report import main

    for d in args.runs:
        refuse_unfinished(d, allow_running=True)  # a live run's report is a snapshot; a dead one's is not a run
    return main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness", description="Instrumented serving harness for real-time autoregressive video world models.")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("serve", help="serve the DiT/VAE topology end to end and write a run directory")
    add_serve_options(sp)
    sp.add_argument("--protocol", choices=["timing", "long-tail"], default="timing",
                    help="timing: 1 warm-up + measured sessions; long-tail: 1 warm-up + 250 sessions (unless --sessions) "
                         "and the slowest samples broken down by stage")
    sp.add_argument("--overwrite", action="store_true", help="clear an existing run directory at --out first")
    add_listen_options(sp)
    sp.set_defaults(fn=cmd_serve)

    be = sub.add_parser("bench-engine", help="time the engine alone: DiT per chunk/forward, VAE decode, FLOPs and MFU")
    be.add_argument("--preset", default="tiny")
    be.add_argument("--config")
    be.add_argument("--sp", type=int)
    be.add_argument("--vae-ranks", type=int)
    be.add_argument("--device", choices=["cpu", "cuda"])
    be.add_argument("--mode", choices=["eager", "compiled", "deterministic"],
                    help="DiT execution mode; compiled modes run one unmeasured warm-up session first")
    be.add_argument("--chunks", type=int, default=None, help="chunks per DiT session (default: the preset's session length)")
    be.add_argument("--sessions", type=int, default=1, help="measured DiT sessions; memory is sampled after each (default 1)")
    add_set_option(be)
    be.add_argument("--peak-tflops", type=float, default=None, help="bf16 dense peak for MFU (default: measured on GPU)")
    be.add_argument("--flops-only", action="store_true", help="count FLOPs on the meta device and print one JSON line")
    be.add_argument("--json", help="also write the result to this JSON file")
    be.add_argument("--candidate", action="append", default=[], metavar="ID",
                    help="apply a DiT-engine candidate (its configuration and DiT patch) before measuring (repeatable; others are refused)")
    be.add_argument("--kernels", action="store_true", help="per-kernel breakdown of one extra, untimed steady DiT chunk (GPU)")
    be.add_argument("--no-vae", action="store_true", help="benchmark the DiT only")
    be.set_defaults(fn=_lazy("harness.experiments.bench_engine", "main"))

    ab = sub.add_parser("ab-engine", help="A/B of a DiT-engine candidate (H1a, H1b, H2a) inside one engine: "
                        "gate, steady-chunk ratio with a launch-level interval, verdict")
    ab.add_argument("--candidate", action="append", default=[], metavar="ID", help="candidate under test (repeatable)")
    ab.add_argument("--preset", default="tiny")
    ab.add_argument("--config")
    ab.add_argument("--sp", type=int)
    ab.add_argument("--device", choices=["cpu", "cuda"])
    ab.add_argument("--mode", choices=["eager", "compiled", "deterministic"])
    ab.add_argument("--pairs", type=int, default=4, help="session pairs per launch, A and B with the same seed (default 4)")
    ab.add_argument("--launches", type=int, default=3, help="separate process groups, the unit of the verdict "
                    "(default 3; 1 gives no verdict: launch-to-launch variance needs ≥ 2)")
    ab.add_argument("--chunks", type=int, help="chunks per session (default: the preset's session length)")
    add_set_option(ab)
    ab.add_argument("--json", help="also write the result to this JSON file")
    ab.set_defaults(fn=_lazy("harness.experiments.engine_ab", "main"))

    aa = sub.add_parser("ab-arms", help="several DiT-engine candidates, each judged like ab-engine against one shared "
                        "baseline in one engine (SP = 1)")
    _add_ab_arms_options(aa)
    aa.set_defaults(fn=_lazy("harness.experiments.ab_arms", "main"))

    gt = sub.add_parser("gate", help="numeric gate between two runs' saved outputs (exit 0 only on pass)")
    gt.add_argument("run_a")
    gt.add_argument("run_b")
    gt.add_argument("--exact", action="store_true", help="byte-identical outputs (default: threshold gate)")
    gt.add_argument("--json", help="also write the per-file results to this JSON file")
    gt.set_defaults(fn=cmd_gate)

    cp = sub.add_parser("compare", help="interleaved A/B (A B A B …) of --candidate against --baseline, numeric gate first")
    add_serve_options(cp)
    cp.add_argument("--baseline", action="append", default=[], metavar="ID", help="candidate applied to both arms (repeatable)")
    cp.add_argument("--rounds", type=int, help="rounds; one serve launch per arm per round (default 3)")
    cp.add_argument("--until-resolved", action="store_true", help="add A B rounds until faster, slower or equivalent "
                    "(alpha spent over the looks: overall false faster/slower ≤ 5 %%); not with --rounds")
    cp.add_argument("--max-rounds", type=int, help="--until-resolved: at most this many rounds (default 24: "
                    "80 %% power at a 5 %% shift under 5 %% launch noise; docs/statistics.md)")
    cp.add_argument("--margin", type=float, default=0.02, help="equivalent = the whole interval within 1 ± this (default 0.02)")
    cp.add_argument("--reanalyze", action="store_true", help="judge the round directories already in --out; serve nothing")
    cp.set_defaults(fn=_lazy("harness.experiments.compare", "main"))

    rp = sub.add_parser("report", help="report.md with tables and PNG plots for one or more run directories")
    rp.add_argument("runs", nargs="+", metavar="RUN_DIR")
    rp.add_argument("--out", help="where report.md and the plots go (default: the first run directory)")
    rp.add_argument("--against-production", action="store_true",
                    help="add each run's table beside DESIGN §12's production figures, with ratios")
    rp.add_argument("--bench", metavar="BENCH_JSON", help="bench-engine --json of the same preset on the same GPUs: "
                    "FLOPs and peaks for the MFU rows (implies --against-production)")
    rp.set_defaults(fn=cmd_report)

    vd = sub.add_parser("verdicts", help="every candidate's gate, ratio, interval, A/A floor and verdict in one table, "
                        "from compare directories and ab-engine JSON files")
    vd.add_argument("results", nargs="+", metavar="RESULT", help="a compare --out directory, its compare.json, or ab-engine --json")
    vd.add_argument("--json", help="also write the rows to this JSON file")
    vd.set_defaults(fn=_lazy("harness.experiments.verdicts", "main"))

    ca = sub.add_parser("candidates", help="list the optimisation candidates: id, gate, needs, conflicts, what they change")
    ca.set_defaults(fn=_lazy("harness.candidates", "print_table"))

    from harness.experiments.scenarios import add_scenario_arguments

    sc = sub.add_parser("scenario", help="stress the serving path (DESIGN §7): prints what it saw, exits 1 when an invariant breaks")
    add_scenario_arguments(sc)
    add_serve_options(sc)
    sc.set_defaults(fn=_lazy("harness.experiments.scenarios", "main"))

    from harness.client import add_client_arguments

    cl = sub.add_parser("client", help="viewer for serve --listen: paced playback, underruns, stall time, media file")
    add_client_arguments(cl)
    cl.set_defaults(fn=_lazy("harness.client", "main"))

    from harness.experiments.replay import add_replay_arguments

    ry = sub.add_parser("replay", help="time inputs captured with --hooks capture (or --synthetic shapes) on every attention/GEMM/conv backend")
    add_replay_arguments(ry)
    ry.set_defaults(fn=_lazy("harness.experiments.replay", "main"))
    return p


def _add_ab_arms_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arm", action="append", default=[], metavar="NAME=ID[+ID…]",
                   help="an arm: its name and a '+'-joined candidate list, e.g. both=H6a+H1b:fa3 (repeatable)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--config")
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--mode", choices=["eager", "compiled", "deterministic"])
    p.add_argument("--rounds", type=int, default=4, help="one session of the baseline and of every arm per round (default 4)")
    p.add_argument("--launches", type=int, default=1, help="fresh processes, each running every round; ≥ 2 gives "
                   "each arm a verdict over launches (default 1: a screen, no verdict)")
    p.add_argument("--chunks", type=int, help="chunks per session (default: the preset's session length)")
    p.add_argument("--kernels", action="store_true", help="per-kernel breakdown of one extra, untimed steady chunk per arm (GPU)")
    add_set_option(p)
    p.add_argument("--json", help="also write the result to this JSON file")


def _lazy(module: str, attr: str):
    def run(args):
        import importlib

        return getattr(importlib.import_module(module), attr)(args)

    return run


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is None:  # the process's own command line: SIGINT/SIGTERM stop it even if its parent ignored SIGINT
        from harness.drivers.signals import install

        install()
    try:
        return int(args.fn(args) or 0)
    except HarnessError as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        from harness.errors import RunFailed

        return EXIT_FAIL if isinstance(e, RunFailed) else EXIT_USAGE
    except KeyboardInterrupt as e:
        print(f"interrupted ({e})" if str(e) else "interrupted", file=sys.stderr)
        return 128 + getattr(e, "signum", 2)


if __name__ == "__main__":
    sys.exit(main())
