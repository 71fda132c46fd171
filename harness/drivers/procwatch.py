"""What the scenarios observe from outside the processes: the process tree, deaths, resident
memory and shared-memory names, all read from /proc and /dev/shm (no psutil, Linux only)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

SHM = Path("/dev/shm")


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            st = _stat(int(d.name))
            if st is not None and int(st[1]) == pid:
                out.append(int(d.name))
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def is_worker(pid: int) -> bool:
    """A multiprocessing spawn child (a rank or the encoder), not the resource tracker."""
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def workers_of(pid: int, recursive: bool = False) -> list[int]:
    return [p for p in (descendants(pid) if recursive else children(pid)) if is_worker(p)]


def alive(pid: int) -> bool:
    """Running or sleeping; a zombie has exited (only its parent's wait is missing)."""
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP) or a tracer: alive, and never going to answer."""
    st = _stat(pid)
    return st is not None and st[0] in ("T", "t")


def wait_gone(pids, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


def start_time(pid: int) -> int:
    """Clock ticks after boot when the process started (0 when gone)."""
    st = _stat(pid)
    return int(st[19]) if st is not None else 0


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def shm_names(prefix: str) -> set[str]:
    try:
        return {p.name for p in SHM.iterdir() if p.name.startswith(prefix)}
    except OSError:
        return set()


class _Poller:
    """A daemon thread running ``_run`` between ``__enter__`` and ``__exit__`` (``_stop`` ends it)."""

    def _start_thread(self, name: str) -> None:
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        self._t.join(5)

    def _run(self) -> None:
        raise NotImplementedError


class RssSampler(_Poller):
    """Samples VmRSS of named process groups every ``period_s``; ``mark(label)`` starts a new
    phase, and ``peaks[label][name]`` is the largest sum seen for that group in that phase."""

    def __init__(self, groups, period_s: float = 0.05) -> None:
        self.groups = groups  # callable → {name: [pids]}, re-evaluated at each mark (a /proc scan is not free)
        self._pids = groups()
        self.period_s = period_s
        self.peaks: dict[str, dict[str, int]] = {}
        self._label = "start"
        self._start_thread("rss-sampler")

    def mark(self, label: str) -> None:
        self._sample()  # close the previous phase with a fresh sample
        self._pids = self.groups()
        self._label = label

    def _sample(self) -> None:
        peaks = self.peaks.setdefault(self._label, {})
        for name, pids in self._pids.items():
            total = sum(r for p in pids if (r := rss_bytes(p)) is not None)
            if total:
                peaks[name] = max(peaks.get(name, 0), total)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()


@dataclass(frozen=True)
class FirstDeath:
    """The earliest worker death a ``DeathWatch`` saw, as the interval its looks allow: it happened
    after ``after_ns`` (the last look that found a candidate running) and by ``by_ns`` (the first
    look that found one gone). ``pids``: every worker that could have died first — more than one
    only when another one's death also fits inside that interval."""

    pids: frozenset[int]
    after_ns: int
    by_ns: int


class DeathWatch(_Poller):
    """Records when each worker process of ``parent`` (as found while watching) stops running,
    to time how long a crash takes to surface as an error."""

    def __init__(self, parent: int, recursive: bool = False, period_s: float = 0.005, rescan_s: float = 0.25,
                 exclude_existing: bool = True) -> None:
        self.rescan_s = rescan_s  # finding new workers scans /proc; checking known ones is one read each
        self.parent, self.recursive, self.period_s = parent, recursive, period_s
        self.started_ns = time.monotonic_ns()
        self.seen: set[int] = set(workers_of(parent, recursive))
        # workers that existed before the watch belong to someone else (e.g. another topology of this process)
        self.before = set(self.seen) if exclude_existing else set()
        self.deaths: dict[int, int] = {}  # pid → monotonic ns right after the look that found it gone
        self.alive_at: dict[int, int] = {}  # pid → monotonic ns right before the last look that found it running
        self._start_thread("death-watch")

    @property
    def ours(self) -> set[int]:
        return self.seen - self.before

    def first_death(self) -> FirstDeath | None:
        mine = {p: t for p, t in self.deaths.items() if p not in self.before}
        if not mine:
            return None
        by = min(mine.values())
        last_alive = {p: self.alive_at.get(p, self.started_ns) for p in mine}
        could = [p for p, t in last_alive.items() if t < by]  # the first to be seen gone is always one
        return FirstDeath(frozenset(could), min(last_alive[p] for p in could), by)

    def _run(self) -> None:
        next_scan = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_scan:
                self.seen.update(workers_of(self.parent, self.recursive))
                next_scan = time.monotonic() + self.rescan_s
            for p in self.seen:
                if p in self.deaths:
                    continue
                before = time.monotonic_ns()
                if alive(p):
                    self.alive_at[p] = before
                else:
                    self.deaths[p] = time.monotonic_ns()
            time.sleep(self.period_s)
