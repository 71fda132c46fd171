"""Leak checks around every scenario test: no worker process (a multiprocessing spawn child, not
the resource tracker) and no /dev/shm/harness-* segment may outlive the test that created it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from harness.drivers.procwatch import alive, descendants, is_worker


def workers() -> set[int]:
    return {p for p in descendants(os.getpid()) if is_worker(p) and alive(p)}


def shm() -> set[str]:
    """Ring segments (``harness-<owner pid>-…``) of this process, or of an owner that is gone: a
    segment outliving its owner is a leak; a live stranger's (another test run) is not ours."""
    out = set()
    for p in Path("/dev/shm").glob("harness-*"):
        owner = p.name.split("-")[1]
        if not owner.isdigit() or int(owner) == os.getpid() or not alive(int(owner)):
            out.add(p.name)
    return out


@pytest.fixture(autouse=True)
def no_leaks():
    procs_before, shm_before = workers(), shm()
    yield
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (workers() - procs_before or shm() - shm_before):
        time.sleep(0.1)
    assert not workers() - procs_before, f"worker processes left behind: {sorted(workers() - procs_before)}"
    assert not shm() - shm_before, f"shared memory left behind: {sorted(shm() - shm_before)}"
