"""What every worker process does before and around its loop: process hygiene, the device,
the torch.distributed world and the DiT/VAE sub-groups.

World layout: DiT ranks take global ranks 0..sp-1, VAE ranks sp..sp+M-1; each role gets its
own sub-group, so the DiT's all-to-alls and the VAE's halo exchanges never share a
communicator. When neither group has more than one rank, no world is created at all.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Literal

import msgspec
import torch
import torch.distributed as dist

from harness.candidates import Chosen, EnginePatches
from harness.config import HarnessConfig
from harness.engine.groups import RankGroup
from harness.hooks.active import ActiveHooks, activate
from harness.hooks.spec import HookSet
from harness.hooks.telemetry import Sampler, load_nvml, nvml_reader
from harness.pipeline import messages as M
from harness.workers.heap import flight_recorder_off, trim_heap

Role = Literal["dit", "vae", "encoder"]


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    role: Role
    rank: int
    cfg: HarnessConfig
    device: str  # "cpu" or "cuda:N"
    dist_port: int = 0
    dist_host: str = "127.0.0.1"  # rendezvous host: global rank 0's node (another host under Ray)
    run_dir: str = ""
    ring: dict | None = None  # FrameRing spec (VAE rank 0 and the encoder)
    candidates: tuple[Chosen, ...] = ()  # resolved by the driver, in apply order
    hooks: HookSet = HookSet()
    threads: int = 1
    deterministic: bool = False
    fault: str = ""  # test/scenario hook: "die-at-chunk:N" makes this rank exit hard mid-run


def end_session(engine, sessions: dict, session: int) -> None:
    """A session's end on any rank: its state dropped, then the freed heap handed back
    (``heap.trim_heap``) before the lead replies, so the driver sees the rank's heap settled."""
    s = sessions.pop(session, None)
    if s is not None:
        engine.end_session(s)
    del s  # the last reference: freed before the trim, not after it
    trim_heap()


def process_setup(spec: WorkerSpec) -> None:
    """Hygiene for a child of the driver.

    SIGINT is ignored so that Ctrl-C in a terminal (sent to the whole process group) reaches
    only the driver, which then shuts everything down in order; PR_SET_PDEATHSIG makes the
    kernel kill this process if the driver dies without reaping it, so no rank outlives a run.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    flight_recorder_off()  # before any process group: its records would grow for the server's first sessions
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # parent already gone before prctl took effect
            os._exit(1)
    except OSError:
        pass
    torch.set_num_threads(max(1, spec.threads))
    if spec.deterministic:
        set_deterministic()
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(spec.device))


def set_deterministic() -> None:
    """The process-wide flags of ``--mode deterministic`` (DESIGN §5); before CUDA starts, since
    cuBLAS reads its workspace setting when it initialises."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def world_size(cfg: HarnessConfig) -> int:
    return cfg.parallel.sp + cfg.parallel.vae_ranks


def dit_in_world(cfg: HarnessConfig) -> bool:
    """Whether the DiT ranks join the harness's process group. vLLM-Omni's DiT builds its own
    (vLLM's group setup calls new_group on the default group, which the VAE ranks would have to
    join too), so with that backend the world is the VAE ranks alone."""
    return cfg.engine.backend == "reference"


def needs_world(cfg: HarnessConfig) -> bool:
    return (cfg.parallel.sp > 1 and dit_in_world(cfg)) or cfg.parallel.vae_ranks > 1


def init_groups(spec: WorkerSpec) -> RankGroup:
    """Join the world (if any) and return this rank's role group."""
    cfg = spec.cfg
    if not needs_world(cfg) or (spec.role == "dit" and not dit_in_world(cfg)):
        return RankGroup.single()
    sp, m = cfg.parallel.sp if dit_in_world(cfg) else 0, cfg.parallel.vae_ranks
    global_rank = spec.rank if spec.role == "dit" else sp + spec.rank
    backend = "nccl" if spec.device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{spec.dist_host}:{spec.dist_port}",
        rank=global_rank,
        world_size=sp + m,
        timeout=timedelta(seconds=cfg.runtime.rank_timeout_s),
    )
    # Every rank must create every sub-group, in the same order, members or not.
    dit = dist.new_group(list(range(sp))) if sp > 1 else None
    vae = dist.new_group(list(range(sp, sp + m))) if m > 1 else None
    if spec.role == "dit":
        return RankGroup(spec.rank, sp, dit) if sp > 1 else RankGroup.single()
    return RankGroup(spec.rank, m, vae) if m > 1 else RankGroup.single()


