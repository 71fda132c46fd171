"""``--single OP_ID``: one input on one backend, once after a warm-up, for a kernel profiler.

The call runs inside an NVTX range ``replay:<OP_ID>`` and between ``cudaProfilerStart``/``Stop``,
so e.g. ``ncu --profile-from-start off --set full -o op python -m harness replay RUN --single ID
--backend sdpa-cudnn --no-profiler`` profiles exactly that call. It prints the kernels launched
(torch.profiler; on the CPU the ATen op tree).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity
from torch.profiler import profile as tprofile

from harness.errors import HarnessError
from harness.experiments.replay.op_backends import Backend
from harness.experiments.replay.cases import Case
from harness.experiments.replay.timing import sync, timed_once

#: ATen ops that only make views or allocate: listing them would bury the ones that compute.
_METADATA_OPS = frozenset({"as_strided", "view", "transpose", "select", "slice", "unsqueeze", "squeeze", "flatten",
                           "empty", "empty_strided", "empty_like", "expand", "reshape", "_reshape_alias", "t", "permute",
                           "detach", "alias", "resolve_conj", "resolve_neg", "lift_fresh", "unflatten", "split", "unbind",
                           "narrow", "view_as", "_unsafe_view"})


@contextlib.contextmanager
def _profiled_range(op_id: str, cuda: bool):
    """An NVTX range and a cudaProfilerStart/Stop pair around the call (nothing on the CPU)."""
    if cuda:
        torch.cuda.nvtx.range_push(f"replay:{op_id}")
        torch.cuda.profiler.start()
    try:
        yield
    finally:
        if cuda:
            torch.cuda.profiler.stop()
            torch.cuda.nvtx.range_pop()


def _cuda_kernels(events: list, out) -> list[dict]:
    kernels: dict[str, list[float]] = {}
    for e in events:
        if e.device_type == DeviceType.CUDA:
            kt = getattr(e, "device_time", None) or getattr(e, "device_time_total", 0.0) or 0.0
            kernels.setdefault(e.name, []).append(float(kt) / 1e3)
    rows = [{"name": k, "count": len(v), "ms": sum(v)} for k, v in kernels.items()]
    print("kernels launched:", file=out)
    for k in rows:
        print(f"  {k['count']:>3} × {k['ms']:9.4f} ms  {k['name']}", file=out)
    return rows


def _depth(e) -> int:
    d, p = 0, e.cpu_parent
    while p is not None:
        d, p = d + 1, p.cpu_parent
    return d


def _aten_ops(events: list, out) -> list[str]:
    ops = [(_depth(e), e.name) for e in sorted(events, key=lambda e: e.time_range.start)
           if e.name.startswith("aten::") and e.name[6:] not in _METADATA_OPS]
    print("ATen ops (CPU: no kernels to list; views and empty allocations left out):", file=out)
    for d, n in ops:
        print(f"  {'  ' * d}{n}", file=out)
    return [n for _, n in ops]


def run_single(case: Case, backend: Backend, device, *, warmup: int = 1, profile: bool = True,
               out=None) -> dict:
    """One call of one backend (after ``warmup`` calls) inside an NVTX range and a
    cudaProfilerStart/Stop pair; returns and prints what it launched."""
    out = out or sys.stdout
    t = case.load(device)
    res: dict[str, Any] = {"op_id": case.op_id, "backend": backend.name, "label": case.label()}
    if "cuda" in backend.needs and device.type != "cuda":
        raise HarnessError(f"backend {backend.name!r} needs a CUDA device")
    prep = backend.make(case, t, device)
    cuda = device.type == "cuda"
    prof = None
    with prep.context(), torch.inference_mode():
        for _ in range(warmup):
            prep.fn()
        sync(device)
        with _profiled_range(case.op_id, cuda):
            if profile:
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with tprofile(activities=acts) as prof:
                    _, res["wall_ms"] = timed_once(prep.fn, device)
            else:
                _, res["wall_ms"] = timed_once(prep.fn, device)
    print(f"{case.op_id} · {case.label()} · backend {backend.name} · {res['wall_ms']:.3f} ms wall", file=out)
    if prof is None:
        return res
    events = list(prof.events())
    if cuda:
        res["kernels"] = _cuda_kernels(events, out)
    else:
        res["aten_ops"] = _aten_ops(events, out)
    return res
