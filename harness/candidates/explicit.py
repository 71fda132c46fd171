"""Conflicting options are refused, never rewritten: a candidate whose configuration changes a
field the user set explicitly (``--candidate H5a --scheduler case-d``) is one line and exit 2,
not a run whose manifest quietly says case-e."""

from __future__ import annotations

from harness.candidates import resolve
from harness.config import HarnessConfig
from harness.errors import HarnessError


def _field(cfg: HarnessConfig, key: str):
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)


def refuse_rewrites(specs, cfg: HarnessConfig, explicit: dict[str, str]) -> None:
    """``explicit``: config key (``runtime.scheduler``) → the option that set it (``--scheduler``)."""
    for c, arg in resolve(specs, cfg):
        if c.configure is None:
            continue
        after = c.configure(cfg, arg)
        for key, option in explicit.items():
            if _field(after, key) != _field(cfg, key):
                raise HarnessError(f"--candidate {c.id} sets {key} = {_field(after, key)}, but {option} asked for "
                                   f"{_field(cfg, key)}; drop one of them")
