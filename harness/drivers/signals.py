"""SIGINT and SIGTERM stop every command, whatever its parent did to them.

A process started in the background by a shell (or by a supervisor) may inherit SIGINT as
*ignored*; Python then installs no KeyboardInterrupt handler and Ctrl-C or ``kill -INT`` does
nothing. ``install`` sets both signals explicitly, so either one stops the command the same way:
the first raises ``Stopped`` (a KeyboardInterrupt, so every ``finally`` tears down as for Ctrl-C)
or calls ``on_stop`` (the network endpoint's graceful stop; inside ``starting()``, while its ranks
start and nothing is served yet, it raises as well); later ones only say that teardown is
under way, so a second Ctrl-C cannot cut the teardown short and leave processes or shared memory
behind (teardown is bounded: ranks get a few seconds, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Callable

_received: list[str] = []
_held: list[int] = []  # [depth of held() blocks, signum received meanwhile or 0]
_starting: list[bool] = []  # non-empty inside starting(): a stop raises even when on_stop is given


class Stopped(KeyboardInterrupt):
    """Raised by the first SIGINT/SIGTERM; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def install(on_stop: Callable[[str], None] | None = None) -> bool:
    """Handle SIGINT and SIGTERM in this (main) thread; False when not on the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return False

    def handler(signum, _frame) -> None:
        name = signal.Signals(signum).name
        if _received:
            print(f"{name}: already stopping (teardown under way)", file=sys.stderr, flush=True)
            return
        _received.append(name)
        if on_stop is not None:
            on_stop(f"server shutting down ({name})")
            if not _starting:  # the graceful stop takes it from here
                return
        if _held and _held[0]:
            _held[1] = signum
            return
        raise Stopped(signum)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, handler)
    return True


@contextlib.contextmanager
def held():
    """Raise a stop signal that arrives inside the block only when it ends: a worker whose spawn
    is cut short reads a truncated start-up message and dies with a traceback of its own."""
    if not _held:
        _held.extend([0, 0])
    _held[0] += 1
    try:
        yield
    finally:
        _held[0] -= 1
    if _held[0] == 0 and _held[1]:
        signum, _held[1] = _held[1], 0
        raise Stopped(signum)


@contextlib.contextmanager
def starting():
    """Start-up of a command whose stop is graceful (``on_stop``): nothing is served yet, so a stop
    signal inside the block stops it at once (``Stopped``) rather than once every rank is ready."""
    _starting.append(True)
    try:
        yield
    finally:
        _starting.pop()


def received() -> str | None:
    """The first stop signal this process got (``SIGTERM``…), or None."""
    return _received[0] if _received else None


def ending(err: BaseException) -> tuple[str, str]:
    """(status, error) that a run stopped by ``err`` records in its manifest."""
    if isinstance(err, KeyboardInterrupt):
        return "interrupted", str(err) if isinstance(err, Stopped) else "stopped by SIGINT (KeyboardInterrupt)"
    return "failed", f"{type(err).__name__}: {err}"
