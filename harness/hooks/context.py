"""Where the program is — session, chunk, stage, step, layer, attention role — for the hooks.

The engine, workers and pipeline mark their structure with one call::

    from harness.hooks import context as hctx

    with hctx.phase(session=s, epoch=e):
        with hctx.phase(chunk=c, stage="dit"):
            for step in range(5):
                with hctx.phase(step=step):           # 0..3 denoise, 4 = commit
                    for i, block in enumerate(blocks):
                        with hctx.phase(layer=i):
                            ...
                            with hctx.phase(role="self_attention"):
                                out = attention_core(q, k, v)   # SDPA, or the paged bmm blocks

Consumers of the phase: the dispatch recorder reads ``current()`` for every ATen call; the NVTX
hook and the profiler window are *listeners* told of every phase entry and exit.

Cost when no hook is on: ``phase()`` returns one shared ``nullcontext`` after a single test of a
module global, so the contextvar is never touched and no listener runs. That is a plain Python
call (~0.1 µs); a loop hot enough to care (per layer × 5 forwards) can skip even the call with
``if hctx.ACTIVE:`` — read it as a module attribute, never ``from … import ACTIVE``, which
would copy the value at import time.

The ``role`` field has a precise meaning for FLOP accounting: set it to ``"self_attention"`` or
``"cross_attention"`` around the attention *core* only (QKᵀ, softmax, PV — an SDPA call, or a
paged attention written as bmm blocks), never around the Q/K/V/O projections: every matmul
inside such a role counts as attention FLOPs, not linear (see ``flops.categorize``). Any other
string is carried into records and summaries but changes no category.

Contextvars make the phase per thread and per asyncio task, so a worker's encoder thread and
its compute thread each keep their own.

Under ``torch.compile`` a phase scope inside a compiled region is dropped (``phase()`` returns
the null context while dynamo traces): dynamo cannot trace a ContextVar and would otherwise fall
back to eager for the *whole* function, silently turning ``--mode compiled`` into eager whenever
a hook is on. Scopes around compiled calls (chunk, step, the per-layer loop around compiled
blocks) still work; a range inside a compiled/CUDA-graph region could not mean anything anyway.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, NamedTuple, Protocol

import torch


class Phase(NamedTuple):
    session: int | None = None
    epoch: int | None = None
    chunk: int | None = None
    stage: str | None = None  # "dit", "decode", "convert", "d2h", "encode", …
    step: int | str | None = None  # 0..3 denoise, 4 (or "commit") the cache-writing pass
    layer: int | None = None
    role: str | None = None

    def fields(self) -> dict[str, Any]:
        return {k: v for k, v in zip(self._fields, self) if v is not None}


FIELDS: tuple[str, ...] = Phase._fields
EMPTY = Phase()


class Listener(Protocol):
    """Told of every phase entry/exit while registered; ``fields`` are those the call set,
    ``phase`` the merged phase inside the scope and ``parent`` the one around it."""

    def enter(self, fields: dict[str, Any], phase: Phase, parent: Phase) -> None: ...

    def exit(self, fields: dict[str, Any], phase: Phase, parent: Phase) -> None: ...


#: True while anything consumes phases. The only thing ``phase()`` looks at when off.
ACTIVE = False

_current: contextvars.ContextVar[Phase] = contextvars.ContextVar("harness_phase", default=EMPTY)
_listeners: tuple[Listener, ...] = ()  # replaced, never mutated: scopes iterate a snapshot
_trackers = 0  # consumers that only read current() (the dispatch recorder)
_NULL = contextlib.nullcontext()
_UNSET: Any = object()


def _never() -> bool:
    return False


_compiling = _never  # torch.compiler.is_compiling once a hook is on


def _refresh() -> None:
    global ACTIVE, _compiling
    ACTIVE = bool(_listeners) or _trackers > 0
    if ACTIVE and _compiling is _never:
        _compiling = torch.compiler.is_compiling


def add_listener(listener: Listener) -> None:
    global _listeners
    if listener not in _listeners:
        _listeners = _listeners + (listener,)
    _refresh()


def remove_listener(listener: Listener) -> None:
    global _listeners
    _listeners = tuple(x for x in _listeners if x is not listener)
    _refresh()


def acquire() -> None:
    """Keep phases tracked (for a consumer that reads ``current()`` without listening)."""
    global _trackers
    _trackers += 1
    _refresh()


def release() -> None:
    global _trackers
    _trackers = max(0, _trackers - 1)
    _refresh()


def current() -> Phase:
    """The phase of the calling thread/task; ``EMPTY`` when nothing is tracked."""
    return _current.get()


class _Scope:
    __slots__ = ("fields", "listeners", "token", "phase", "parent")

    def __init__(self, fields: dict[str, Any]):
        self.fields = fields

    def __enter__(self) -> Phase:
        parent = _current.get()
        phase = parent._replace(**self.fields)
        self.parent, self.phase = parent, phase
        self.token = _current.set(phase)
        # A listener registered while this scope is open must not see an exit without an entry.
        self.listeners = _listeners
        for listener in self.listeners:
            listener.enter(self.fields, phase, parent)
        return phase

    def __exit__(self, *exc: object) -> None:
        try:
            for listener in reversed(self.listeners):
                listener.exit(self.fields, self.phase, self.parent)
        finally:
            _current.reset(self.token)


def phase(
    *,
    session: int | None = _UNSET,
    epoch: int | None = _UNSET,
    chunk: int | None = _UNSET,
    stage: str | None = _UNSET,
    step: int | str | None = _UNSET,
    layer: int | None = _UNSET,
    role: str | None = _UNSET,
) -> contextlib.AbstractContextManager:
    """Scope in which the given fields are set (``None`` clears one); nests and restores.

    Keyword-only with explicit names so that a misspelt field fails even when hooks are off.
    """
    if not ACTIVE or _compiling():
        return _NULL
    given = {"session": session, "epoch": epoch, "chunk": chunk, "stage": stage, "step": step, "layer": layer, "role": role}
    return _Scope({k: v for k, v in given.items() if v is not _UNSET})


def reset_for_tests() -> None:
    """Drop every listener and tracker (tests only; production code pairs add/remove)."""
    global _listeners, _trackers
    _listeners, _trackers = (), 0
    _refresh()
