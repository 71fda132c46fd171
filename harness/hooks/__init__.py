"""Instrumentation switched on with ``--hooks``: nvtx, dispatch, trace, profile, capture.

    hooks = parse_hooks("nvtx,dispatch,trace,profile=5:7")   # → HookSet, or HarnessError
    with activate(hooks, out_dir=run_dir, label="dit0") as active:   # in each worker process
        ...serve loop; the engine marks phases with context.phase(...)...
    active.report()                                          # what ran → manifest/summary
    if hooks.trace:                                          # in the driver, after the run
        trace.write_trace(events, run_dir / "trace.json")

Grammar: comma-separated items, each ``name`` or ``name=value``:

- ``nvtx`` — NVTX ranges (domain ``harness``) for every phase scope.
- ``dispatch`` / ``dispatch=full`` — ATen recorder writing ``dispatch[.label].jsonl`` and a
  summary; ``dispatch=summary`` keeps only the summary (long runs).
- ``trace`` — ``trace.json`` built from the event table by the driver; nothing runs in workers.
- ``profile`` / ``profile=A`` / ``profile=A:B`` / ``profile=A:B@E`` — torch.profiler over chunks
  A..B (default 5:5, a steady chunk) of epoch E (default 1, the first measured session).
- ``capture`` / ``capture=BUDGET`` — save the inputs of attention, linears, convs and the uint8
  conversion, one per distinct signature, into ``capture/`` until BUDGET bytes (``K``/``M``/``G``
  suffixes, binary; default 256M) are used; ``python -m harness replay`` times them.

This module imports neither torch nor nvtx; ``activate`` loads what the set needs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable, Literal

import msgspec

from harness.errors import HarnessError
from harness.hooks import context

NAMES: tuple[str, ...] = ("nvtx", "dispatch", "trace", "profile", "capture")
DEFAULT_PROFILE = (5, 5)
DEFAULT_PROFILE_EPOCH = 1
DEFAULT_CAPTURE_BUDGET = 256 << 20
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_budget(text: str) -> int:
    """``"256M"`` → bytes (binary units; ``K``/``M``/``G``, optional ``iB``/``B``)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in ("K", "M", "G") else ""
    number = t[: len(t) - len(unit)]
    try:
        v = float(number)
    except ValueError:
        raise HarnessError(f"--hooks: bad capture budget {text!r} (e.g. 64M, 1.5G, 4096)") from None
    if not 0 <= v < float("inf"):
        raise HarnessError(f"--hooks: capture budget must be a finite size ≥ 0 (got {text!r})")
    return int(v * _UNITS[unit])


def format_budget(n: int) -> str:
    for unit in ("G", "M", "K"):
        if n and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


