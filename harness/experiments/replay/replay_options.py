"""The ``replay`` command's arguments, and the parsing of its comma lists.

Torch-free, like ``settings``: the command line builds this parser for every command.
"""

from __future__ import annotations

import argparse

from harness.errors import HarnessError
from harness.experiments.replay.settings import DEFAULT_REPEATS, DEFAULT_WARMUP, KINDS, SYNTHETIC_KV, SYNTHETIC_SP


def csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def ints(text: str, flag: str) -> tuple[int, ...]:
    """Positive integers of a comma list, or a one-line error naming ``flag``."""
    try:
        v = tuple(int(x) for x in csv(text))
    except ValueError:
        raise HarnessError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not v or min(v) < 1:
        raise HarnessError(f"{flag}: expected positive integers, got {text!r}")
    return v


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="run directory of a serve with --hooks capture")
    p.add_argument("--synthetic", metavar="PRESET", help="production attention shapes of PRESET (e.g. lingbot-480x832) instead of a capture")
    p.add_argument("--sp", default=",".join(map(str, SYNTHETIC_SP)), help="--synthetic: SP degrees (local heads = heads/SP), default 1,2")
    p.add_argument("--kv", default=",".join(map(str, SYNTHETIC_KV)), help="--synthetic: effective K lengths, default 4680,14040,28080")
    p.add_argument("--ops", action="append", default=[], help=f"op kinds to replay (comma list or repeated; {', '.join(KINDS)})")
    p.add_argument("--backends", default="", help="comma list of backends (default: every default backend of each kind)")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help=f"timed calls per backend (default {DEFAULT_REPEATS})")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help=f"untimed calls before timing (default {DEFAULT_WARMUP})")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--limit", type=int, help="replay only the first N inputs")
    p.add_argument("--compare", metavar="DIR", help="directory holding compare.json of `compare --candidate H1b:<backend>`")
    p.add_argument("--out", help="where replay.json/.md/.png go (default: RUN_DIR)")
    p.add_argument("--single", metavar="OP_ID", help="run one input alone (for ncu/nsys) and print the kernels it launched")
    p.add_argument("--backend", help="--single: which backend (default: sdpa / aten / reference)")
    p.add_argument("--no-profiler", action="store_true", help="--single: skip torch.profiler (when running under ncu)")
    p.add_argument("--list-backends", action="store_true", help="print the backends and exit")
