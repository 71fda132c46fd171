"""Command line: ``python -m harness <command>``: it parses and dispatches, nothing else.

Every user mistake surfaces as one line on stderr and exit status 2; failures of the run itself
(a dead rank, a failed gate) exit 1. A command's module is imported only when that command runs:
several import torch (≈ 1.5 s of the 2-core CI machine's time, measured with ``python -X
importtime``), and ``--help`` and the refusal of a bad option should not wait for it (≈ 0.15 s
now). The argument definitions that live beside their command (scenario, client, replay,
bench-pipeline) come from modules that import no torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from harness.drivers.config_options import add_serve_options, add_set_option
from harness.drivers.signals import install as install_signals
from harness.errors import HarnessError, report
from harness.experiments.load_options import add_load_arguments, add_sweep_arguments
from harness.experiments.bench_pipeline import add_arguments as add_bench_pipeline_arguments
from harness.experiments.replay import add_replay_arguments
from harness.experiments.scenario import add_scenario_arguments
from harness.serving.cli_options import add_client_arguments, add_compare_servers_arguments, add_serve_command

MODES = ["eager", "compiled", "deterministic"]


def _engine_options(p: argparse.ArgumentParser) -> None:
    """What bench-engine, ab-engine and ab-arms share: the config source, device, mode, session length."""
    p.add_argument("--preset", default="tiny")
    p.add_argument("--config")
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--chunks", type=int, help="chunks per session (default: the preset's session length)")
    add_set_option(p)
    p.add_argument("--json", help="also write the result to this JSON file")


def _bench_engine(p: argparse.ArgumentParser) -> None:
    _engine_options(p)
    p.add_argument("--sp", type=int)
    p.add_argument("--vae-ranks", type=int)
    p.add_argument("--mode", choices=MODES, help="DiT execution mode; compiled modes run one unmeasured warm-up session first")
    p.add_argument("--sessions", type=int, default=1, help="measured DiT sessions; memory is sampled after each (default 1)")
    p.add_argument("--peak-tflops", type=float, default=None, help="bf16 dense peak for MFU (default: measured on GPU)")
    p.add_argument("--flops-only", action="store_true", help="count FLOPs on the meta device and print one JSON line")
    p.add_argument("--candidate", action="append", default=[], metavar="ID",
                   help="apply a DiT-engine candidate (its configuration and DiT patch) before measuring (repeatable; others are refused)")
    p.add_argument("--kernels", action="store_true", help="per-kernel breakdown of one extra, untimed steady DiT chunk (GPU)")
    p.add_argument("--no-vae", action="store_true", help="benchmark the DiT only")


def _ab_engine(p: argparse.ArgumentParser) -> None:
    _engine_options(p)
    p.add_argument("--candidate", action="append", default=[], metavar="ID", help="candidate under test (repeatable)")
    p.add_argument("--sp", type=int)
    p.add_argument("--mode", choices=MODES)
    p.add_argument("--pairs", type=int, default=4, help="session pairs per launch, A and B with the same seed (default 4)")
    p.add_argument("--launches", type=int, default=3, help="separate process groups, the unit of the verdict "
                   "(default 3; 1 gives no verdict: launch-to-launch variance needs ≥ 2)")


def _ab_arms(p: argparse.ArgumentParser) -> None:
    _engine_options(p)
    p.add_argument("--arm", action="append", default=[], metavar="NAME=ID[+ID…]",
                   help="an arm: its name and a '+'-joined candidate list, e.g. both=H6a+H1b:fa3 (repeatable)")
    p.add_argument("--mode", choices=MODES)
    p.add_argument("--rounds", type=int, default=4, help="one session of the baseline and of every arm per round (default 4)")
    p.add_argument("--launches", type=int, default=1, help="fresh processes, each running every round; ≥ 2 gives "
                   "each arm a verdict over launches (default 1: a screen, no verdict)")
    p.add_argument("--kernels", action="store_true", help="per-kernel breakdown of one extra, untimed steady chunk per arm (GPU)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="bf16 dense peak for the share-of-peak rows (default: measured in this run, so two runs' shares "
                        "differ by their peaks' spread; pass one figure to compare runs on one card)")
    p.add_argument("--versus", action="append", default=[], metavar="ARM/ARM",
                   help="also time the first arm against the second, paired by round, e.g. fused/best (repeatable)")


def _gate(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument("--exact", action="store_true", help="byte-identical outputs (default: threshold gate)")
    p.add_argument("--json", help="also write the per-file results to this JSON file")


def _compare(p: argparse.ArgumentParser) -> None:
    add_serve_options(p)
    p.add_argument("--baseline", action="append", default=[], metavar="ID", help="candidate applied to both arms (repeatable)")
    p.add_argument("--rounds", type=int, help="rounds; one serve launch per arm per round (default 3)")
    p.add_argument("--until-resolved", action="store_true", help="add A B rounds until faster, slower or equivalent "
                   "(alpha spent over the looks: overall false faster/slower about 5 %%); not with --rounds")
    p.add_argument("--max-rounds", type=int, help="--until-resolved: at most this many rounds (default 24: "
                   "80 %% power at a 5 %% shift under 5 %% launch noise; docs/statistics.md)")
    p.add_argument("--margin", type=float, default=0.02, help="equivalent = the whole interval within 1 ± this (default 0.02)")
    p.add_argument("--reanalyze", action="store_true", help="judge the round directories already in --out; serve nothing "
                   "(a sequential plan, recorded or given by --until-resolved, is replayed look by look)")


def _report(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", help="where report.md and the plots go (default: the first run directory)")
    p.add_argument("--against-production", action="store_true",
                   help="add each run's table beside DESIGN §12's production figures, with ratios")
    p.add_argument("--bench", metavar="BENCH_JSON", help="bench-engine --json of the same preset on the same GPUs: "
                   "FLOPs and peaks for the MFU rows (implies --against-production)")


def _verdicts(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", metavar="RESULT", help="a compare --out directory, its compare.json, or ab-engine --json")
    p.add_argument("--json", help="also write the rows to this JSON file")


def _scenario(p: argparse.ArgumentParser) -> None:
    add_scenario_arguments(p)
    add_serve_options(p)


def _gpu_checks(p: argparse.ArgumentParser) -> None:
    p.add_argument("check", choices=["output", "vae", "vae-layout", "condition", "ffn-epilogue", "dit", "determinism", "colocate", "dit-run"])
    p.add_argument("--json", help="also write the report here")
    p.add_argument("--chunks", type=int)
    p.add_argument("--compile-mode", help="inductor mode for the compiled DiT/VAE (default: the engine's)")
    p.add_argument("--no-h2a", action="store_true")
    p.add_argument("--variants", default=None,
                   help="comma list: dit's compiled variants (gpu_checks.VARIANTS; default engine), vae-layout's "
                        "(vae_probe.VARIANTS; default all) or condition's H3c modes (default fp16,fp16-chunk,bf16-chunk; "
                        "fp32 always runs first, the reference)")
    p.add_argument("--mode", choices=MODES, help="dit-run: deterministic (default) or eager; colocate: compiled (default) or eager")
    p.add_argument("--save", help=argparse.SUPPRESS)  # dit-run: where determinism's child launches leave their latents


def _no_options(p: argparse.ArgumentParser) -> None:
    pass


#: name → (help, the function adding its options, the module and function that run it)
COMMANDS: dict[str, tuple[str, object, str]] = {
    "serve": ("serve the DiT/VAE topology end to end and write a run directory", add_serve_command,
              "harness.experiments.serve:main"),
    "bench-engine": ("time the engine alone: DiT per chunk/forward, VAE decode, FLOPs and MFU", _bench_engine,
                     "harness.experiments.bench_engine:main"),
    "ab-engine": ("A/B of a DiT-engine candidate (H1a–H1c, H2a, H6a–H6e) or a VAE one (H3a, H3b) inside one engine: gate, "
                  "steady-chunk ratio with a launch-level interval, verdict", _ab_engine, "harness.experiments.ab_engine:main"),
    "ab-arms": ("several DiT-engine candidates, each judged like ab-engine against one shared baseline in one engine "
                "(SP = 1)", _ab_arms, "harness.experiments.ab_arms:main"),
    "gate": ("numeric gate between two runs' saved outputs (exit 0 only on pass)", _gate, "harness.experiments.gate:main"),
    "compare": ("interleaved A/B (A B A B …) of --candidate against --baseline, numeric gate first", _compare,
                "harness.experiments.compare:main"),
    "report": ("report.md with tables and PNG plots for one or more run directories", _report,
               "harness.experiments.report:main"),
    "verdicts": ("every candidate's gate, ratio, interval, A/A floor and verdict in one table, from compare directories "
                 "and ab-engine JSON files", _verdicts, "harness.experiments.verdicts:main"),
    "candidates": ("list the optimisation candidates: id, gate, needs, conflicts, what they change", _no_options,
                   "harness.candidates:print_table"),
    "scenario": ("stress the serving path (DESIGN §7): prints what it saw, exits 1 when an invariant breaks", _scenario,
                 "harness.experiments.scenario:main"),
    "client": ("viewer for serve --listen: paced playback, underruns, stall time, media file", add_client_arguments,
               "harness.serving.client:main"),
    "compare-servers": ("A/B of two servers of vLLM-Omni's realtime API (client runs A B A B …, launch-level verdict at "
                        "delivered, pixel gate first)", add_compare_servers_arguments, "harness.experiments.compare_servers:main"),
    "replay": ("time inputs captured with --hooks capture (or --synthetic shapes) on every attention/GEMM/conv backend",
               add_replay_arguments, "harness.experiments.replay:main"),
    "bench-pipeline": ("time the transport primitives alone: frame ring, socket channel, FFV1 encoders (JSON lines)",
                       add_bench_pipeline_arguments, "harness.experiments.bench_pipeline:main"),
    "load": ("open-loop sessions (Poisson, bursts, a trace) against a server: queue wait, TTFC, cadence, refusals, "
             "goodput against an SLO, early stopping, time slices; one run directory", add_load_arguments,
             "harness.experiments.load:main"),
    "sweep": ("a grid of load runs (rates × replicas × candidate sets × sizes): sweep.md, sweep.json and a Pareto plot",
              add_sweep_arguments, "harness.experiments.sweep:main"),
    "gpu-checks": ("GPU acceptance checks of H3a/H4a/H4b and the compiled modes, one JSON report each (CUDA)", _gpu_checks,
                   "harness.experiments.gpu_checks:main"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness", description="Instrumented serving harness for real-time autoregressive video world models.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (text, add_options, target) in COMMANDS.items():
        sp = sub.add_parser(name, help=text)
        add_options(sp)
        sp.set_defaults(fn=target)
    return p


def dispatch(target: str, args: argparse.Namespace) -> int:
    """Run ``module:function`` on the parsed arguments (the module imported now: see the docstring)."""
    module, _, attr = target.partition(":")
    return int(getattr(importlib.import_module(module), attr)(args) or 0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:  # the process's own command line: SIGINT/SIGTERM stop it even if its parent ignored SIGINT
        install_signals()
    try:
        return dispatch(args.fn, args)
    except HarnessError as e:
        return report(e)
    except KeyboardInterrupt as e:
        print(f"interrupted ({e})" if str(e) else "interrupted", file=sys.stderr)
        return 128 + getattr(e, "signum", 2)


if __name__ == "__main__":
    sys.exit(main())
