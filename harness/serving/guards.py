"""The network endpoint's guards against hostile or broken peers (serve --listen).

Who may connect (Origin/Host against the listen address), the operator token that may read any
session's outcome, the warm-up before the port opens, and the options that set them. The server
(serving/server.py) applies them; README "Limits, and what the server promises" states the bounds.
"""

from __future__ import annotations

import ipaddress
import os

from harness.errors import HarnessError
from harness.limits import max_chunks

#: seconds a connection may stay silent without a running session
DEFAULT_IDLE_TIMEOUT_S = 30.0


def origin_error(host: str | None, origin: str | None, listen: tuple[str, int] | None,
                 allowed: tuple[str, ...]) -> str | None:
    """Why a WebSocket request is refused (a web page's Origin, a rebound Host name), or None.

    Host must name the listen address (any loopback name when it is a loopback address; any name
    on a wildcard bind) with its port; an Origin, when the client sends one (browsers do, other
    clients do not), must be ``http(s)://`` that same address or one of ``allowed``."""
    if "*" in allowed or listen is None:
        return None
    lhost, lport = listen
    loop_names = {"127.0.0.1", "localhost", "::1", "[::1]"}
    try:
        wildcard = ipaddress.ip_address(lhost).is_unspecified
        names = loop_names if ipaddress.ip_address(lhost).is_loopback else {lhost, f"[{lhost}]"}
    except ValueError:
        wildcard, names = False, loop_names if lhost == "localhost" else {lhost}

    def matches(hostport: str) -> bool:
        name, sep, port = hostport.rpartition(":")
        if not sep or not port.isdigit() or int(port) != lport:
            return False
        return wildcard or name.lower() in names

    if not host or not matches(host):
        return f"Host {host!r} is not this server's address ({lhost}:{lport}); add --allow-origin '*' behind a proxy"
    if origin is not None and origin not in allowed:
        scheme, sep, rest = origin.partition("://")
        if scheme not in ("http", "https") or not sep or not matches(rest.rstrip("/")):
            return f"Origin {origin!r} is not allowed (add --allow-origin {origin} to let that page in)"
    return None


def write_token(path, token: str) -> None:
    """Readable by the server's user only: whoever can read it may read any session's outcome."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")


def warm_up(ctx, chunks: int) -> None:
    """Generate ``chunks`` chunks nobody receives before the port opens, so the first client gets
    steady-state speed (compiled mode compiles and records graphs in its first chunks). Nothing is
    written to the run directory and nothing is saved: the epoch is outside every saved epoch."""
    original = ctx.driver.on_chunk
    ctx.driver.on_chunk = None
    try:
        ctx.driver.run_session(session=0, epoch=-1, seed=0, chunks=chunks)
    finally:
        ctx.driver.on_chunk = original


def hardening_options(args, cfg) -> dict:
    """ListenOptions fields from --allow-origin, --idle-timeout and --warmup-chunks (checked here)."""
    idle = getattr(args, "idle_timeout", None)
    if idle is not None and not 0 < idle <= 3600:
        raise HarnessError(f"--idle-timeout must be in (0, 3600] s, got {idle}")
    warm = getattr(args, "warmup_chunks", None)
    if warm is None:
        warm = cfg.video.chunks_per_session if cfg.runtime.mode == "compiled" else int(cfg.runtime.device == "cuda")
    if not 0 <= warm <= max_chunks(cfg.video.frames_per_chunk):
        raise HarnessError(f"--warmup-chunks must be in 0-{max_chunks(cfg.video.frames_per_chunk)}, got {warm}")
    return {"allow_origins": tuple(getattr(args, "allow_origin", None) or ()), "warmup_chunks": warm,
            "idle_timeout_s": idle or DEFAULT_IDLE_TIMEOUT_S}
