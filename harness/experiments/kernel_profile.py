"""Profile one call on the GPU and break its kernel time down (``measure.kernels``).

Used by ``bench-engine --kernels`` and the multi-arm A/B (``ab-arms``): one extra chunk past the
timed ones under ``torch.profiler`` (CUDA activity only; kernels inside CUDA-graph replays are
reported too). The profiled chunk's wall time carries the profiler's overhead, so callers drop it.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from harness.measure.kernels import breakdown


def kernel_rows(prof) -> list[tuple[str, float, int]]:
    rows = []
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = e.self_cuda_time_total
        if us > 0:
            rows.append((e.key, float(us), int(e.count)))
    return rows


class ProfileChunk:
    """An ``on_latent`` callback for ``bench_engine.timed_session`` that profiles the chunk after
    the first ``skip`` ones: the profiler starts when chunk ``skip`` − 1's latent arrives and stops
    at the next one. ``result`` holds the breakdown once the profiled chunk is done."""

    def __init__(self, skip: int):
        self.skip, self.seen, self._prof, self.result = skip, 0, None, None

    def __call__(self, latent) -> None:
        self.seen += 1
        if self.seen == self.skip:
            self._prof = profile(activities=[ProfilerActivity.CUDA])
            self._prof.__enter__()
        elif self._prof is not None and self.result is None:
            torch.cuda.synchronize()
            self._prof.__exit__(None, None, None)
            self.result = breakdown(kernel_rows(self._prof))
