"""Ray launcher: the same ranks as ``LocalLauncher``, as Ray actors in one placement group.

``serve --launcher ray [--ray-address ADDR]``. The driver is unchanged: it sees the launcher
interface (``start/group/lead/fanout/send/poll/recv/shutdown/pids`` and per-rank ``procs`` with
``role/rank/name/ready/conn``) and the same typed messages. What differs underneath:

* **placement** — one bundle per rank plus one for the encoder stage. On CPU a bundle is a
  (fractional) share of CPUs; on CUDA a bundle is one GPU, and in the production placement (DiT
  rank r and VAE rank r share GPU r, the default) the two actors share their bundle's GPU at 0.5
  each, since two separate 0.5-GPU bundles could put two DiT ranks on one GPU. The encoder stage
  is pinned to the driver's node because it writes the run directory (media, pixels); VAE rank
  0's bundle is pinned there too when that node can hold it, so frames stay in shared memory.
* **torch.distributed** — initialised inside the actors (NCCL on CUDA, gloo on CPU) with the
  rendezvous at DiT rank 0's node IP and a port found free on that node.
* **control channel** — each actor connects back to a TCP listener of the driver
  (``harness.pipeline.channel``), authenticated by a per-run secret; length-prefixed msgpack, as
  over a local pipe. A rank on another host has its timestamps moved onto the driver's clock.
* **frames** — the shared-memory ring when VAE rank 0 and the encoder are on one node (the
  usual case); otherwise VAE rank 0 writes into a ring on its own node and a socket channel
  carries each chunk's bytes into the driver node's ring (``frame_path``: auto | ring | socket).
* **liveness** — a rank that dies closes its socket at once (EOF, seen by ``wait`` like a
  pipe's), and its ``run`` ObjectRef raises ``RayActorError``, which also covers a node that
  vanishes without closing anything (keepalive on the sockets, Ray's node failure detection).
  Either way ``RankFailed`` names the rank. ``shutdown`` sends Shutdown, waits a bounded time,
  then ``ray.kill``s every actor, waits for their processes, and removes the placement group.
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from types import SimpleNamespace
from typing import Any

import msgspec

from harness.candidates import Chosen
from harness.config import HarnessConfig
from harness.drivers.launcher import Addressing, RankFailed
from harness.drivers.procwatch import wait_gone
from harness.drivers.ray_actor import RankActor
from harness.errors import HarnessError
from harness.hooks.spec import HookSet
from harness.pipeline import messages as M
from harness.pipeline.channel import Listener, host_id
from harness.workers.common import WorkerSpec, needs_world

FRAME_PATHS = ("auto", "ring", "socket")
_LIVENESS_EVERY_S = 0.5  # how often poll() asks Ray about actors whose sockets are still open
#: How long naming a dead rank may wait: for Ray to say how the actor ended, and (when a peer's
#: error arrives first) for the rank that died to show itself. A death is named within their sum.
DEATH_REPORT_S = 5.0
PEER_FIRST_WAIT_S = 1.0
_NODE_PIN = 0.001  # share of a node's "node:<ip>" resource that pins a bundle to that node


def import_ray():
    # A serving harness has no business phoning home; a user who wants Ray's usage stats says so (=1).
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray  # an optional extra: refused with the install command when absent
    except ImportError:
        raise HarnessError("--launcher ray needs the ray package: pip install 'harness[ray]' (or pip install ray)") from None
    return ray


@dataclass
class ActorProc:
    """One rank as the driver sees it; ``process.pid`` is the actor's pid on its own node."""

    role: str
    rank: int
    actor: Any
    bundle: int
    num_cpus: float
    num_gpus: float
    info: dict = field(default_factory=dict)
    conn: Any = None
    run_ref: Any = None
    ready: M.Ready | None = None
    process: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(pid=None))

    @property
    def name(self) -> str:
        return f"{self.role} rank {self.rank}" if self.role != "encoder" else "encoder"

    @property
    def where(self) -> str:
        return f"pid {self.info.get('pid', '?')} on {self.info.get('ip', '?')}"


