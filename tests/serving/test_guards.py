"""The WebSocket server's guards as pure functions: the Host/Origin rule (DNS rebinding, foreign
pages), the operator token's comparison, the mask bit of every client frame."""

import os
from types import SimpleNamespace as NS

import pytest

from harness.config import load_preset
from harness.errors import HarnessError
from harness.serving.guards import (DEFAULT_IDLE_TIMEOUT_S, FrameBoundaries, hardening_options, origin_error,
                                    token_matches, warm_up)


def test_origin_rules():
    listen = ("127.0.0.1", 8000)
    assert origin_error("127.0.0.1:8000", None, listen, ()) is None
    assert origin_error("localhost:8000", "http://localhost:8000", listen, ()) is None
    assert "Host" in origin_error("127.0.0.1:8001", None, listen, ())  # another port: a rebound name
    assert "Origin" in origin_error("127.0.0.1:8000", "https://a.example", listen, ())
    assert origin_error("127.0.0.1:8000", "https://a.example", listen, ("https://a.example",)) is None
    assert origin_error("proxy.example", "https://b.example", listen, ("*",)) is None
    assert origin_error("anything:9000", None, ("0.0.0.0", 9000), ()) is None


def test_an_origin_must_be_http_or_https_of_this_address():
    listen = ("127.0.0.1", 8000)
    for origin in ("ftp://127.0.0.1:8000", "ws://127.0.0.1:8000", "file://127.0.0.1:8000", "127.0.0.1:8000",
                   "null"):
        assert "Origin" in origin_error("127.0.0.1:8000", origin, listen, ()), origin
    assert origin_error("127.0.0.1:8000", "https://127.0.0.1:8000/", listen, ()) is None


def test_idle_timeout_zero_is_refused_not_taken_for_the_default():
    cfg = load_preset("tiny")
    for bad in (0, 0.0, -1, 3601):
        with pytest.raises(HarnessError, match=r"--idle-timeout must be in \(0, 3600\] s"):
            hardening_options(NS(idle_timeout=bad, warmup_chunks=None, allow_origin=None), cfg)
    assert hardening_options(NS(idle_timeout=None, warmup_chunks=None, allow_origin=None), cfg)["idle_timeout_s"] == \
        DEFAULT_IDLE_TIMEOUT_S
    assert hardening_options(NS(idle_timeout=0.5, warmup_chunks=None, allow_origin=None), cfg)["idle_timeout_s"] == 0.5


def test_warm_up_restores_the_chunk_callback_even_when_the_session_fails():
    seen = []

    class Driver:
        on_chunk = staticmethod(lambda *a: None)

        def run_session(self, **kw):
            seen.append((self.on_chunk, kw))  # nobody receives warm-up chunks
            if kw["chunks"] == 2:
                raise RuntimeError("rank died in the warm-up")

    d = Driver()
    original = d.on_chunk
    warm_up(NS(driver=d), 1)
    assert d.on_chunk is original and seen[0] == (None, {"session": 0, "epoch": -1, "seed": 0, "chunks": 1})
    with pytest.raises(RuntimeError):
        warm_up(NS(driver=d), 2)
    assert d.on_chunk is original


def test_tokens_compare_as_bytes_whatever_the_characters():
    assert token_matches("ab12", "ab12") and not token_matches("ab13", "ab12")
    assert not token_matches("é" * 4, "ab12") and not token_matches("", "ab12")  # no TypeError for non-ASCII
    assert token_matches("clé", "clé")


def _frame(payload: bytes, masked: bool = True) -> bytes:
    n = len(payload)
    size = bytes([n]) if n < 126 else bytes([126]) + n.to_bytes(2, "big") if n < 65536 else bytes([127]) + n.to_bytes(8, "big")
    return bytes([0x82, size[0] | (0x80 if masked else 0)]) + size[1:] + (os.urandom(4) if masked else b"") + payload


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 13, 1000, 1 << 20])
def test_the_first_unmasked_frame_is_found_however_the_stream_is_cut(piece):
    """Frames of each length encoding (7-bit, 16-bit, 64-bit), then an unmasked one."""
    good = _frame(b"a" * 10) + _frame(b"b" * 300) + _frame(b"c" * 70_000)
    stream = good + _frame(b"x", masked=False) + _frame(b"y")
    scan, found = FrameBoundaries(), None
    for i in range(0, len(stream), piece):
        at = scan.unmasked_at(stream[i:i + piece])
        if at is not None:
            found = i + at
            break
    assert found == max(len(good), i)  # its first byte, or the piece its header ran into
    scan = FrameBoundaries()
    assert [scan.unmasked_at(good[i:i + piece]) for i in range(0, len(good), piece)] == [None] * len(range(0, len(good), piece))
