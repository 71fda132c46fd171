"""The network endpoint's guards against hostile or broken peers (serve --listen).

Who may connect (Origin/Host against the listen address), the operator token that may read any
session's outcome, the warm-up before the port opens, and the options that set them. The server
(serving/server.py) applies them; README "Limits, and what the server promises" states the bounds.
"""

from __future__ import annotations

import hmac
import ipaddress
import os

from aiohttp import WSCloseCode, web, web_protocol
from aiohttp.http_websocket import WebSocketError

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


def refusal(request, listen: tuple[str, int] | None, allowed: tuple[str, ...]) -> "web.Response | None":
    """403 for a request from a foreign page or through a rebound Host name (``origin_error``), or None."""
    why = origin_error(request.headers.get("Host"), request.headers.get("Origin"), listen, allowed)
    return None if why is None else web.Response(status=403, text=why + "\n")


def token_matches(given: str, expected: str) -> bool:
    """Constant-time, on bytes: ``compare_digest`` refuses str with non-ASCII characters (a
    TypeError that used to drop the connection without a close frame)."""
    return hmac.compare_digest(given.encode(), expected.encode())


class FrameBoundaries:
    """Where each client frame begins in a byte stream fed in pieces: only headers (2–14 bytes)
    are read, payloads are skipped, so the cost is per frame, not per byte."""

    def __init__(self) -> None:
        self.head = b""  # a header begun in an earlier piece
        self.skip = 0  # payload bytes still to pass over

    def unmasked_at(self, data: bytes) -> int | None:
        """Offset in ``data`` where a frame without the mask bit begins (0 when its header began
        in an earlier piece), or None."""
        i, n = 0, len(data)
        while i < n:
            if self.skip:
                step = min(self.skip, n - i)
                self.skip -= step
                i += step
                continue
            carried = len(self.head)
            head = self.head + data[i:i + 14]
            if len(head) >= 2 and not head[1] & 0x80:
                return max(i - carried, 0)
            size = _header_size(head)
            if size is None:  # the header continues in the next piece
                self.head = head
                return None
            ln = head[1] & 0x7F
            self.skip = int.from_bytes(head[2:4 if ln == 126 else 10], "big") if ln >= 126 else ln
            self.head = b""
            i += size - carried
        return None


def _header_size(head: bytes) -> int | None:
    """Bytes of a (masked) frame header that begins ``head``, or None until enough of it is there."""
    if len(head) < 2:
        return None
    ln = head[1] & 0x7F
    size = 2 + (2 if ln == 126 else 8 if ln == 127 else 0) + 4
    return size if len(head) >= size else None


class _MaskCheck:
    """The connection's frame parser behind a check of each frame's mask bit (RFC 6455 §5.1: a
    server must close the connection on an unmasked client frame; aiohttp's reader accepts them)."""

    def __init__(self, parser, queue) -> None:
        self.parser, self.queue = parser, queue
        self.frames = FrameBoundaries()
        self.refused = False

    def feed_data(self, data) -> tuple[bool, bytes]:
        if self.refused:
            return True, b""
        at = self.frames.unmasked_at(bytes(data))
        if at is None:
            return self.parser.feed_data(data)
        if at:
            self.parser.feed_data(data[:at])  # the whole frames before it are the client's
        self.refused = True
        self.queue.set_exception(WebSocketError(WSCloseCode.PROTOCOL_ERROR,
                                                "unmasked frame from the client (RFC 6455 §5.1)"))
        return True, b""

    def feed_eof(self) -> None:
        self.parser.feed_eof()


#: what MaskedFramesOnly needs of aiohttp's request handler: checked at import, so an aiohttp that
#: renamed them fails loudly instead of accepting unmasked frames again
if not all(hasattr(web_protocol.RequestHandler, a) for a in ("_payload_parser", "_message_tail", "data_received")):
    raise ImportError("this aiohttp's request handler has no _payload_parser/_message_tail: MaskedFramesOnly needs updating")


class MaskedFramesOnly(web.WebSocketResponse):
    """A server WebSocket that closes the connection (1002) on an unmasked client frame.

    aiohttp exposes no option for it, so the check sits in front of the frame parser aiohttp
    installs after the handshake; bytes that arrived with the handshake go through it too."""

    def _post_start(self, request, protocol, writer) -> None:
        handler = request.protocol
        tail, handler._message_tail = handler._message_tail, b""
        super()._post_start(request, protocol, writer)
        handler._payload_parser = _MaskCheck(handler._payload_parser, self._reader)
        if tail:
            handler.data_received(tail)


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
