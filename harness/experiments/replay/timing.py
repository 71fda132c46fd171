"""How a replayed call is timed: CUDA events around each call on a GPU, ``perf_counter`` on the CPU."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], device, warmup: int, repeats: int) -> list[float]:
    """Milliseconds per call, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for s, e in ev:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in ev]
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def timed_once(fn: Callable[[], Any], device) -> tuple[Any, float]:
    """One call's result and its wall time in milliseconds, the device synchronised after it
    (the first call of a backend: compilation included)."""
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, (time.perf_counter() - t0) * 1e3
