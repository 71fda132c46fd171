"""The command-line options of ``load`` and ``sweep`` (no torch here: parsing never waits for it)."""

from __future__ import annotations

import argparse


def add_server_passthrough(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the server load starts without --connect (serve --listen on a free loopback port)")
    g.add_argument("--preset", help="serve --preset (default tiny); with --connect: must match the server's (default: ask it)")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="serve --set, repeatable")
    g.add_argument("--candidate", action="append", default=[], metavar="ID", help="serve --candidate, repeatable")
    g.add_argument("--replicas", type=int, help="serve --replicas N (engine groups behind one endpoint), when the server has it")
    g.add_argument("--serve-args", default="", metavar="'ARGS'", help="any other serve options, one quoted string")


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect", metavar="HOST:PORT", help="an existing server (or a ws:// URL); default: start one")
    p.add_argument("--api", choices=["harness", "vllm-omni"], default="harness",
                   help="the server's API: the harness's own, or vLLM-Omni's realtime video API")
    p.add_argument("--arrivals", required=True, metavar="PROCESS",
                   help="poisson:RATE (RATE in sessions per MINUTE), burst:N@PERIOD (N sessions every PERIOD seconds) "
                        "or trace:FILE (start offsets in seconds, JSON lines or CSV)")
    p.add_argument("--seed", type=int, default=0, help="seeds the arrival process; session i uses seed + i")
    p.add_argument("--duration", type=float, metavar="S", help="no arrival at or after S seconds from the start")
    p.add_argument("--sessions", type=int, metavar="N", help="at most N arrivals")
    p.add_argument("--max-concurrency", type=int, metavar="N",
                   help="at most N sessions in flight from this client; an arrival beyond waits for a slot (recorded)")
    p.add_argument("--chunks", type=int, help="chunks per session (default: the server's preset)")
    p.add_argument("--slo", default="ttfc=2.0,play=0.95", metavar="ttfc=S,play=R",
                   help="a session meets the SLO when served, TTFC (queue included) ≤ S seconds and continuous play ≥ R")
    p.add_argument("--early-stop", type=float, metavar="P",
                   help="stop offering sessions once 'at least P of sessions meet the SLO' is decided either way at "
                        "99 %% confidence (MLPerf LoadGen's binomial rule); default: never stop early")
    p.add_argument("--queue-timeout", type=float, default=60.0, metavar="S",
                   help="a session not admitted (started) within S seconds leaves: outcome queue_timeout (default 60)")
    p.add_argument("--session-timeout", type=float, default=600.0, metavar="S",
                   help="a session still running S seconds after it started is ended: outcome failed (default 600)")
    p.add_argument("--slice", metavar="sessions:N|seconds:T", help="figures per slice of N sessions or T seconds, drift flagged")
    p.add_argument("--out", help="the run directory (default runs/<stamp>-load-<pid>)")
    p.add_argument("--overwrite", action="store_true", help="clear an existing run directory at --out first")
    add_server_passthrough(p)


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rates", default="", metavar="R1,R2,…", help="Poisson arrival rates, sessions per minute")
    p.add_argument("--replicas", default="", metavar="N1,N2,…", help="serve --replicas values (needs a server that has it)")
    p.add_argument("--candidate", action="append", default=[], metavar="SET",
                   help="a candidate set, ids joined by '+' ('none' for the baseline); repeat for several")
    p.add_argument("--size", action="append", default=[], metavar="WxH", help="a resolution (video.width x video.height); repeatable")
    p.add_argument("--connect", metavar="HOST:PORT", help="run every point against this one server (rates only)")
    p.add_argument("--api", choices=["harness", "vllm-omni"], default="harness")
    p.add_argument("--duration", type=float, metavar="S", help="each point's load --duration")
    p.add_argument("--sessions", type=int, metavar="N", help="each point's load --sessions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunks", type=int)
    p.add_argument("--slo", default="ttfc=2.0,play=0.95", metavar="ttfc=S,play=R")
    p.add_argument("--early-stop", type=float, metavar="P")
    p.add_argument("--max-concurrency", type=int, metavar="N")
    p.add_argument("--queue-timeout", type=float, default=60.0, metavar="S")
    p.add_argument("--session-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--x", choices=["p99", "ttfc"], default="ttfc", dest="x_axis",
                   help="the Pareto plot's cost axis: interval P99 at delivered, or TTFC P50 (default)")
    p.add_argument("--preset", help="serve --preset (default tiny)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--serve-args", default="", metavar="'ARGS'")
    p.add_argument("--gpus-per-replica", type=int, default=1, help="GPUs one replica holds, for goodput per GPU (default 1)")
    p.add_argument("--out", help="the sweep directory (default runs/<stamp>-sweep-<pid>)")
    p.add_argument("--overwrite", action="store_true")
