"""What a test checks from outside the processes it started: live workers, ring segments, signals.
Built on ``harness.drivers.procwatch`` (the scenarios' own observer), not a second reading of /proc."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from harness.drivers.procwatch import alive, shm_names, workers_of


def live_workers(pid: int, recursive: bool = False) -> list[int]:
    """``pid``'s multiprocessing workers (children, or all descendants) that have not exited."""
    return [p for p in workers_of(pid, recursive) if alive(p)]


def run_segments(pid: int) -> set[str]:
    """The /dev/shm ring segments of the runs that process ``pid`` started (named ``harness-<pid>-…``)."""
    return shm_names(f"harness-{pid}-")


def wait_for(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def ignore_sigint() -> None:
    """A ``preexec_fn``: what a background job of a non-interactive shell inherits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
