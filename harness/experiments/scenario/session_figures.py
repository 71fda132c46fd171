"""Per-session figures the scenarios judge (pure functions of timestamps and events)."""

from __future__ import annotations

import hashlib
import statistics

from harness.pipeline.decode import decode_pyav

MS = 1_000_000


def ms(ns) -> str:
    return "-" if ns is None else f"{max(ns, 0) / MS:.0f}"


def p50(values) -> float | None:
    return statistics.median(values) if values else None


def intervals(times: list[int | None]) -> list[int]:
    return [b - a for a, b in zip(times, times[1:]) if a is not None and b is not None]


def peak_overlap(spans: list[tuple[int, int]]) -> int:
    edges = sorted([(a, 1) for a, b in spans] + [(b, -1) for a, b in spans])
    peak = cur = 0
    for _, d in edges:
        cur += d
        peak = max(peak, cur)
    return peak


def occupancy(events) -> int:
    """Most chunks at once between cpu_ready and encoded: a slot is held from before the first to
    after the second, so this never exceeds the ring's true occupancy."""
    return peak_overlap([(e.cpu_ready, e.encoded) for e in events if e.cpu_ready is not None and e.encoded is not None])


def blocked(events, key: str) -> int:
    return sum(e.blocked_ns.get(key, 0) for e in events)


def rate(frames: list[int], times: list[int]) -> float | None:
    """Frames per second over chunks 1.. (chunk 0 includes the start-up)."""
    if len(times) < 2 or times[-1] == times[0]:
        return None
    return sum(frames[1:]) / ((times[-1] - times[0]) / 1e9)


def frames_expected(latent_frames: int, chunks: int) -> int:
    """DESIGN §2: the first latent frame decodes to one pixel frame, every later one to four."""
    return latent_frames * chunks * 4 - 3


def decoded_hashes(path) -> list[str]:
    return [hashlib.sha256(f.tobytes()).hexdigest() for f in decode_pyav(path).frames]
