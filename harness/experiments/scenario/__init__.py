"""``python -m harness scenario {slow-consumer,cancel,crash,bad-input,interactive}``: the serving path under
stress (DESIGN §7). Each scenario prints a compact table of what it saw and the invariants it
checked, and exits 1 when one breaks.

Two ways in (``--over``):

* ``inprocess`` — one launched topology (serve with a session runner) that the scenario drives
  through ``Driver.run_session`` directly, with the file sink; many sessions, one launch.
* ``websocket`` — a ``serve --listen`` subprocess on loopback (or ``--connect`` to a running one)
  driven by the bundled client (``harness.serving.client``); server-side figures come from its ``ended``
  messages and, when the scenario launched it, from its run directory and /proc.

Every session of a scenario uses the prompt ``scenario seed {seed}``, so two sessions with the same
seed must produce the same latents and frames, bit for bit — that is how "delivered exactly once and
in order" and "the next session is unaffected" are judged.

One module per idea, arrows pointing down the list:

* ``scenario_command`` — the command: checks the arguments, runs the scenario over the chosen way in;
* one module per scenario: ``slow_consumer``, ``cancel`` (its points in ``points``),
  ``crash``, ``bad_input`` (command lines, engine, VAE), ``bad_messages`` (over websocket) and
  ``interactive`` (a player against Case D, Case E and H5a: action-to-photon, websocket only);
* ``topology`` — the in-process way in (a launched topology that runs submitted jobs, leak
  checks); ``server_process`` — the websocket way in (``serve --listen``
  as a subprocess);
* ``findings``, ``session_figures``, ``params``, ``scenario_options`` — the report, per-session figures, what a
  scenario is asked to do and the command's options.
"""

from __future__ import annotations

import argparse

from harness.experiments.scenario.scenario_options import SCENARIOS, add_scenario_arguments
from harness.experiments.scenario.params import Params
from harness.experiments.scenario.findings import Report
from harness.experiments.scenario.server_process import REPO_ROOT, ServerProcess

__all__ = ["SCENARIOS", "REPO_ROOT", "Params", "Report", "ServerProcess", "add_scenario_arguments", "main"]


def main(args: argparse.Namespace) -> int:
    # Imported here, not at the top: the command line imports this package to build its parser for
    # every command, and the scenarios import torch (measured: `python -m harness --help` takes
    # 0.13 s, importing torch alone 1.5-2 s on a 2-core host).
    from harness.experiments.scenario.scenario_command import run

    return run(args)
