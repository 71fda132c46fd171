"""Local launcher: one process per DiT rank, per VAE rank and for the encoder stage.

The launcher owns process lifetime. Whatever happens — a normal end, Ctrl-C, a worker error,
a rank killed by the OS — ``shutdown`` reaps every process (Shutdown message, bounded join,
then SIGKILL) and the caller's ``finally`` unlinks the shared memory. A rank that dies is
noticed through its process sentinel, not through a timeout, so the error names it at once.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Callable

import torch

from harness.candidates import Chosen
from harness.config import HarnessConfig
from harness.drivers.procwatch import stopped
from harness.drivers.signals import held
from harness.engine.groups import free_port
from harness.errors import HarnessError, RunFailed
from harness.hooks.spec import HookSet
from harness.pipeline import messages as M
from harness.workers.common import WorkerSpec, needs_world


#: how long a WorkerError waits for the death of another rank that may have caused it
DEATH_WAIT_S = 0.5


class RankFailed(RunFailed):
    """A worker rank died or reported an error."""


@dataclass
class Proc:
    role: str
    rank: int
    process: mp.Process
    conn: Connection
    ready: M.Ready | None = None

    @property
    def name(self) -> str:
        return f"{self.role} rank {self.rank}" if self.role != "encoder" else "encoder"


def placement(cfg: HarnessConfig, device: str) -> dict[str, list[str]]:
    """Device string per rank. Default on CUDA: DiT rank r and VAE rank r share GPU r
    (the production placement); ``parallel.*_devices`` overrides it (e.g. separate GPUs)."""
    sp, m = cfg.parallel.sp, cfg.parallel.vae_ranks
    if device == "cpu":
        return {"dit": ["cpu"] * sp, "vae": ["cpu"] * m}
    n = torch.cuda.device_count()
    if n == 0:
        raise HarnessError("--device cuda but no CUDA device is visible")
    dit = list(cfg.parallel.dit_devices) or [r % n for r in range(sp)]
    vae = list(cfg.parallel.vae_devices) or [r % n for r in range(m)]
    for d in dit + vae:
        if not 0 <= d < n:
            raise HarnessError(f"placement names GPU {d} but only {n} are visible")
    if len(dit) != sp or len(vae) != m:
        raise HarnessError("parallel.dit_devices / vae_devices must list one GPU per rank")
    return {"dit": [f"cuda:{d}" for d in dit], "vae": [f"cuda:{d}" for d in vae]}


def shared_gpus(places: dict[str, list[str]]) -> list[str]:
    """GPUs that host both a DiT and a VAE rank (``placement``'s result)."""
    return sorted(set(d for d in places["dit"] if d.startswith("cuda")) & set(places["vae"]))


def mps_running(env: dict | None = None) -> bool:
    """Whether a CUDA MPS control daemon is reachable (its pipe directory holds ``control``)."""
    env = os.environ if env is None else env
    return os.path.exists(os.path.join(env.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control"))


def sharing_warning(places: dict[str, list[str]], scheduler: str, mps: bool) -> str | None:
    """Case E overlaps decode with the DiT; ranks of separate processes on one GPU cannot run at
    the same time without MPS (the GPU time-slices between them), so there it overlaps nothing."""
    shared = shared_gpus(places)
    if scheduler != "case-e" or not shared or mps:
        return None
    return (f"note: DiT and VAE ranks share {', '.join(shared)} without CUDA MPS: their processes time-slice "
            "the GPU, so Case E cannot overlap decode with the DiT there (start MPS, or use --vae-gpus)")


#: role → the module whose ``main(spec, conn)`` a rank of that role runs. Each rank imports its own
#: only: the VAE worker's engine imports torch._dynamo (about 1 s), which the driver and the
#: encoder stage never need.
WORKERS = {"dit": "harness.workers.dit_worker", "vae": "harness.workers.vae_worker",
           "encoder": "harness.workers.encoder_worker"}


def worker_main(role: str) -> Callable:
    return importlib.import_module(WORKERS[role]).main


def _run(role: str, spec: WorkerSpec, conn: Connection) -> None:  # spawn target
    worker_main(role)(spec, conn)


class Addressing:
    """Sending to ranks by role, for a launcher whose ``procs`` carry ``role`` and ``conn``."""

    def group(self, role: str) -> list:
        return [p for p in self.procs if p.role == role]

    def lead(self, role: str):
        return self.group(role)[0]

    def fanout(self, role: str, msg) -> None:
        raw = M.encode(msg)
        for p in self.group(role):
            self._send_raw(p, raw)

    def send(self, proc, msg) -> None:
        self._send_raw(proc, M.encode(msg))

    def ask_to_stop(self, proc) -> None:
        """A Shutdown at teardown, straight to the pipe rather than through ``send``: a rank dying
        as the run ends must not turn the teardown into a second error (its death, from
        ``_death``) that replaces the one that ended the run."""
        try:
            proc.conn.send_bytes(M.encode(M.Shutdown()))
        except (OSError, ValueError):
            pass

    def _send_raw(self, proc, raw: bytes) -> None:
        """A write to a rank that died (e.g. killed while the server was idle) names the rank, not a broken pipe."""
        try:
            proc.conn.send_bytes(raw)
        except (BrokenPipeError, ConnectionResetError):
            raise self._death(proc) from None

    def local_pid(self, proc) -> int | None:
        """``proc``'s pid on this host (None where it runs elsewhere)."""
        return proc.process.pid

    def stopped(self) -> list:
        """The ranks on this host that are stopped (SIGSTOP): alive to every sentinel, yet silent."""
        return [p for p in self.procs if (pid := self.local_pid(p)) is not None and stopped(pid)]

    def owing(self, role: str) -> str:
        """The rank to name for a stall of ``role``: a stopped rank when there is one (a stopped
        encoder backs the ring up into the VAE, which then seems to owe the reply), else the role's lead."""
        halted = self.stopped()
        if halted:
            return f"{halted[0].name} (pid {self.local_pid(halted[0])}, stopped)"
        group = self.group(role)
        return group[0].name if group else role


@dataclass
class LocalLauncher(Addressing):
    cfg: HarnessConfig
    run_dir: str
    ring_spec: dict
    candidates: tuple[Chosen, ...] = ()  # resolved by the driver's preflight
    hooks: HookSet = HookSet()
    faults: dict[str, str] = field(default_factory=dict)  # "dit:1" → "die-at-chunk:3"
    procs: list[Proc] = field(default_factory=list)

    def start(self) -> None:
        cfg = self.cfg
        ctx = mp.get_context("spawn")
        places = placement(cfg, cfg.runtime.device)
        port = free_port() if needs_world(cfg) else 0
        det = cfg.runtime.mode == "deterministic"
        threads = max(1, _cpu_threads(cfg))
        plan = [("dit", r, places["dit"][r]) for r in range(cfg.parallel.sp)]
        plan += [("vae", r, places["vae"][r]) for r in range(cfg.parallel.vae_ranks)]
        plan += [("encoder", 0, "cpu")]
        for role, rank, dev in plan:
            spec = WorkerSpec(
                role=role, rank=rank, cfg=cfg, device=dev, dist_port=port, run_dir=self.run_dir,
                ring=self.ring_spec if (role == "encoder" or (role == "vae" and rank == 0)) else None,
                candidates=self.candidates, hooks=self.hooks, threads=threads, deterministic=det,
                fault=self.faults.get(f"{role}:{rank}", ""),
            )
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_run, args=(role, spec, child), name=f"harness-{role}{rank}", daemon=True)
            with held():  # a signal mid-spawn waits until the child has its whole start-up message
                p.start()
                self.procs.append(Proc(role, rank, p, parent))
            child.close()
        deadline = time.monotonic() + cfg.runtime.rank_timeout_s
        while any(p.ready is None for p in self.procs):
            if time.monotonic() > deadline:
                late = ", ".join(p.name for p in self.procs if p.ready is None)
                raise RankFailed(f"{late} did not start within {cfg.runtime.rank_timeout_s:.0f} s")
            for proc, msg in self.poll(1.0):
                if not isinstance(msg, M.Ready):
                    raise RankFailed(f"{proc.name} sent {type(msg).__name__} instead of Ready")
                proc.ready = msg

    # ---- receiving -----------------------------------------------------------------------
    def poll(self, timeout: float) -> list[tuple[Proc, object]]:
        """Messages ready within ``timeout`` seconds from any process; raises on a dead rank."""
        conns = {p.conn: p for p in self.procs}
        sentinels = {p.process.sentinel: p for p in self.procs}
        ready = wait(list(conns) + list(sentinels), timeout=max(0.0, timeout))
        out = []
        for obj in ready:
            if obj in conns:
                p = conns[obj]
                try:
                    msg = M.recv(p.conn)
                except (EOFError, OSError):
                    raise self._death(p) from None
                if isinstance(msg, M.WorkerError):
                    raise self._failure(p, msg)
                out.append((p, msg))
        if not out:
            for obj in ready:
                if obj in sentinels:
                    raise self._death(sentinels[obj])
        return out

    def recv(self, proc: Proc, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailed(f"{proc.name} did not answer within {timeout:.0f} s")
            if not proc.process.is_alive() and not proc.conn.poll():
                raise self._death(proc)
            for p, msg in self.poll(min(left, 1.0)):
                if p is proc:
                    return msg
                raise RankFailed(f"unexpected {type(msg).__name__} from {p.name}")

    def _failure(self, proc: Proc, msg: M.WorkerError) -> RankFailed:
        """The error for ``proc``'s WorkerError, or for the rank whose death caused it.

        A rank killed mid-collective takes its peers down with it, and a peer's "connection
        reset" can be read before the dead rank's sentinel (conns are looked at first, and in
        rank order): the user must be told which rank died, not which one noticed. The death is
        normally visible already; the short wait covers a process still being torn down."""
        report = f"{proc.name} failed: {msg.message.splitlines()[0]}"
        others = {p.process.sentinel: p for p in self.procs if p is not proc}
        deadline = time.monotonic() + DEATH_WAIT_S
        while others:
            gone = wait(list(others), timeout=max(0.0, deadline - time.monotonic()))
            if not gone:
                break
            for sentinel in gone:
                p = others.pop(sentinel)
                if self._unreported_death(p):
                    return RankFailed(f"{self._death(p)}; then {report[:160]}")
        return RankFailed(report)

    def _unreported_death(self, proc: Proc) -> bool:
        """Exited non-zero or by a signal without a WorkerError. A rank that reported its own error
        exits too (1, or a signal from a collective's teardown), but it is a peer that noticed (or
        a second failure), not the cause."""
        proc.process.join(timeout=1)  # the sentinel can be ready a moment before the exit status
        code = proc.process.exitcode
        return code is not None and code != 0 and _last_words(proc.conn) is None

    def _death(self, proc: Proc) -> RankFailed:
        """A dead rank's error: its own WorkerError when it left one in the pipe (a rank that fails
        reports and exits, and a write to it can break before its report is read), else how it died."""
        proc.process.join(timeout=1)
        said = _last_words(proc.conn)
        if said is not None:
            return RankFailed(f"{proc.name} failed: {said.message.splitlines()[0]}")
        code = proc.process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return RankFailed(f"{proc.name} (pid {proc.process.pid}) died: {how}")

    # ---- teardown ------------------------------------------------------------------------
    def shutdown(self, grace_s: float = 10.0) -> None:
        for p in self.procs:
            if p.process.is_alive():
                self.ask_to_stop(p)
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.process.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.process.is_alive():
                p.process.kill()
                p.process.join(timeout=5)
            p.conn.close()

    def pids(self) -> list[int]:
        return [p.process.pid for p in self.procs if p.process.pid is not None]


def _last_words(conn) -> M.WorkerError | None:
    """The WorkerError still unread in a dead rank's pipe, if it sent one."""
    try:
        while conn.poll():
            msg = M.recv(conn)
            if isinstance(msg, M.WorkerError):
                return msg
    except (EOFError, OSError):
        pass
    return None


def _cpu_threads(cfg: HarnessConfig) -> int:
    """Share the host's cores among the compute ranks on CPU; one thread each on GPU."""
    if cfg.runtime.device != "cpu":
        return 1
    ranks = cfg.parallel.sp + cfg.parallel.vae_ranks
    return max(1, (os.cpu_count() or 1) // ranks)
