"""``replay``: time captured op inputs (``--hooks capture``) on every backend that can run them.

    python -m harness replay RUN_DIR [--ops attention,linear,conv,convert] [--backends a,b] [--repeats N]
    python -m harness replay RUN_DIR --single OP_ID [--backend NAME] [--no-profiler]
    python -m harness replay --synthetic lingbot-480x832 [--sp 1,2] [--kv 4680,14040,28080] --out DIR

For each captured input and each backend: build the call (not timed), run it once (``first_ms``:
compilation included), compare the result with an FP64 reference, then warm up and time repeated
calls — CUDA events on a GPU, ``perf_counter`` on the CPU. A backend that cannot run the input or
whose result fails the check is a *failure* with its reason and no time: it never shows up as fast.

One module per idea, arrows pointing down the list:

* ``replay_command`` — the command: checks the arguments, picks the inputs, runs them, writes the report;
* ``outputs`` — ``replay.json``, ``replay.md`` and the heat maps; ``h1b`` — whole-model results of
  candidate H1b to set beside the local winners;
* ``single`` — ``--single OP_ID``: one call under a profiler;
* ``runner`` — every input on every backend, checked and timed (``timing``), a winner per input;
  ``load_backends`` fills the registry;
* ``reference`` — the FP64 reference and the pass/fail check;
* ``op_backends_fa3`` — FlashAttention-3 rows and FP8 emulations; ``op_backends`` — the registry and the
  SDPA / engine-KV / GEMM / conv / conversion families;
* ``cases`` — captured inputs and ``--synthetic`` production shapes;
* ``replay_options``, ``settings`` — the command's arguments and defaults (no torch).
"""

from __future__ import annotations

import argparse

from harness.experiments.replay.replay_options import add_replay_arguments

__all__ = ["add_replay_arguments", "main"]


def main(args: argparse.Namespace) -> int:
    # Imported here, not at the top: the command line imports this package to build its parser for
    # every command, and the run's modules import torch (measured: `python -m harness --help` takes
    # 0.13 s, importing torch alone 1.5-2 s on a 2-core host).
    from harness.experiments.replay.replay_command import run

    return run(args)
