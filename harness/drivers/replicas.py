"""Replicas: N engine groups in one ``serve`` (``--replicas N``), each its own frame ring, launcher
(DiT, VAE and encoder processes, or one Ray placement group) and driver.

Replica 0 is the topology ``serve`` always launches; replicas 1…N−1 are launched here beside it and
reaped before it (on Ray, replica 0's launcher owns the Ray instance, so it goes last). On CUDA each
replica's ranks take the GPUs of its ``--replica-gpus`` group; on the CPU they all share the CPU.
The run directory is shared: every events and sessions row carries the ``replica`` that served it,
and the manifest's ``replicas`` lists each one's placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from harness.config import HarnessConfig, override
from harness.drivers.driver import Driver
from harness.errors import HarnessError
from harness.pipeline.ring import FrameRing

#: replicas one server may run (each is a whole engine group: processes, memory, a ring)
MAX_REPLICAS = 64


@dataclass
class Replica:
    """One engine group, as a session runner drives it."""

    index: int
    cfg: HarnessConfig
    launcher: Any
    driver: Driver
    ring: FrameRing | None = None  # None for replica 0, whose ring serve owns
    gpus: tuple[int, ...] = ()


def parse_replica_gpus(groups: list[str] | None, replicas: int, device: str) -> tuple[tuple[int, ...], ...]:
    """``--replica-gpus 0,1 2,3``: one comma-separated GPU list per replica (checked, not yet placed)."""
    if not 1 <= replicas <= MAX_REPLICAS:
        raise HarnessError(f"--replicas must be in 1-{MAX_REPLICAS}, got {replicas}")
    if not groups:
        return ()
    if len(groups) != replicas:
        raise HarnessError(f"--replica-gpus lists {len(groups)} GPU groups for --replicas {replicas}; give one per replica")
    if device != "cuda":
        raise HarnessError("--replica-gpus places replicas on GPUs; on the CPU every replica shares the CPU (drop it)")
    out = []
    for g in groups:
        try:
            ids = tuple(int(x) for x in g.split(","))
        except ValueError:
            raise HarnessError(f"--replica-gpus {g!r}: expected GPU indices separated by commas, e.g. 0,1") from None
        if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
            raise HarnessError(f"--replica-gpus {g!r}: GPU indices must be distinct and ≥ 0")
        out.append(ids)
    seen = [i for ids in out for i in ids]
    if len(set(seen)) != len(seen):
        raise HarnessError("--replica-gpus: a GPU is listed for two replicas; give each replica its own devices")
    return tuple(out)


def replica_config(cfg: HarnessConfig, gpus: tuple[int, ...]) -> HarnessConfig:
    """The config of a replica on ``gpus``: DiT rank r and VAE rank r on the group's GPU r (mod its size),
    the default placement of one group, moved onto the replica's own devices."""
    if not gpus:
        return cfg
    sp, m = cfg.parallel.sp, cfg.parallel.vae_ranks
    return override(cfg, parallel={"dit_devices": [gpus[r % len(gpus)] for r in range(sp)],
                                   "vae_devices": [gpus[r % len(gpus)] for r in range(m)]})


def launch_replica(index: int, cfg: HarnessConfig, gpus: tuple[int, ...], prefix: str, slot_bytes: int,
                   make_launcher: Callable[[HarnessConfig, dict], Any], make_driver: Callable[[HarnessConfig, Any], Driver],
                   ) -> Replica:
    """Ring, launcher (started: every rank ready) and driver of replica ``index`` ≥ 1; on a failure
    whatever was started is torn down before the error goes on."""
    rcfg = replica_config(cfg, gpus)
    ring = FrameRing.create(f"{prefix}-r{index}", rcfg.runtime.ring_slots, slot_bytes)
    launcher = None
    try:
        launcher = make_launcher(rcfg, msgspec.to_builtins(ring.spec))
        launcher.start()
    except BaseException:
        if launcher is not None:
            launcher.shutdown(grace_s=3.0)
        ring.close()
        ring.unlink()
        raise
    return Replica(index, rcfg, launcher, make_driver(rcfg, launcher), ring, gpus)


def reap_replica(rep: Replica, grace_s: float) -> list[int]:
    """Close the driver, shut the launcher down, unlink the ring; the pids it had."""
    rep.driver.close()
    rep.launcher.shutdown(grace_s=grace_s)
    pids = rep.launcher.pids()
    if rep.ring is not None:
        rep.ring.close()
        rep.ring.unlink()
    return pids


def describe(rep: Replica) -> dict:
    """The manifest's record of one replica: where each of its ranks runs."""
    launcher = rep.launcher
    return {"replica": rep.index, "gpus": list(rep.gpus),
            "placement": {p.name: p.ready.device for p in launcher.procs if p.ready is not None},
            "pids": {p.name: launcher.local_pid(p) for p in launcher.procs},  # this host's pids (None elsewhere)
            "launcher": launcher.describe() if hasattr(launcher, "describe") else {"name": "local"}}
