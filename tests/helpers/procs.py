"""What a test checks from outside the processes it started: live workers, ring segments, signals.
Built on ``harness.drivers.procwatch`` (the scenarios' own observer), not a second reading of /proc."""

from __future__ import annotations

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


def sigint_ignored(argv: list[str]) -> list[str]:
    """``argv`` as a background job of a non-interactive shell starts it: with SIGINT ignored, a
    disposition that exec keeps. Through ``sh``, not a ``preexec_fn``: Python code run between fork
    and exec deadlocks where another thread holds a lock (CI hung so, with five servers started at
    once beside Ray's threads)."""
    return ["/bin/sh", "-c", 'trap "" INT; exec "$@"', "sh", *argv]
