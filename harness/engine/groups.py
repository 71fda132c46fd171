"""Process groups the engine runs collectives over, and a tiny local launcher for tests/benches.

The engine never creates processes itself; it is handed a ``RankGroup`` (a torch.distributed
process group plus this process's rank/size in it). ``RankGroup.single()`` is the one-process
case, where every collective is skipped rather than run on a group of one.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True)
class RankGroup:
    rank: int
    size: int
    group: Any = None  # torch.distributed ProcessGroup, None when size == 1

    @staticmethod
    def single() -> "RankGroup":
        return RankGroup(0, 1, None)

    @property
    def active(self) -> bool:
        return self.size > 1

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.active else group_rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = RankGroup(rank, world, dist.group.WORLD) if world > 1 else RankGroup.single()
        # Plain pickle, not the queue's ForkingPickler: that one passes tensors as shared-memory
        # file descriptors, which vanish if this process exits before the parent reads them.
        out.put((rank, "ok", pickle.dumps(fn(group, *args))))
    except BaseException:  # surfaced to the parent, which re-raises
        out.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo", timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(RankGroup, *args)`` on ``world`` spawned processes; return results by rank.

    For tests and benchmarks of the engine alone; serving uses the real launcher.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, backend, fn, args, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, value = out.get(timeout=timeout_s)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world)]
