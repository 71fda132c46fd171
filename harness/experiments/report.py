"""``report``: report.md and the plots of one or more run directories (``measure.run_report``).

It takes a finished run or a live one (a snapshot), never a dead one (``drivers.runstate``).
"""

from __future__ import annotations

from harness.drivers.runstate import refuse_unfinished
from harness.measure import run_report


def main(args) -> int:
    """``python -m harness report RUN_DIR…``."""
    for d in args.runs:
        refuse_unfinished(d, allow_running=True)  # a live run's report is a snapshot; a dead one's is not a run
    return run_report.main(args)
