"""Leak checks around every scenario test: no worker process (a multiprocessing spawn child, not
the resource tracker) and no /dev/shm/harness-* segment of this process or of a server it started
may outlive the test that created it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from harness.drivers.runstate import ring_owner
from harness.experiments.scenario import ServerProcess

from helpers.procs import live_workers


def workers() -> set[int]:
    return set(live_workers(os.getpid(), recursive=True))


def shm() -> set[str]:
    """Ring segments (``harness-<owner pid>-…``) this process or a server it started created. Only
    those: another test run on the machine may leave (or deliberately kill) segments of its own."""
    ours = {os.getpid(), *ServerProcess.started}
    return {p.name for p in Path("/dev/shm").glob("harness-*") if ring_owner(p.name) in ours}


@pytest.fixture(autouse=True)
def no_leaks():
    procs_before, shm_before = workers(), shm()
    yield
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (workers() - procs_before or shm() - shm_before):
        time.sleep(0.1)
    assert not workers() - procs_before, f"worker processes left behind: {sorted(workers() - procs_before)}"
    assert not shm() - shm_before, f"shared memory left behind: {sorted(shm() - shm_before)}"
