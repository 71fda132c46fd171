"""A deterministic scripted action trajectory: what an interactive client would send.

One action string per latent frame (keys WASD translate, IJKL rotate). The script walks
forward, turns, strafes and looks around so that every camera code path is exercised, and it
depends only on (seed, chunk) so every launch of the same run sends the same actions.
"""

from __future__ import annotations

_SCRIPT = ("W", "W", "WJ", "W", "WL", "D", "A", "S", "I", "K", "WD", "", "J", "L", "WA")


def actions_for(seed: int, chunk: int, frames_per_chunk: int) -> list[str]:
    base = (seed * 7 + chunk * frames_per_chunk) % len(_SCRIPT)
    return [_SCRIPT[(base + f) % len(_SCRIPT)] for f in range(frames_per_chunk)]
