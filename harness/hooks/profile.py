"""A torch.profiler window over chosen chunks, one Chrome trace per process (rank).

``--hooks profile=5:7`` profiles chunks 5..7 (inclusive) of the first measured session (epoch 1;
``profile=5:7@2`` picks epoch 2). The window follows ``context.phase``: it opens when this
process enters ``phase(chunk=5)`` in that epoch and closes when it leaves ``chunk=7`` — so the
DiT ranks and VAE ranks each profile their own work on those chunks, whenever it happens, with
no coordination. A phase without ``epoch`` is matched on ``session`` (one session per epoch in
the timing protocol). Inside the window every phase scope is also a ``record_function`` range,
so the trace shows chunk/step/layer bands above the kernels.

A run that ends or fails inside the window still exports what was captured (``close()``),
marked ``"complete": false`` in ``status()``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from harness.hooks import context
from harness.hooks.nvtx_ranges import range_name


class ProfileWindow:
    def __init__(
        self,
        first_chunk: int,
        last_chunk: int,
        *,
        out_dir: str | Path,
        label: str = "",
        epoch: int = 1,
        record_shapes: bool = True,
        with_stack: bool = False,
    ):
        if first_chunk < 0 or last_chunk < first_chunk:
            raise ValueError(f"bad profile window {first_chunk}:{last_chunk}")
        self.first, self.last, self.epoch = first_chunk, last_chunk, epoch
        self.path = Path(out_dir) / (f"profile.{label}.json" if label else "profile.json")
        self.record_shapes, self.with_stack = record_shapes, with_stack
        self.state = "waiting"  # → running → done
        self.complete = False
        self._prof: Any = None
        self._local = threading.local()  # per-thread stack of open record_function ranges

    # ---- window ------------------------------------------------------------------------------
    def _matches(self, phase: context.Phase) -> bool:
        epoch = phase.epoch if phase.epoch is not None else phase.session
        return epoch == self.epoch

    def start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=self.record_shapes, with_stack=self.with_stack)
        self._prof.start()
        self.state = "running"

    def stop(self, complete: bool = True) -> None:
        if self.state != "running":
            return
        self._prof.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(self.path))
        self._prof = None
        self.state, self.complete = "done", complete

    def close(self) -> None:
        self.stop(complete=False)

    def status(self) -> dict[str, Any]:
        return {"window": [self.first, self.last], "epoch": self.epoch, "state": self.state,
                "complete": self.complete, "path": str(self.path) if self.state == "done" else None}

    # ---- context listener ----------------------------------------------------------------------
    def enter(self, fields, phase, parent) -> None:
        if (self.state == "waiting" and "chunk" in fields and phase.chunk == self.first
                and parent.chunk != self.first and self._matches(phase)):
            self.start()
        if self.state == "running":
            rf = torch.autograd.profiler.record_function(range_name(fields))
            rf.__enter__()
            self._stack().append((fields, rf))

    def exit(self, fields, phase, parent) -> None:
        if self.state != "running":
            return
        stack = self._stack()
        # Only close a range this scope opened: scopes entered before the window have none.
        if stack and stack[-1][0] is fields:
            stack.pop()[1].__exit__(None, None, None)
        if "chunk" in fields and phase.chunk == self.last and parent.chunk != self.last and self._matches(phase):
            self.stop()

    def _stack(self) -> list:
        s = getattr(self._local, "stack", None)
        if s is None:
            s = self._local.stack = []
        return s
