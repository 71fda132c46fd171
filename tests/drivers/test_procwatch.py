"""DeathWatch: which worker died first, as the interval the watch's looks allow."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import time
from types import SimpleNamespace

from harness.drivers.launcher import Addressing
from harness.drivers.procwatch import DeathWatch, FirstDeath, stopped
from helpers.procs import wait_for


def _sleeper() -> mp.Process:
    """A worker as the watch knows them: a multiprocessing spawn child."""
    p = mp.get_context("spawn").Process(target=time.sleep, args=(120,), daemon=True)
    p.start()
    return p


def test_the_worker_killed_first_is_named_with_an_interval_around_its_death():
    with DeathWatch(os.getpid(), rescan_s=0.01) as watch:
        a, b = _sleeper(), _sleeper()
        try:
            wait_for(lambda: {a.pid, b.pid} <= watch.seen and {a.pid, b.pid} <= set(watch.alive_at), 30, "both seen running")
            t_kill = time.monotonic_ns()
            os.kill(a.pid, signal.SIGKILL)
            wait_for(lambda: a.pid in watch.deaths, 30, "the first death seen")
            wait_for(lambda: watch.alive_at[b.pid] > watch.deaths[a.pid], 30, "b seen running after a was seen gone")
            os.kill(b.pid, signal.SIGKILL)
            wait_for(lambda: b.pid in watch.deaths, 30, "the second death seen")
        finally:
            for p in (a, b):
                p.kill()
                p.join(10)
    first = watch.first_death()
    assert first is not None and first.pids == {a.pid}
    assert first.after_ns < first.by_ns == watch.deaths[a.pid] and t_kill < first.by_ns


def test_deaths_one_look_cannot_order_are_all_candidates():
    with DeathWatch(os.getpid()) as watch:
        pass
    # a and b: last seen running at 100, both found gone by 200; c ran until 300
    watch.alive_at.update({1001: 100, 1002: 110, 1003: 300})
    watch.deaths.update({1001: 200, 1002: 205, 1003: 400})
    assert watch.first_death() == FirstDeath(frozenset({1001, 1002}), after_ns=100, by_ns=200)
    watch.before.add(1001)  # a worker that was there before the watch is someone else's
    assert watch.first_death() == FirstDeath(frozenset({1002}), after_ns=110, by_ns=205)


def test_a_stopped_rank_is_the_one_a_stall_names():
    """SIGSTOP shows in /proc as stopped; a launcher then names that rank for any stage's stall
    (a stopped encoder backs the ring up into the VAE), and the stage's lead when none is stopped."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        def rank(role, n, pid):
            return SimpleNamespace(role=role, rank=n, name="encoder" if role == "encoder" else f"{role} rank {n}",
                                   process=SimpleNamespace(pid=pid))

        launcher = Addressing()
        launcher.procs = [rank("vae", 0, os.getpid()), rank("encoder", 0, child.pid)]
        assert not stopped(child.pid) and launcher.owing("vae") == "vae rank 0"
        os.kill(child.pid, signal.SIGSTOP)
        wait_for(lambda: stopped(child.pid), 10, "the child stopped")
        assert launcher.owing("vae") == f"encoder (pid {child.pid}, stopped)"
        os.kill(child.pid, signal.SIGCONT)
        wait_for(lambda: not stopped(child.pid), 10, "the child running again")
        assert launcher.owing("vae") == "vae rank 0"
    finally:
        child.kill()
        child.wait()
