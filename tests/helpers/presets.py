"""Configs the tests run on."""

from __future__ import annotations

from harness.config import HarnessConfig, load_preset, override


def tiny(*, chunks: int | None = None, **runtime) -> HarnessConfig:
    """The tiny preset with ``runtime`` fields replaced and, when given, ``chunks`` per session."""
    return override(load_preset("tiny"), runtime=runtime, video={"chunks_per_session": chunks})
