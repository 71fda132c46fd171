"""NVTX ranges (domain ``harness``) for session / chunk / stage / step / layer, for Nsight Systems.

The ranges come from ``context.phase`` scopes: while enabled, a listener pushes one range per
phase entry, named from the fields that call set (``"session 1"``, ``"chunk 5"``, ``"dit"``,
``"step 2"``, ``"layer 17"``, ``"self_attention"``; several fields join with spaces) with the
NVTX category of the coarsest field, and pops it on exit. ``range(name)`` marks anything else.

Off means no NVTX call at all: the listener is not registered, so ``phase()`` returns its shared
``nullcontext`` before reaching this module, ``range()`` returns the same kind of singleton, and
the ``nvtx`` package is not even imported until ``enable()``.

Tests swap the backend for ``RecordingBackend``, which keeps the push/pop sequence per thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from harness.errors import HarnessError
from harness.hooks import context

DOMAIN = "harness"
ENABLED = False

#: ARGB per category, so chunk/step/layer bands are told apart at a glance in Nsight.
COLORS = {
    "session": 0xFF4E79A7, "epoch": 0xFF4E79A7, "chunk": 0xFFF28E2B, "stage": 0xFF59A14F,
    "step": 0xFFE15759, "layer": 0xFF76B7B2, "role": 0xFFB07AA1, "range": 0xFF9C755F,
}

_NULL = contextlib.nullcontext()
#: Ranges pushed since ``enable`` and the time spent pushing and popping them (this process's
#: measured NVTX overhead, timer included), for the hook report.
STATS = {"ranges": 0, "ns": 0}
_backend: Any = None
_listener: "_PhaseRanges | None" = None


def range_name(fields: dict[str, Any]) -> str:
    parts = []
    for key in context.FIELDS:
        if key not in fields:
            continue
        v = fields[key]
        if key in ("stage", "role") or (key == "step" and isinstance(v, str)):
            parts.append(str(v))
        else:
            parts.append(f"{key} {v}")
    return " ".join(parts)


def range_category(fields: dict[str, Any]) -> str:
    for key in context.FIELDS:
        if key in fields:
            return key
    return "range"


class NvtxBackend:
    """The real thing, through ``nvtx.Domain`` with attributes cached per (name, category):
    that path costs ~0.1 µs a range, the module-level ``nvtx.push_range`` ~0.5 µs."""

    def __init__(self, domain: str = DOMAIN):
        try:
            import nvtx  # optional at run time: only this hook needs it, and it says how to get it
        except ImportError:
            raise HarnessError("the nvtx hook needs the 'nvtx' package (pip install nvtx)") from None

        self._domain = nvtx.get_domain(domain)
        self._attrs: dict[tuple[str, str], Any] = {}

    def push(self, name: str, category: str) -> None:
        attrs = self._attrs.get((name, category))
        if attrs is None:
            attrs = self._domain.get_event_attributes(message=name, color=COLORS.get(category), category=category)
            self._attrs[(name, category)] = attrs
        self._domain.push_range(attrs)

    def pop(self) -> None:
        self._domain.pop_range()


class RecordingBackend:
    """Keeps ``("push", name, category, thread)`` / ``("pop", None, None, thread)`` calls."""

    def __init__(self):
        self.calls: list[tuple[str, str | None, str | None, int]] = []
        self._lock = threading.Lock()

    def push(self, name: str, category: str) -> None:
        with self._lock:
            self.calls.append(("push", name, category, threading.get_ident()))

    def pop(self) -> None:
        with self._lock:
            self.calls.append(("pop", None, None, threading.get_ident()))

    def pushed(self) -> list[str]:
        return [c[1] for c in self.calls if c[0] == "push"]

    def balanced(self) -> bool:
        """Every pop closes a push of the same thread, and nothing is left open."""
        depth: dict[int, int] = {}
        for kind, _, _, tid in self.calls:
            depth[tid] = depth.get(tid, 0) + (1 if kind == "push" else -1)
            if depth[tid] < 0:
                return False
        return all(d == 0 for d in depth.values())


class _PhaseRanges:
    def __init__(self, backend: Any):
        self.backend = backend

    def enter(self, fields, phase, parent) -> None:
        t = time.perf_counter_ns()
        self.backend.push(range_name(fields), range_category(fields))
        STATS["ranges"] += 1
        STATS["ns"] += time.perf_counter_ns() - t

    def exit(self, fields, phase, parent) -> None:
        t = time.perf_counter_ns()
        self.backend.pop()
        STATS["ns"] += time.perf_counter_ns() - t


class _Range:
    __slots__ = ("name", "category", "backend")

    def __init__(self, name: str, category: str, backend: Any):
        self.name, self.category, self.backend = name, category, backend

    def __enter__(self) -> None:
        t = time.perf_counter_ns()
        self.backend.push(self.name, self.category)
        STATS["ranges"] += 1
        STATS["ns"] += time.perf_counter_ns() - t

    def __exit__(self, *exc: object) -> None:
        t = time.perf_counter_ns()
        self.backend.pop()
        STATS["ns"] += time.perf_counter_ns() - t


def range(name: str, category: str = "range"):  # noqa: A001 (mirrors nvtx's vocabulary)
    """A named NVTX range outside the phase structure; the shared nullcontext when off."""
    if not ENABLED or context._compiling():
        return _NULL
    return _Range(name, category, _backend)


def enable(backend: Any = None) -> Any:
    """Turn ranges on in this process (``backend`` defaults to real NVTX); returns the backend."""
    global ENABLED, _backend, _listener
    disable()
    _backend = backend if backend is not None else NvtxBackend()
    _listener = _PhaseRanges(_backend)
    context.add_listener(_listener)
    STATS.update(ranges=0, ns=0)
    ENABLED = True
    return _backend


def disable() -> None:
    global ENABLED, _backend, _listener
    if _listener is not None:
        context.remove_listener(_listener)
    ENABLED, _backend, _listener = False, None, None
