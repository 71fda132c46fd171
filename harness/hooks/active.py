"""The hooks of one process, switched on (``activate``) and reporting what they did.

Loads every hook's module (torch among them); ``harness.hooks`` itself stays torch-free.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable

from harness.hooks import context, nvtx_ranges
from harness.hooks.capture import CaptureRecorder
from harness.hooks.dispatch import DispatchRecorder
from harness.hooks.profile import ProfileWindow
from harness.hooks.spec import DRIVER_REPORT, HookSet, parse_hooks, path_bytes


class ActiveHooks:
    """The hooks of one process, switched on. Enter it on the thread that runs the model (the
    dispatch recorder is a per-thread mode); leave it to flush, export and switch off."""

    def __init__(self, hooks: HookSet, *, out_dir: str | Path, label: str = "", nvtx_backend: Any = None):
        self.hooks, self.out_dir, self.label = hooks, Path(out_dir), label
        self._nvtx_backend = nvtx_backend
        self.recorder: Any = None
        self.profile: Any = None
        self.capture: Any = None
        self._ran: dict[str, Any] = {}
        self._files: list[Path] = []
        self._overhead_ns = {"start": 0, "close": 0}
        self._open = False

    def _name(self, stem: str, ext: str) -> Path:
        return self.out_dir / (f"{stem}.{self.label}.{ext}" if self.label else f"{stem}.{ext}")

    def __enter__(self) -> "ActiveHooks":
        self._open = True
        t = time.perf_counter_ns()
        try:
            self._start()
        except BaseException:
            self.close()  # nothing half-on: a failed start switches off what it switched on
            raise
        self._overhead_ns["start"] = time.perf_counter_ns() - t
        return self

    def _start(self) -> None:
        h = self.hooks
        if h.nvtx:
            nvtx_ranges.enable(self._nvtx_backend)
        if h.profile is not None:
            self.profile = ProfileWindow(*h.profile, epoch=h.profile_epoch, out_dir=self.out_dir, label=self.label)
            context.add_listener(self.profile)
        if h.capture is not None:
            # entered before the dispatch recorder and left after it: both push torch function
            # modes, which must come off the stack in reverse order
            self.capture = CaptureRecorder(self.out_dir / "capture", budget=h.capture, process=self.label)
            self.capture.__enter__()
        if h.dispatch != "off":
            path = self._name("dispatch", "jsonl") if h.dispatch == "full" else None
            recorder = DispatchRecorder(path, process=self.label)
            recorder.__enter__()
            self.recorder = recorder

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        t = time.perf_counter_ns()
        try:
            if self.recorder is not None:
                self.recorder.__exit__(None, None, None)
                self.recorder.close()
                summary = self.recorder.summary()
                spath = self._name("dispatch_summary", "json")
                spath.parent.mkdir(parents=True, exist_ok=True)
                spath.write_text(json.dumps(summary, indent=1))
                self._ran["dispatch"] = {"mode": self.hooks.dispatch, "calls": summary["calls"],
                                         "total_flops": summary["total_flops"], "summary": spath.name,
                                         "records": self.recorder.path.name if self.recorder.path else None,
                                         "record_ms": self.recorder.record_ns / 1e6}
                self._files += [spath] + ([self.recorder.path] if self.recorder.path else [])
        finally:
            if self.capture is not None:
                self.capture.__exit__(None, None, None)
                self._ran["capture"] = self.capture.status()
                self._files.append(self.capture.dir)
            if self.profile is not None:
                context.remove_listener(self.profile)
                self.profile.close()
                self._ran["profile"] = self.profile.status()
                if self.profile.state == "done":
                    self._files.append(self.profile.path)
            if self.hooks.nvtx:
                self._ran["nvtx"] = {"ranges": nvtx_ranges.STATS["ranges"], "push_pop_ms": nvtx_ranges.STATS["ns"] / 1e6}
                nvtx_ranges.disable()
            self._overhead_ns["close"] = time.perf_counter_ns() - t

    def report(self) -> dict[str, Any]:
        """What this process's hooks did: per hook that ran here, its counts and measured cost;
        the files they wrote (bytes; a directory's total); hooks requested that run elsewhere; and
        the time spent switching the hooks on and off. For the run directory's ``hooks.*.json``."""
        out: dict[str, Any] = {"requested": list(self.hooks.items()), "label": self.label, **self._ran}
        if self.hooks.trace:
            out["elsewhere"] = {"trace": f"trace.json is built by the driver from events.jsonl after the run ({DRIVER_REPORT})"}
        if self._ran:
            out["files"] = {p.name: path_bytes(p) for p in self._files}
            out["overhead_ms"] = {"start": self._overhead_ns["start"] / 1e6, "close": self._overhead_ns["close"] / 1e6,
                                  **{f"{k}_in_run": v for k, v in (("nvtx", self._ran.get("nvtx", {}).get("push_pop_ms")),
                                                                    ("dispatch", self._ran.get("dispatch", {}).get("record_ms")))
                                     if v is not None}}
        return out


def activate(hooks: str | Iterable[str] | HookSet | None, *, out_dir: str | Path, label: str = "", nvtx_backend: Any = None) -> ActiveHooks:
    """An ``ActiveHooks`` for this process (enter it to switch the hooks on)."""
    return ActiveHooks(parse_hooks(hooks), out_dir=out_dir, label=label, nvtx_backend=nvtx_backend)
