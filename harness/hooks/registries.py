"""Where the model meets the instruments that wrap its ops: the engine lends its switchable op
tables here when it is imported, and ``capture`` wraps their entries while it is on.

The arrow points one way: the engine imports this module; nothing in hooks/ imports the engine.
A table is the engine's own dict (name → function), not a copy: the engine looks the names up at
every forward, so a wrapper put in while a hook is on is picked up, and the original is back once
the hook puts it back.
"""

from __future__ import annotations

from typing import Callable

#: "dense": attention kernels (q, k, v) → out; "kv_path": self-attention over the paged KV cache.
ATTENTION_KINDS: tuple[str, ...] = ("dense", "kv_path")
#: kind → the engine's live table (empty until the engine is imported: then nothing calls them).
ATTENTION: dict[str, dict[str, Callable]] = {}


def lend_attention(kind: str, table: dict[str, Callable]) -> None:
    """Let the hooks wrap the entries of ``table`` (the engine's own registry of ``kind``)."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention table {kind!r} (known: {', '.join(ATTENTION_KINDS)})")
    ATTENTION[kind] = table
