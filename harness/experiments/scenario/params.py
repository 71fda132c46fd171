"""What a scenario is asked to do: ``Params``, checked from the command line's arguments."""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import HarnessError
from harness.experiments.scenario.scenario_options import ARM_NAMES


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
    #: bad-input: run every n-th command-line case as a real subprocess and the others in this
    #: process (same parsing, same error path, no interpreter start-up)
    subprocess_every: int = 1
    player: str = "random:0"  # interactive: the player's trace (client --player)
    arms: tuple[str, ...] = ARM_NAMES  # interactive: the arms, in order


def params_from(args: argparse.Namespace, workdir: Path) -> Params:
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
                  workdir=workdir, player=args.player, arms=arms_from(args.arms))


def arms_from(text: str) -> tuple[str, ...]:
    """``--arms``: a comma list of interactive's arms, each once."""
    arms = tuple(a.strip() for a in text.split(",") if a.strip())
    bad = [a for a in arms if a not in ARM_NAMES]
    if bad or not arms or len(set(arms)) != len(arms):
        raise HarnessError(f"--arms: expected distinct names from {', '.join(ARM_NAMES)}, got {text!r}")
    return arms
