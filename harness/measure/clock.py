"""The one clock every boundary timestamp is read from (DESIGN §4's timestamp contract).

``time.monotonic_ns()`` is CLOCK_MONOTONIC: one clock per host boot, shared by every process on
the host, so timestamps taken by the driver, the workers, the encoder, the WebSocket server and a
client on the same host are directly comparable, and it never jumps with wall-clock changes.
"""

from __future__ import annotations

import time


def now() -> int:
    """Integer nanoseconds on the host's monotonic clock."""
    return time.monotonic_ns()
