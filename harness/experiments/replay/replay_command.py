"""The ``replay`` command: check the arguments, pick the inputs, run them, write the report."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from harness.errors import HarnessError
from harness.experiments.replay.replay_options import csv, ints
from harness.experiments.replay.op_backends import BACKENDS
from harness.experiments.replay.cases import Case, load_cases, synthetic_cases
from harness.experiments.replay.outputs import build_doc, write_outputs
from harness.experiments.replay.runner import classify, replay_cases
from harness.experiments.replay.settings import KINDS
from harness.experiments.replay.single import run_single

SINGLE_DEFAULT = {"attention": "sdpa", "linear": "aten", "conv": "aten", "convert": "reference"}


def _device(name: str | None):
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise HarnessError("--device cuda: no CUDA device available")
    return torch.device(name)


def _print_backends() -> None:
    for kind in KINDS:
        print(f"{kind}:")
        for b in BACKENDS[kind].values():
            dflt = {True: "default", False: "on request", "cuda": "default on CUDA"}[b.default]
            print(f"  {b.name:<16} {dflt:<16} {'needs ' + ','.join(b.needs) if b.needs else '':<11} {b.description}")


def _checked_selection(args: argparse.Namespace) -> tuple[tuple[str, ...], list[str]]:
    """The op kinds and backend names asked for, each one known, or a one-line error."""
    ops = tuple(o for spec in (args.ops or [",".join(KINDS)]) for o in csv(spec))
    bad = [o for o in ops if o not in KINDS]
    if bad:
        raise HarnessError(f"--ops: unknown op kind {bad[0]!r} (known: {', '.join(KINDS)})")
    names = csv(args.backends)
    known = {n for reg in BACKENDS.values() for n in reg}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise HarnessError(f"--backends: unknown backend {unknown[0]!r} (known: {', '.join(sorted(known))})")
    if args.repeats < 1 or args.warmup < 0:
        raise HarnessError("--repeats must be ≥ 1 and --warmup ≥ 0")
    return ops, names


def _cases(args: argparse.Namespace, ops: tuple[str, ...]) -> tuple[list[Case], str, Path]:
    """The inputs (capture or synthetic, at most ``--limit``), where they came from, the default --out."""
    if args.synthetic:
        cases = synthetic_cases(args.synthetic, sps=ints(args.sp, "--sp"), kv=ints(args.kv, "--kv"))
        cases = [c for c in cases if c.kind in ops]
        source = f"synthetic {args.synthetic}"
        default_out = Path("runs") / f"replay-{args.synthetic}-{time.strftime('%Y%m%d-%H%M%S')}"
    elif args.run_dir:
        cases = load_cases(args.run_dir, ops)
        source = str(args.run_dir)
        default_out = Path(args.run_dir)
    else:
        raise HarnessError("replay needs RUN_DIR or --synthetic PRESET")
    if args.limit:
        cases = cases[: args.limit]
    return cases, source, default_out


def _single(args: argparse.Namespace, cases: list[Case], device) -> int:
    case = next((c for c in cases if c.op_id == args.single), None)
    if case is None:
        raise HarnessError(f"--single: no input {args.single!r} (have: {', '.join(c.op_id for c in cases[:8])}"
                           f"{', …' if len(cases) > 8 else ''})")
    bname = args.backend or SINGLE_DEFAULT[case.kind]
    backend = BACKENDS[case.kind].get(bname)
    if backend is None:
        raise HarnessError(f"--backend {bname!r} is not a {case.kind} backend (known: {', '.join(BACKENDS[case.kind])})")
    try:
        run_single(case, backend, device, warmup=max(1, args.warmup if args.warmup is not None else 1),
                   profile=not args.no_profiler)
    except HarnessError:
        raise
    except Exception as e:  # noqa: BLE001
        status, reason = classify(e)
        print(f"{case.op_id} on {bname}: {status} — {reason}", file=sys.stderr)
        return 1
    return 0


def _print_winners(entries: list[dict]) -> None:
    for kind in KINDS:
        es = [e for e in entries if e["kind"] == kind]
        if es:
            wins: dict[str, int] = {}
            for e in es:
                wins[e["winner"] or "none"] = wins.get(e["winner"] or "none", 0) + 1
            print(f"{kind}: {len(es)} inputs; local winners: " + ", ".join(f"{k} {v}" for k, v in sorted(wins.items(), key=lambda kv: -kv[1])))


def run(args: argparse.Namespace) -> int:
    if args.list_backends:
        _print_backends()
        return 0
    ops, names = _checked_selection(args)
    cases, source, default_out = _cases(args, ops)
    device = _device(args.device)
    if args.single:
        return _single(args, cases, device)
    if not cases:
        raise HarnessError(f"nothing to replay in {source} for --ops {','.join(ops)}")
    entries = replay_cases(cases, device=device, backends=names or None, warmup=args.warmup, repeats=args.repeats)
    doc = build_doc(entries, source=source, device=device, warmup=args.warmup, repeats=args.repeats, compare_dir=args.compare)
    paths = write_outputs(doc, args.out or default_out)
    _print_winners(entries)
    print(f"replay: {paths['md']}")
    return 0
