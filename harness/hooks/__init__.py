"""Instrumentation switched on with ``--hooks``: nvtx, dispatch, trace, profile, capture.

    hooks = parse_hooks("nvtx,dispatch,trace,profile=5:7")   # → HookSet, or HarnessError
    with active.activate(hooks, out_dir=run_dir, label="dit0") as a:  # in each worker process
        ...serve loop; the engine marks phases with context.phase(...)...
    a.report()                                               # what ran → manifest/summary
    if hooks.trace:                                          # in the driver, after the run
        trace.write_trace(events, run_dir / "trace.json")

Grammar: comma-separated items, each ``name`` or ``name=value``:

- ``nvtx`` — NVTX ranges (domain ``harness``) for every phase scope.
- ``dispatch`` / ``dispatch=full`` — ATen recorder writing ``dispatch[.label].jsonl`` and a
  summary; ``dispatch=summary`` keeps only the summary (long runs).
- ``trace`` — ``trace.json`` built from the event table by the driver; nothing runs in workers.
- ``profile`` / ``profile=A`` / ``profile=A:B`` / ``profile=A:B@E`` — torch.profiler over chunks
  A..B (default 5:5, a steady chunk) of epoch E (default 1, the first measured session).
- ``capture`` / ``capture=BUDGET`` — save the inputs of attention, linears, convs and the uint8
  conversion, one per distinct signature, into ``capture/`` until BUDGET bytes (``K``/``M``/``G``
  suffixes, binary; default 256M) are used; ``python -m harness replay`` times them.

Modules: ``spec`` (the grammar, ``HookSet``; no torch, re-exported here), ``active``
(``activate``: switches a set on in a worker), ``context`` (the phase scopes the engine marks),
``registries`` (the op tables the engine lends to ``capture``), one module per hook; ``telemetry``
(the NVML sampler of ``--telemetry HZ``, a setting of the run rather than a ``--hooks`` item). This package
imports neither torch nor nvtx: ``harness.hooks.active`` loads what a set needs.
"""

from __future__ import annotations

from harness.hooks.spec import (
    DEFAULT_CAPTURE_BUDGET, DEFAULT_PROFILE, DEFAULT_PROFILE_EPOCH, DRIVER_REPORT, NAMES, HookSet, format_budget,
    parse_budget, parse_hooks,
)
from harness.hooks.trace import trace_report

__all__ = ["DEFAULT_CAPTURE_BUDGET", "DEFAULT_PROFILE", "DEFAULT_PROFILE_EPOCH", "DRIVER_REPORT", "NAMES", "HookSet",
           "format_budget", "parse_budget", "parse_hooks", "trace_report"]
