"""DiT engine backends: which implementation of the DiT session API a DiT rank runs.

``reference`` is the harness's own engine (harness.engine.dit_engine); ``vllm-omni`` runs
vLLM-Omni's LingBot-World transformer and DMD block runner (harness.engine.omni), an optional
extra. Both take the same messages and return the same latents, so everything around the DiT —
timestamps, hooks, Case D/E drivers, serve, compare, scenarios, the run directory — is shared.
``check`` runs in the driver before anything starts; ``build_dit_engine`` in the DiT rank.
"""

from __future__ import annotations

import importlib
from typing import Any

from harness.config import HarnessConfig
from harness.engine.omni import compat  # stdlib only at import: vllm itself is imported by the rank that runs it
from harness.errors import HarnessError

#: backend name → "module:class" (imported only by the rank that builds it)
DIT_BACKENDS = {
    "reference": "harness.engine.dit_engine:DitEngine",
    "vllm-omni": "harness.engine.omni.omni_dit_engine:OmniDitEngine",
}


def check(cfg: HarnessConfig) -> None:
    """Refuse, with one line, a backend that cannot run here: an unknown name, or a missing or
    unsupported vllm extra (with the install command). Candidates that patch the reference DiT
    are refused where every candidate is checked (``candidates.resolve``)."""
    backend = cfg.engine.backend
    if backend not in DIT_BACKENDS:
        raise HarnessError(f"unknown engine backend {backend!r} (known: {', '.join(DIT_BACKENDS)})")
    if backend == "reference":
        return
    compat.check_installed()


def describe(cfg: HarnessConfig) -> dict:
    """The backend and, for vllm-omni, the installed versions (for the run manifest)."""
    out: dict[str, Any] = {"backend": cfg.engine.backend}
    if cfg.engine.backend == "vllm-omni":
        out.update(compat.installed_versions())
    return out


def build_dit_engine(cfg: HarnessConfig, **kwargs):
    module, _, cls = DIT_BACKENDS[cfg.engine.backend].partition(":")
    return getattr(importlib.import_module(module), cls)(cfg, **kwargs)