def shutdown_groups() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def maybe_fault(spec: WorkerSpec, chunk: int) -> None:
    """Scenario hook: die abruptly (as a crashed rank would) when told to, at a given chunk."""
    if spec.fault.startswith("die-at-chunk:") and chunk == int(spec.fault.split(":", 1)[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    if spec.fault.startswith("stall-at-chunk:"):  # stall-at-chunk:N:SECONDS: alive, but no progress
        at, seconds = spec.fault.split(":")[1:3]
        if chunk == int(at):
            time.sleep(float(seconds))


class GpuTimer:
    """CUDA-event durations for named stages; reads them only when asked (no sync on record)."""

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda"
        self._marks: dict[str, tuple] = {}

    def start(self, name: str) -> None:
        if self.enabled:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks[name] = (ev, None)

    def stop(self, name: str) -> None:
        if self.enabled and name in self._marks:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks[name] = (self._marks[name][0], ev)

    def collect(self) -> dict[str, float]:
        """Milliseconds per stage; call after a synchronize."""
        out = {k: a.elapsed_time(b) for k, (a, b) in self._marks.items() if b is not None}
        self._marks.clear()
        return out


def write_hook_report(spec: WorkerSpec, hooks: ActiveHooks) -> None:
    """What this process's hooks actually did, next to the run's other files."""
    if not spec.hooks.any or not spec.run_dir:
        return
    path = Path(spec.run_dir) / f"hooks.{spec.role}{spec.rank}.json"
    path.write_text(json.dumps(hooks.report(), indent=1))


@contextmanager
def hooks_on(spec: WorkerSpec, label: str):
    """The run's hooks switched on around a worker's serve loop; their report is written once they
    are off (the recorder's totals exist only then), however the loop ended."""
    hooks = activate(spec.hooks, out_dir=spec.run_dir, label=label)
    try:
        with hooks, telemetry_on(spec, label):
            yield hooks
    finally:
        write_hook_report(spec, hooks)


@contextmanager
def telemetry_on(spec: WorkerSpec, label: str):
    """This process's GPU sampled through NVML into ``telemetry.<label>.jsonl`` while the loop runs
    (``runtime.telemetry_hz``; serve refused it up front where NVML cannot run). A process without
    a GPU (the encoder) samples nothing."""
    hz = spec.cfg.runtime.telemetry_hz
    if not hz or not spec.device.startswith("cuda") or not spec.run_dir:
        yield None
        return
    nvml = load_nvml()
    device = torch.device(spec.device)
    handle, uuid = nvml_device(nvml, device)
    sampler = Sampler(nvml_reader(nvml, handle, uuid, device.index or 0), Path(spec.run_dir) / f"telemetry.{label}.jsonl", hz)
    sampler.start()
    try:
        yield sampler
    finally:
        sampler.stop()
        nvml.nvmlShutdown()


def nvml_device(nvml, device: torch.device) -> tuple[object, str]:
    """NVML's handle of this process's CUDA device and its UUID. CUDA and NVML number GPUs
    differently once CUDA_VISIBLE_DEVICES is set, so the device is found by the UUID CUDA reports;
    only where that fails, by its CUDA index (right when no devices are hidden)."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is not None:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}"), f"GPU-{uuid}"
        except nvml.NVMLError:
            pass
    handle = nvml.nvmlDeviceGetHandleByIndex(device.index or 0)
    got = nvml.nvmlDeviceGetUUID(handle)
    return handle, got.decode() if isinstance(got, bytes) else str(got)


@contextmanager
def reported_errors(role: str, rank: int, conn):
    """Any failure inside becomes a WorkerError to the driver and exit status 1; a driver that went
    away (EOF on the pipe, or Ctrl-C reaching the group) ends the process quietly."""
    try:
        yield
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except BaseException as e:
        try:
            M.send(conn, M.WorkerError(role=role, rank=rank, message=f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:
            pass
        raise SystemExit(1)


def apply_for_good(candidates, device: torch.device, **targets) -> list[str]:
    """A worker's candidate patches, applied for the process's life (``EnginePatches.apply``'s
    targets and result): no revert is kept, so what a patch replaced — H6e's bf16 FFN weights,
    10.5 GiB at 480×832 — is garbage once this returns. On CUDA its blocks then go back to the
    driver: the caching allocator would keep them, and the compiled warm-up's CUDA-graph pools
    cannot reuse its free blocks, so the process would hold both copies."""
    applied = EnginePatches(candidates).apply(**targets)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return applied