@dataclass
class RayLauncher(Addressing):
    cfg: HarnessConfig
    run_dir: str
    ring_spec: dict
    candidates: tuple[Chosen, ...] = ()  # resolved by the driver's preflight
    hooks: HookSet = HookSet()
    faults: dict[str, str] = field(default_factory=dict)
    address: str | None = None  # None: RAY_ADDRESS, the latest local cluster, or a new local instance
    cpus_per_rank: float | None = None  # None: a fair share of the cluster's CPUs, at most 1
    frame_path: str = "auto"
    strategy: str = "PACK"
    #: engine groups sharing the cluster (``--replicas``): each one's fair share of CPUs is this much smaller
    share: int = 1
    procs: list[ActorProc] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.frame_path not in FRAME_PATHS:
            raise HarnessError(f"frame path {self.frame_path!r}: expected one of {', '.join(FRAME_PATHS)}")
        if self.cpus_per_rank is not None and not self.cpus_per_rank > 0:
            raise HarnessError(f"CPUs per rank must be > 0, got {self.cpus_per_rank}")
        self._owns_ray = False
        self._pg = None
        self._listener = None
        self._token = secrets.token_hex(16)
        self._last_check = 0.0
        self._describe: dict = {"name": "ray"}

    # ---- start ------------------------------------------------------------------------------
    def start(self) -> None:
        """Place one actor per rank, choose how frames travel, start every rank's worker and wait
        until each has said Ready: the steps below, in the order they run."""
        ray = import_ray()
        timeout = self.cfg.runtime.rank_timeout_s
        nodes, driver_node, driver_ip = self._join_cluster(ray)
        bundles, plan = self._place(ray, nodes, driver_node, driver_ip, timeout)
        self._spawn_actors(ray, plan, timeout)
        path, vae_ring, frames = self._choose_frames(driver_node, driver_ip, timeout)
        dist_host, dist_port = self._rendezvous(timeout)
        self._listener = Listener(driver_ip, self._token)
        self._run_workers(vae_ring, frames, dist_host, dist_port)
        self._describe = {
            "name": "ray", "address": self.address, "strategy": self.strategy, "frame_path": path,
            "placement_group": f"harness-{os.getpid()}-{self._token[:6]}",
            "driver": driver_ip, "rendezvous": f"{dist_host}:{dist_port}" if dist_port else None,
            "bundles": bundles, "ranks": {p.name: {"node": p.info["ip"], "bundle": p.bundle, "cpus": p.num_cpus,
                                                   "gpus": p.num_gpus, "gpu_ids": p.info["gpu_ids"]} for p in self.procs},
        }
        self._accept_all(timeout)
        self._await_ready(timeout)

    def _join_cluster(self, ray) -> tuple[dict[str, dict], str, str]:
        """Alive nodes by id, the driver's node id and its IP (starting Ray here when none runs)."""
        if not ray.is_initialized():
            kept = _handlers()
            ray.init(address=self.address, log_to_driver=True)
            for sig, handler in kept.items():  # Ray's driver handlers exit at once: serve's graceful stop stays
                signal.signal(sig, handler)
            self._owns_ray = True
        driver_node = ray.get_runtime_context().get_node_id()
        nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        if driver_node not in nodes:
            raise HarnessError("the driver must run on a node of the Ray cluster (not through Ray Client)")
        return nodes, driver_node, nodes[driver_node]["NodeManagerAddress"]

    def _place(self, ray, nodes: dict[str, dict], driver_node: str, driver_ip: str, timeout: float) -> tuple[list[dict], list]:
        """The bundles and the per-actor plan (``_plan``), reserved as one placement group."""
        cfg = self.cfg
        cpus = self.cpus_per_rank or _fair_cpus(ray.cluster_resources().get("CPU", 1.0),
                                                 (cfg.parallel.sp + cfg.parallel.vae_ranks + 1) * self.share)
        bundles, plan = _plan(cfg, cpus)
        self._pin(bundles, plan, nodes[driver_node], driver_ip)
        plan = _fit_encoder(bundles, plan, nodes[driver_node])
        _check_feasible(bundles, list(nodes.values()))
        self._pg = ray.util.placement_group(bundles, strategy=self.strategy, name=f"harness-{os.getpid()}-{self._token[:6]}")
        ready, _ = ray.wait([self._pg.ready()], timeout=timeout)
        if not ready:
            raise RankFailed(f"Ray could not place {len(bundles)} bundles {bundles} within {timeout:.0f} s "
                             f"(cluster resources: {_short(ray.cluster_resources())})")
        return bundles, plan

    def _spawn_actors(self, ray, plan: list, timeout: float) -> None:
        """One actor per rank in its bundle; each says where it landed (``RankActor.describe``)."""
        remote = ray.remote(RankActor)
        in_bundle = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy
        for role, rank, b, c, g in plan:
            actor = remote.options(
                num_cpus=c, num_gpus=g, max_restarts=0, max_task_retries=0,
                scheduling_strategy=in_bundle(self._pg, placement_group_bundle_index=b),
            ).remote()
            self.procs.append(ActorProc(role, rank, actor, b, c, g))
        refs = [p.actor.describe.remote() for p in self.procs]
        for p, ref in zip(self.procs, refs):
            p.info = self._get(ref, p, timeout, "could not start")
            p.process.pid = p.info["pid"]

    def _choose_frames(self, driver_node: str, driver_ip: str, timeout: float) -> tuple[str, dict, dict]:
        """The frame path (ring | socket), VAE rank 0's ring spec and each rank's frame channel
        arguments: shared memory when VAE rank 0 sits with the encoder (pinned to this node)."""
        vae0, enc = self.lead("vae"), self.lead("encoder")
        if enc.info["host"] != host_id():  # it attaches the driver's ring and writes the run directory
            raise HarnessError(f"the encoder stage was placed on {enc.info['ip']}, not on the driver's host "
                               f"(two Ray nodes with the driver's IP {driver_ip}?)")
        together = vae0.info["node_id"] == enc.info["node_id"] == driver_node
        path = self.frame_path if self.frame_path != "auto" else ("ring" if together else "socket")
        if path == "ring" and not together:
            raise HarnessError(f"frame path 'ring' needs VAE rank 0 and the encoder on the driver's node; "
                               f"VAE rank 0 is on {vae0.info['ip']}, the encoder on {enc.info['ip']}")
        vae_ring, frames = self.ring_spec, {}
        if path == "socket":
            prefix = f"{self.ring_spec['prefix']}-tx"
            vae_ring = self._get(vae0.actor.make_ring.remote(prefix, self.ring_spec["slots"], self.ring_spec["slot_bytes"]),
                                 vae0, timeout, "could not create its frame ring")
            addr = self._get(enc.actor.listen_frames.remote(self._token), enc, timeout, "could not open the frame channel")
            frames = {("vae", 0): {"send": tuple(addr)}, ("encoder", 0): {"receive": self.ring_spec}}
        return path, vae_ring, frames

    def _rendezvous(self, timeout: float) -> tuple[str, int]:
        """torch.distributed's rendezvous: global rank 0 (DiT rank 0), on a port free on its node."""
        if not needs_world(self.cfg):
            return "127.0.0.1", 0
        dit0 = self.lead("dit")
        return dit0.info["ip"], self._get(dit0.actor.free_port.remote(), dit0, timeout, "could not find a free port")

    def _run_workers(self, vae_ring: dict, frames: dict, dist_host: str, dist_port: int) -> None:
        """Start every actor's ``run``: it connects back to the listener and runs its worker."""
        cfg = self.cfg
        det = cfg.runtime.mode == "deterministic"
        for p in self.procs:
            ring = None
            if p.role == "encoder":
                ring = self.ring_spec
            elif p.role == "vae" and p.rank == 0:
                ring = vae_ring
            spec = WorkerSpec(
                role=p.role, rank=p.rank, cfg=cfg, device="cuda:0" if p.num_gpus else "cpu",  # Ray sets CUDA_VISIBLE_DEVICES
                dist_port=dist_port, dist_host=dist_host, run_dir=self.run_dir, ring=ring,
                candidates=self.candidates, hooks=self.hooks, deterministic=det,
                threads=max(1, int(p.num_cpus)) if cfg.runtime.device == "cpu" else 1,
                fault=self.faults.get(f"{p.role}:{p.rank}", ""),
            )
            p.run_ref = p.actor.run.remote(p.role, msgspec.msgpack.encode(spec), self._listener.address, self._token,
                                           frames.get((p.role, p.rank)))

    def _await_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(p.ready is None for p in self.procs):
            if time.monotonic() > deadline:
                late = ", ".join(p.name for p in self.procs if p.ready is None)
                raise RankFailed(f"{late} did not start within {timeout:.0f} s")
            for proc, msg in self.poll(1.0):
                if not isinstance(msg, M.Ready):
                    raise RankFailed(f"{proc.name} sent {type(msg).__name__} instead of Ready")
                gpus = f" (Ray GPU {','.join(proc.info['gpu_ids'])})" if proc.info["gpu_ids"] else ""
                proc.ready = msgspec.structs.replace(msg, device=f"{msg.device}@{proc.info['ip']}{gpus}")

    def _pin(self, bundles: list[dict], plan: list, node: dict, ip: str) -> None:
        """Encoder bundle on the driver's node always; VAE rank 0's bundle too when it fits."""
        pin = f"node:{ip}"
        enc = next(b for role, _, b, _, _ in plan if role == "encoder")
        bundles[enc][pin] = _NODE_PIN
        if self.frame_path == "socket":
            return
        vae0 = next(b for role, rank, b, _, _ in plan if role == "vae" and rank == 0)
        have = node.get("Resources", {})
        need = {k: bundles[vae0].get(k, 0) + bundles[enc].get(k, 0) for k in ("CPU", "GPU")}
        if all(have.get(k, 0) >= v for k, v in need.items()):
            bundles[vae0][pin] = _NODE_PIN

    def _get(self, ref, p: ActorProc, timeout: float, what: str):
        ray = import_ray()
        try:
            return ray.get(ref, timeout=timeout)
        except Exception as e:
            raise RankFailed(f"{p.name} {what} on Ray: {_first_line(e)}") from None

    def _accept_all(self, timeout: float) -> None:
        waiting = {(p.role, p.rank): p for p in self.procs}
        deadline = time.monotonic() + timeout
        while waiting:
            if time.monotonic() > deadline:
                raise RankFailed(f"{', '.join(p.name for p in waiting.values())} did not connect within {timeout:.0f} s")
            got = self._listener.accept(timeout=0.2)
            if got is None:
                self._check_runs()
                continue
            conn, hello = got
            p = waiting.pop((hello.get("role"), hello.get("rank")), None)
            if p is None:
                conn.close()
                continue
            p.conn = conn

    def describe(self) -> dict:
        return dict(self._describe)

    def local_pid(self, proc: ActorProc) -> int | None:
        return proc.info.get("pid") if proc.info.get("host") == host_id() else None

    # ---- receiving ----------------------------------------------------------------------------
    def poll(self, timeout: float) -> list[tuple[ActorProc, object]]:
        """Messages ready within ``timeout`` seconds from any rank; raises on a dead rank."""
        conns = {p.conn: p for p in self.procs if p.conn is not None and not p.conn.closed}
        ready = wait(list(conns), timeout=max(0.0, timeout))
        out = []
        for c in ready:
            p = conns[c]
            try:
                msg = M.recv(c)
            except (EOFError, OSError):
                raise self._death(p) from None
            if isinstance(msg, M.WorkerError):
                # A dead rank takes its collective peers down; name the one that died, not the one that noticed.
                dead = self._first_dead(exclude=p, wait_s=PEER_FIRST_WAIT_S)
                if dead is not None:
                    raise RankFailed(f"{self._death(dead)}; then {p.name} failed: {msg.message.splitlines()[0][:160]}")
                raise RankFailed(f"{p.name} failed: {msg.message.splitlines()[0]}")
            out.append((p, msg))
        if not out and time.monotonic() - self._last_check > _LIVENESS_EVERY_S:
            self._check_runs()
        return out

    def recv(self, proc: ActorProc, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailed(f"{proc.name} did not answer within {timeout:.0f} s")
            for p, msg in self.poll(min(left, 1.0)):
                if p is proc:
                    return msg
                raise RankFailed(f"unexpected {type(msg).__name__} from {p.name}")

    def _check_runs(self) -> None:
        """Raise for any rank whose ``run`` finished: during a run that only happens when it died."""
        ray = import_ray()
        self._last_check = time.monotonic()
        live = [p for p in self.procs if p.run_ref is not None]
        if not live:
            return
        done, _ = ray.wait([p.run_ref for p in live], num_returns=len(live), timeout=0)
        if done:
            first = next(p for p in live if p.run_ref in done)
            raise self._death(first)

    def _first_dead(self, exclude: ActorProc | None = None, wait_s: float = 0.0) -> ActorProc | None:
        """A rank whose socket hit EOF without a word, or whose actor Ray reports finished."""
        ray = import_ray()
        deadline = time.monotonic() + wait_s
        while True:
            for p in self.procs:
                if p is not exclude and p.conn is not None and not p.conn.closed and p.conn.poll(0) and p.conn.at_eof():
                    return p
            live = [p for p in self.procs if p is not exclude and p.run_ref is not None]
            if live:
                done, _ = ray.wait([p.run_ref for p in live], num_returns=len(live), timeout=0)
                for p in live:
                    if p.run_ref in done:
                        return p
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _death(self, p: ActorProc) -> RankFailed:
        ray = import_ray()
        verb, how = "died", ""
        if p.run_ref is None:
            how = "its connection closed"
        else:
            try:
                code = ray.get(p.run_ref, timeout=DEATH_REPORT_S)
                verb, how = "exited", f"worker returned status {code} without reporting an error"
            except ray.exceptions.RayActorError as e:
                how = f"actor process ended ({_exit_type(e)})"
            except ray.exceptions.GetTimeoutError:
                how = "its connection closed and Ray has not yet reported the actor dead"
            except Exception as e:
                verb, how = "failed", _first_line(e)
        return RankFailed(f"{p.name} ({p.where}) {verb}: {how}")

    def explain_failure(self, err: BaseException) -> BaseException:
        """For ``serve``: a run that failed on a symptom (a timeout, a peer's error) is reported
        as the death of the rank that caused it, when one is dead."""
        if not isinstance(err, RankFailed) or " died: " in str(err).split(";")[0] or not self.procs:
            return err
        try:
            dead = self._first_dead(wait_s=0.2)
        except Exception:
            return err
        if dead is None:
            return err
        return RankFailed(f"{self._death(dead)}; then {_first_line(err)[:160]}")

    # ---- teardown -----------------------------------------------------------------------------
    def shutdown(self, grace_s: float = 10.0) -> None:
        try:
            ray = import_ray()
        except HarnessError:
            return
        if not ray.is_initialized():
            return
        for p in self.procs:
            if p.conn is not None and not p.conn.closed:
                self.ask_to_stop(p)
        refs = [p.run_ref for p in self.procs if p.run_ref is not None]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        for p in self.procs:
            try:
                ray.kill(p.actor, no_restart=True)
            except Exception:
                pass
            if p.conn is not None:
                p.conn.close()
        if refs:  # a killed actor's run ref resolves once Ray has seen the process go
            ray.wait(refs, num_returns=len(refs), timeout=10.0)
        _wait_local_pids_gone([p for p in self.procs if p.info], 10.0)
        if self._listener is not None:
            self._listener.close()
        if self._pg is not None:
            _remove_placement_group(self._pg, 10.0)
        if self._owns_ray:
            ray.shutdown()

    def pids(self) -> list[int]:
        """Actor pids on this host (a pid on another host means nothing here)."""
        me = host_id()
        return [p.info["pid"] for p in self.procs if p.info.get("host") == me]


def _plan(cfg: HarnessConfig, cpus: float) -> tuple[list[dict], list[tuple[str, int, int, float, float]]]:
    """Bundles and (role, rank, bundle, num_cpus, num_gpus) per actor."""
    sp, m = cfg.parallel.sp, cfg.parallel.vae_ranks
    bundles: list[dict] = []
    plan: list[tuple[str, int, int, float, float]] = []
    if cfg.runtime.device != "cuda":
        for role, n in (("dit", sp), ("vae", m)):
            for r in range(n):
                plan.append((role, r, len(bundles), cpus, 0.0))
                bundles.append({"CPU": cpus})
    else:
        dit_d, vae_d = cfg.parallel.dit_devices, cfg.parallel.vae_devices
        separate = bool(dit_d) and bool(vae_d) and set(dit_d).isdisjoint(vae_d)
        if separate:
            for role, n in (("dit", sp), ("vae", m)):
                for r in range(n):
                    plan.append((role, r, len(bundles), cpus, 1.0))
                    bundles.append({"GPU": 1.0, "CPU": cpus})
        else:
            for r in range(max(sp, m)):
                here = [role for role, n in (("dit", sp), ("vae", m)) if r < n]
                for role in here:
                    plan.append((role, r, len(bundles), cpus, 1.0 / len(here)))
                bundles.append({"GPU": 1.0, "CPU": cpus * len(here)})
    plan.append(("encoder", 0, len(bundles), cpus, 0.0))
    bundles.append({"CPU": cpus})
    return bundles, plan


def _fit_encoder(bundles: list[dict], plan: list, node: dict) -> list:
    """The encoder is pinned to the driver's node; a head started with fewer CPUs than a rank's
    share (``ray start --head --num-cpus=0`` is common) still takes it, with what it has."""
    have = node.get("Resources", {}).get("CPU", 0.0)
    out = []
    for role, rank, b, c, g in plan:
        if role == "encoder" and have < c:
            c = math.floor(have * 100) / 100
            if c > 0:
                bundles[b]["CPU"] = c
            else:
                bundles[b].pop("CPU", None)  # the node pin alone keeps the bundle non-empty
        out.append((role, rank, b, c, g))
    return out


def _check_feasible(bundles: list[dict], nodes: list[dict]) -> None:
    """Fail now, not after ``rank_timeout_s``, when the cluster can never hold the placement group."""
    for kind in ("CPU", "GPU"):
        need = sum(b.get(kind, 0) for b in bundles)
        have = sum(n.get("Resources", {}).get(kind, 0) for n in nodes)
        if need > have + 1e-9:
            raise HarnessError(f"the placement needs {need:g} {kind} ({len(bundles)} bundles) but the Ray cluster has {have:g}")
    for b in bundles:
        if not any(all(n.get("Resources", {}).get(k, 0) >= v for k, v in b.items()) for n in nodes):
            raise HarnessError(f"no node of the Ray cluster can hold the bundle {b}")


def _handlers() -> dict:
    """This process's Python handlers of SIGTERM and SIGINT (none off the main thread, where they cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: h for sig in (signal.SIGTERM, signal.SIGINT) if (h := signal.getsignal(sig)) is not None}


def _fair_cpus(total: float, actors: int) -> float:
    """At most one CPU per actor; on a small cluster an equal share, in steps of 0.05."""
    return max(0.05, min(1.0, math.floor(total / actors * 20) / 20))


def _wait_local_pids_gone(procs: list[ActorProc], timeout: float) -> None:
    me = host_id()
    wait_gone([p.info["pid"] for p in procs if p.info.get("host") == me], timeout)


def _remove_placement_group(pg, timeout: float) -> None:
    """Remove and wait (bounded) until Ray says so: its resources are free when we return."""
    ray = import_ray()
    try:
        ray.util.remove_placement_group(pg)
        deadline = time.monotonic() + timeout
        while ray.util.placement_group_table(pg).get("state") != "REMOVED" and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:
        pass


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _exit_type(e: BaseException) -> str:
    """The short reason out of a RayActorError's long text (exit type, or killed by ray.kill)."""
    text = str(e)
    if "ray.kill" in text:
        return "killed by ray.kill"
    marker = "Worker exit type: "
    if marker in text:
        kind = text.split(marker, 1)[1].split()[0]
        return f"{kind}: killed by a signal or crashed" if kind == "SYSTEM_ERROR" else kind
    return _first_line(e)[:120]


def _short(res: dict) -> dict:
    return {k: v for k, v in res.items() if k in ("CPU", "GPU") or k.startswith("node:")}
