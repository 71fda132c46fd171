"""The options of ``serve`` (``--listen`` included) and of ``client``: argparse only, so that parsing a command
line (and refusing a bad one) never waits for the server's and the client's imports (torch, aiohttp)."""

from __future__ import annotations

import argparse

from harness.drivers.config_options import add_serve_options


def add_serve_command(p: argparse.ArgumentParser) -> None:
    """Every option of ``serve``: the run's, the protocol, and the network endpoint's."""
    add_serve_options(p)
    p.add_argument("--protocol", choices=["timing", "long-tail"], default="timing",
                   help="timing: 1 warm-up + measured sessions; long-tail: 1 warm-up + 250 sessions (unless --sessions) "
                        "and the slowest samples broken down by stage")
    p.add_argument("--overwrite", action="store_true", help="clear an existing run directory at --out first")
    add_listen_options(p)


def add_listen_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("network endpoint")
    g.add_argument("--listen", metavar="HOST:PORT", help="serve clients over WebSocket (ws://HOST:PORT/session); "
                   "loopback only unless --allow-remote; --sessions then caps the sessions served")
    g.add_argument("--allow-remote", action="store_true", help="allow --listen on a non-loopback address")
    g.add_argument("--window", type=int, help="chunks sent to a client and not yet acknowledged (default 2)")
    g.add_argument("--action-timeout", type=float, help="seconds to wait for a chunk's actions before cancelling (default 10)")
    g.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="accept WebSocket requests from this Origin too (repeatable; '*' skips the Origin/Host check)")
    g.add_argument("--idle-timeout", type=float, help="seconds a connection may stay silent without a session (default 30)")
    g.add_argument("--warmup-chunks", type=int, help="chunks generated before 'listening' (default: a whole session "
                   "in compiled mode, 1 on CUDA, 0 on CPU)")
    g.add_argument("--api", choices=["harness", "vllm-omni"], default="harness",
                   help="harness: the harness's own protocol (ws://HOST:PORT/session); vllm-omni: vLLM-Omni's realtime "
                        "video API (ws://HOST:PORT/v1/realtime/video, lossless fragmented MP4, production's messages)")
    g.add_argument("--start-timeout", type=float, help="--api vllm-omni: seconds to wait for session.start (default 10, production's)")
    g.add_argument("--stall-timeout", type=float, help="--api vllm-omni: seconds without progress or ping before a "
                   "session is stopped (default 60, production's)")
    g.add_argument("--served-model-name", help="--api vllm-omni: refuse a session.start naming another model "
                   "(default: accept any, as vLLM-Omni without a served name)")
    g.add_argument("--image-reference", choices=["refuse", "ignore"], default="refuse",
                   help="--api vllm-omni: a session.start with image_reference is refused (default) or accepted and "
                        "ignored (sessions are conditioned on their seed's synthetic image; manifest and video.start say so)")
    g.add_argument("--replicas", type=int, help="engine groups (DiT, VAE and encoder processes each) serving one "
                   "session each; a session stays on its replica (default 1)")
    g.add_argument("--replica-gpus", nargs="+", metavar="GPUS", help="CUDA: each replica's GPUs, one comma list per "
                   "replica (e.g. 0,1 2,3); on the CPU every replica shares the CPU")
    g.add_argument("--queue", type=int, help="sessions that may wait for a free replica, in arrival order (default 4)")
    g.add_argument("--queue-timeout", type=float, help="seconds a session may wait in the queue before busy (default 60)")
    g.add_argument("--session-cap", type=float, help="seconds a session may run, wall clock, before it is cancelled "
                   "(default 120 + 10 per chunk requested)")
    g.add_argument("--max-peer-connections", type=int, help="WebSocket connections one remote address may hold (default 4)")
    g.add_argument("--fault", action="append", default=[], help=argparse.SUPPRESS)  # ROLE:RANK=die-at-chunk:N (scenarios)


def add_client_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect", required=True, metavar="HOST:PORT", help="the server of serve --listen (or a ws:// URL)")
    p.add_argument("--api", choices=["harness", "vllm-omni"], default="harness",
                   help="harness: the harness's own protocol; vllm-omni: any server of vLLM-Omni's realtime video API "
                        "(ws://HOST:PORT/v1/realtime/video), measured into a run directory at --out")
    p.add_argument("--sessions", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="session i uses seed + i")
    p.add_argument("--preset", help="must match the server's (default: ask the server)")
    p.add_argument("--chunks", type=int, help="chunks per session (default: the server's preset)")
    p.add_argument("--prompt", default="")
    p.add_argument("--read-rate", type=float, help="consume at this fraction of the nominal frame rate (slow consumer)")
    p.add_argument("--prebuffer-frames", type=int, help="frames buffered before playback starts (default: the first chunk)")
    p.add_argument("--disconnect-after-chunk", type=int, metavar="K", help="drop the connection once chunk K was read")
    p.add_argument("--cancel-after-chunk", type=int, metavar="K", help="cancel once chunk K was read")
    p.add_argument("--player", metavar="TRACE", help="a player session: send the key events of TRACE at their own times "
                   "(a JSON-lines or .csv file of t,keys events, or hold-and-turn, taps, random:SEED) and report "
                   "action-to-photon; default: the scripted actions the server asks for")
    p.add_argument("--out", help="write session{S}.mkv and client.json here")
    p.add_argument("--verify", action="store_true", help="decode each finished file and check every frame's SHA-256")
    p.add_argument("--busy-wait", type=float, default=60.0, help="seconds to retry while the server is busy")
    g = p.add_argument_group("--api vllm-omni")
    g.add_argument("--width", type=int, help="session.start width (default: the server's)")
    g.add_argument("--height", type=int, help="session.start height (default: the server's)")
    g.add_argument("--model", help="session.start model (default: none, the server's)")
    g.add_argument("--image", metavar="FILE", help="the first frame's image, sent as image_reference (a data URL)")
    g.add_argument("--ping", type=float, default=5.0, help="seconds between session.ping keep-alives")
    g.add_argument("--interaction-every", type=int, metavar="K",
                   help="after every K-th chunk send a session.interaction (camera keys of the scripted trajectory)")
    g.add_argument("--interaction-prompt", default="", help="the first interaction also carries this prompt")
    g.add_argument("--overwrite", action="store_true", help="clear an existing run directory at --out first")


def add_compare_servers_arguments(p: argparse.ArgumentParser) -> None:
    """``compare-servers``: the client's options (``--api vllm-omni``'s) for both arms, and arm B."""
    add_client_arguments(p)
    p.add_argument("--connect-b", required=True, metavar="HOST:PORT", help="arm B's server (arm A: --connect)")
    p.add_argument("--rounds", type=int, default=2, help="launches per arm, alternating A B A B … (default 2)")
    p.add_argument("--no-gate", action="store_true", help="judge speed even when the arms' pixels differ (say so)")