class HookSet(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Which hooks a run asked for; ``items()`` is the canonical spelling (manifest, worker specs)."""

    nvtx: bool = False
    dispatch: Literal["off", "full", "summary"] = "off"
    trace: bool = False
    profile: tuple[int, int] | None = None
    profile_epoch: int = DEFAULT_PROFILE_EPOCH
    capture: int | None = None  # byte budget; None = off

    def items(self) -> tuple[str, ...]:
        out = []
        if self.nvtx:
            out.append("nvtx")
        if self.dispatch == "full":
            out.append("dispatch")
        elif self.dispatch == "summary":
            out.append("dispatch=summary")
        if self.trace:
            out.append("trace")
        if self.profile is not None:
            a, b = self.profile
            win = f"{a}" if a == b else f"{a}:{b}"
            out.append(f"profile={win}" + (f"@{self.profile_epoch}" if self.profile_epoch != DEFAULT_PROFILE_EPOCH else ""))
        if self.capture is not None:
            out.append("capture" if self.capture == DEFAULT_CAPTURE_BUDGET else f"capture={format_budget(self.capture)}")
        return tuple(out)

    def __str__(self) -> str:
        return ",".join(self.items())

    @property
    def any(self) -> bool:
        return bool(self.items())

    def to_dict(self) -> dict[str, Any]:
        return msgspec.json.decode(msgspec.json.encode(self))  # plain JSON types (lists, not tuples)


def _int(text: str, item: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise HarnessError(f"--hooks: bad number {text!r} in {item!r}") from None
    if v < 0:
        raise HarnessError(f"--hooks: negative number in {item!r}")
    return v


def _profile(value: str | None, item: str) -> tuple[tuple[int, int], int]:
    if value is None:
        return DEFAULT_PROFILE, DEFAULT_PROFILE_EPOCH
    window, _, epoch_text = value.partition("@")
    epoch = _int(epoch_text, item) if epoch_text else DEFAULT_PROFILE_EPOCH
    a_text, sep, b_text = window.partition(":")
    a = _int(a_text, item)
    b = _int(b_text, item) if sep else a
    if b < a:
        raise HarnessError(f"--hooks: profile window {a}:{b} ends before it starts")
    return (a, b), epoch


def parse_hooks(spec: str | Iterable[str] | HookSet | None) -> HookSet:
    """Parse ``"nvtx,dispatch,profile=5:7"`` (or an iterable of such items, or a HookSet).
    Anything unknown or malformed is a one-line HarnessError."""
    if spec is None:
        return HookSet()
    if isinstance(spec, HookSet):
        return spec
    items = spec.split(",") if isinstance(spec, str) else [p for s in spec for p in str(s).split(",")]
    fields: dict[str, Any] = {}
    for raw in items:
        item = raw.strip()
        if not item:
            continue
        name, eq, value = item.partition("=")
        name = name.strip().lower()
        value = value.strip() if eq else None
        if name not in NAMES:
            raise HarnessError(f"unknown hook {name!r} in --hooks (known: {', '.join(NAMES)})")
        if name in fields:
            raise HarnessError(f"--hooks: {name!r} given more than once")
        if name in ("nvtx", "trace"):
            if value is not None:
                raise HarnessError(f"--hooks: {name!r} takes no value (got {item!r})")
            fields[name] = True
        elif name == "dispatch":
            mode = value or "full"
            if mode not in ("full", "summary"):
                raise HarnessError(f"--hooks: dispatch mode must be 'full' or 'summary' (got {value!r})")
            fields["dispatch"] = mode
        elif name == "capture":
            fields["capture"] = DEFAULT_CAPTURE_BUDGET if value is None else parse_budget(value)
        else:
            fields["profile"], fields["profile_epoch"] = _profile(value, item)
    return HookSet(**fields)


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
            from harness.hooks import nvtx_ranges

            nvtx_ranges.enable(self._nvtx_backend)
        if h.profile is not None:
            from harness.hooks.profile import ProfileWindow

            self.profile = ProfileWindow(*h.profile, epoch=h.profile_epoch, out_dir=self.out_dir, label=self.label)
            context.add_listener(self.profile)
        if h.capture is not None:
            # entered before the dispatch recorder and left after it: both push torch function
            # modes, which must come off the stack in reverse order
            from harness.hooks.capture import CaptureRecorder

            self.capture = CaptureRecorder(self.out_dir / "capture", budget=h.capture, process=self.label)
            self.capture.__enter__()
        if h.dispatch != "off":
            from harness.hooks.dispatch import DispatchRecorder

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
                from harness.hooks import nvtx_ranges

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
            out["files"] = {p.name: _size(p) for p in self._files}
            out["overhead_ms"] = {"start": self._overhead_ns["start"] / 1e6, "close": self._overhead_ns["close"] / 1e6,
                                  **{f"{k}_in_run": v for k, v in (("nvtx", self._ran.get("nvtx", {}).get("push_pop_ms")),
                                                                    ("dispatch", self._ran.get("dispatch", {}).get("record_ms")))
                                     if v is not None}}
        return out


#: What the driver's hooks did (the trace), beside the workers' ``hooks.<role><rank>.json``.
DRIVER_REPORT = "hooks.driver.json"


def _size(p: Path) -> int:
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return p.stat().st_size if p.exists() else 0


def trace_report(path: Path, n_events: int, build_ns: int) -> dict[str, Any]:
    """The driver's hook report: the trace it built after the run."""
    return {"requested": ["trace"], "label": "driver",
            "trace": {"file": path.name, "chunks": n_events, "build_ms": build_ns / 1e6},
            "files": {path.name: _size(path)}, "overhead_ms": {"trace_after_run": build_ns / 1e6}}


def activate(hooks: str | Iterable[str] | HookSet | None, *, out_dir: str | Path, label: str = "", nvtx_backend: Any = None) -> ActiveHooks:
    """An ``ActiveHooks`` for this process (enter it to switch the hooks on)."""
    return ActiveHooks(parse_hooks(hooks), out_dir=out_dir, label=label, nvtx_backend=nvtx_backend)
