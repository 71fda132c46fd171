"""The ``scenario`` command's own options (argparse only: the command line imports this to build
its parser for every command, and nothing here may pull in torch)."""

from __future__ import annotations

import argparse

SCENARIOS = ("slow-consumer", "cancel", "crash", "bad-input", "interactive")
#: interactive's arms (``interactive.ARMS``): Case D, Case E, and Case E's schedule as candidate H5a
ARM_NAMES = ("case-d", "case-e", "h5a")


def add_scenario_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", choices=SCENARIOS)
    g = p.add_argument_group("scenario")
    g.add_argument("--over", choices=["inprocess", "websocket"],
                   help="drive the launched topology directly (file sink) or through serve --listen and the bundled client "
                        "(default inprocess; interactive runs over websocket only)")
    g.add_argument("--connect", metavar="HOST:PORT", help="websocket: use this running server instead of launching one")
    g.add_argument("--rate", type=float, default=0.5, help="slow-consumer: consumer speed as a fraction of the rate the unthrottled reference "
                   "session was delivered at on this machine (default 0.5)")
    g.add_argument("--slow-sessions", type=int, default=2, help="slow-consumer: throttled sessions (default 2)")
    g.add_argument("--points", help="cancel: comma list of cancel points to run (default: all; --points list prints them)")
    g.add_argument("--cancel-chunks", type=int, default=3, help="cancel: chunks of each cancelled session (default 3)")
    g.add_argument("--verify-chunks", type=int, default=2, help="cancel: chunks of the session checked after each cancel (default 2)")
    g.add_argument("--ranks", default="dit:1,vae:1", help="crash: ranks to SIGKILL, one run each (default dit:1,vae:1)")
    g.add_argument("--fault-chunk", type=int, default=2, help="crash: the chunk at which the rank dies (default 2)")
    g.add_argument("--detect-bound", type=float, default=5.0, help="crash: seconds from the death to a clear error (default 5)")
    g.add_argument("--window", type=int, help="websocket: the launched server's window of unacknowledged chunks")
    g.add_argument("--player", default="random:0", metavar="TRACE",
                   help="interactive: the player's trace, as client --player (default random:0)")
    g.add_argument("--arms", default=",".join(ARM_NAMES),
                   help="interactive: comma list of the arms to run, each its own server, in order (default "
                        f"{','.join(ARM_NAMES)}); --candidate applies to every arm")
    g.add_argument("--rss-slack-mib", type=float, default=48.0, help="slow-consumer: allowed RSS growth across throttled sessions")
