"""Keyboard actions as production takes them: one frame's held keys, validated and put in canonical
order (the camera conventions they drive: ``harness.engine.camera``). Apart from the camera so that
the client and the player's trace parser validate keys without importing torch."""

from __future__ import annotations

from harness.errors import HarnessError

#: Production's key order; a frame's canonical form lists its keys in this order ("wj").
KEYS = "wasdijkl"


def normalize_action(action: object, index: int = 0) -> str:
    """One frame's keys in canonical form (lowercase, production order) from a string of keys or
    a list of single keys."""
    if isinstance(action, str):
        keys = list(action)
    elif isinstance(action, (list, tuple)) and all(isinstance(k, str) for k in action):
        keys = list(action)
        if any(len(k) != 1 for k in keys):
            raise HarnessError(f"action {index} {list(action)!r}: a list of actions holds single keys from {KEYS}")
    else:
        raise HarnessError(f"action {index} must be a string or a list of keys from {KEYS}, got {type(action).__name__}")
    lower = {k.lower() for k in keys}
    bad = sorted(lower - set(KEYS))
    if bad:
        raise HarnessError(f"action {index} {action!r} has invalid key(s) {''.join(bad)!r}; allowed keys: {KEYS} (either case, or none)")
    return "".join(k for k in KEYS if k in lower)


def validate_actions(actions: object, frames: int) -> list[str]:
    if not isinstance(actions, (list, tuple)):
        raise HarnessError(f"actions must be a list of {frames} frames (one per latent frame), got {type(actions).__name__}")
    if len(actions) != frames:
        raise HarnessError(f"expected {frames} actions (one per latent frame), got {len(actions)}")
    return [normalize_action(a, i) for i, a in enumerate(actions)]
