"""``gate``: the numeric gate between two finished runs' saved outputs.

It refuses a directory that is not a finished run (``drivers.runstate``) before reading it.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from harness.drivers.runstate import refuse_unfinished
from harness.errors import EXIT_FAIL, HarnessError
from harness.measure.gates import gate


def main(args) -> int:
    """``python -m harness gate RUN_A RUN_B``: per-file lines, the verdict; exit 0 only on pass."""
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
