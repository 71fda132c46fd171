"""How a WebSocket session ended, as the server records it: from what it sent and what came back.

The driver calls a session complete once every chunk was generated; over a network that is not the
end. A client that leaves after the last chunk's header (or stops before its acknowledgement) never
confirmed that chunk: the session was ended by its client's disconnect, and sessions.jsonl, the
``ended`` message and the summary say so (cancelled, the chunk's ``delivered`` left empty), instead
of "complete" with a chunk that was never delivered.
"""

from __future__ import annotations

import dataclasses

import msgspec

from harness.drivers.driver import SessionResult


def ended_by_client(res: SessionResult, acked: int, lost: bool) -> bool:
    """True when a session the driver finished lost its client (``lost``: disconnected, or
    cancelled on its account) before every chunk generated was acknowledged. A session the driver
    cancelled is recorded as it is; one whose connected client stalled after the last chunk is
    given up, not cancelled (ListenOptions.stall_timeout_s)."""
    return not res.cancelled and lost and acked < len(res.events)


def as_delivered(res: SessionResult, acked: int, lost: bool) -> SessionResult:
    """``res`` as its client received it: cancelled when ``ended_by_client`` (no chunk hashes, as
    for any cancelled session: the gate compares sessions that ran to their end), else unchanged."""
    if not ended_by_client(res, acked, lost):
        return res
    return dataclasses.replace(res, cancelled=True, chunk_hashes=[],
                               start=msgspec.structs.replace(res.start, cancelled=True))
