"""The in-process way in: a launched topology that scenarios drive from serve's driver thread, and
what is checked once it is gone (processes reaped, ring segments unlinked)."""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from harness.config import override
from harness.drivers.driver import Driver, SessionControl
from harness.drivers.procwatch import DeathWatch, FirstDeath, shm_names, wait_gone
from harness.drivers.serve_run import ServeOptions, serve
from harness.experiments.scenario.findings import Report
from harness.measure.clock import now
from harness.pipeline import messages as M
from harness.pipeline.ring import leftover_segments


def prompt_for(seed: int) -> str:
    """Every session of a scenario with the same seed must produce the same latents and frames."""
    return f"scenario seed {seed}"


def scenario_options(out: str | None, runner, name: str, *, faults: dict | None = None,
                     candidates: tuple[str, ...] = ()) -> ServeOptions:
    """serve()'s options for a topology whose sessions a scenario runs (``runner``), quietly."""
    return ServeOptions(out=out, candidates=candidates, progress=False, probes=False, faults=dict(faults or {}),
                        session_runner=runner, protocol={"name": name})


class Bench:
    """A launched topology as a scenario drives it, from serve's driver thread."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self._next = 0
        self._drivers: dict[str, Driver] = {}

    @property
    def cfg(self):
        return self.ctx.cfg

    def run(self, seed: int, chunks: int, *, sink: str | None = None, control=None, scheduler: str | None = None):
        s, self._next = self._next, self._next + 1
        L = self.ctx.launcher
        if sink is not None:
            L.send(L.lead("encoder"), M.SetSink(session=s, sink=sink))
        control = control or SessionControl()
        control.prompt = control.prompt or prompt_for(seed)
        res = self.driver(scheduler).run_session(session=s, epoch=s, seed=seed, chunks=chunks, control=control)
        self.ctx.add_result(res)
        return res

    def driver(self, scheduler: str | None):
        """The topology's driver, or one with another schedule over the same workers (the
        schedule lives only in the driver)."""
        if scheduler is None or scheduler == self.cfg.runtime.scheduler:
            return self.ctx.driver
        if scheduler not in self._drivers:
            cfg = override(self.cfg, runtime={"scheduler": scheduler})
            self._drivers[scheduler] = Driver(cfg, self.ctx.launcher, self.ctx.run_dir, on_chunk=self.ctx.driver.on_chunk)
        return self._drivers[scheduler]

    def encoder_pid(self) -> int:
        return self.ctx.launcher.lead("encoder").process.pid

    def close(self) -> None:
        for d in self._drivers.values():
            d.close()


class Topology:
    """serve() in a background thread whose session runner executes submitted jobs, so that
    several scenarios (or many cancel points) share one launch. ``close()`` tears down and
    returns serve's result (its ring prefix and worker pids are what the leak checks need)."""

    def __init__(self, cfg, out: str | None, faults: dict | None = None, candidates: tuple[str, ...] = ()) -> None:
        self.cfg, self.out, self.faults, self.candidates = cfg, out, dict(faults or {}), candidates
        self._jobs: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.result = None
        self.run_dir: Path | None = None
        self.pids: list[int] = []

    def _runner(self, ctx) -> None:
        bench = Bench(ctx)
        self.run_dir, self.pids = ctx.run_dir, ctx.launcher.pids()
        self._ready.set()
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                fn, fut = job
                try:
                    fut.set_result(fn(bench))
                except BaseException as e:
                    fut.set_exception(e)
                    raise  # a failed job may have left the topology unusable: tear it down
        finally:
            bench.close()

    def _serve(self) -> None:
        try:
            self.result = serve(self.cfg, scenario_options(self.out, self._runner, "scenario", faults=self.faults,
                                                           candidates=self.candidates))
        except BaseException as e:
            self._error = e
        finally:
            self._ready.set()

    def __enter__(self) -> Topology:
        self._thread = threading.Thread(target=self._serve, name="scenario-serve", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def run(self, fn: Callable):
        if not self._thread.is_alive():
            raise RuntimeError(f"the topology is gone: {self._error}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, fut))
        return fut.result()

    def close(self):
        self._jobs.put(None)
        self._thread.join()
        return self.result

    def __exit__(self, *_):
        self.close()


def leak_checks(report: Report, pids: list[int], ring_prefix: str | None) -> None:
    """After a topology is gone: every worker reaped, every ring segment unlinked."""
    left = wait_gone(pids, 10.0)
    report.check("no leaked processes", not left, f"{len(pids)} workers reaped" if not left else f"still running: {left}")
    if ring_prefix:
        segs = leftover_segments(ring_prefix)
        report.check("no leaked shared memory", not segs, "ring segments unlinked" if not segs else f"left: {segs}")


@dataclass
class Served:
    """How a watched one-off serve() ended: its error, the first worker death, what it left behind."""

    error: BaseException | None
    returned_ns: int
    first_death: FirstDeath | None
    workers: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    shm_left: list[str] = field(default_factory=list)

    @property
    def message(self) -> str:
        return "" if self.error is None else str(self.error).splitlines()[0]


def serve_watched(cfg, out: Path, runner, name: str, faults: dict | None = None) -> Served:
    """serve() once with ``runner`` as its session runner (a topology expected to fail), watching
    its workers die; then wait for them to be reaped and list the ring segments left behind."""
    shm_before = shm_names(f"harness-{os.getpid()}-")
    err = None
    with DeathWatch(os.getpid()) as watch:
        try:
            serve(cfg, scenario_options(str(out), runner, name, faults=faults))
        except Exception as e:  # noqa: BLE001 — the error, whatever it is, is what is being judged
            err = e
        returned = now()
    ours = sorted(watch.ours)
    return Served(error=err, returned_ns=returned, first_death=watch.first_death(), workers=ours,
                  left=wait_gone(ours, 10.0), shm_left=sorted(shm_names(f"harness-{os.getpid()}-") - shm_before))
