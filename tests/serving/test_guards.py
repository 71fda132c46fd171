"""The WebSocket server's Host/Origin rule (DNS rebinding, foreign pages), as a pure function."""

from types import SimpleNamespace as NS

import pytest

from harness.config import load_preset
from harness.errors import HarnessError
from harness.serving.guards import DEFAULT_IDLE_TIMEOUT_S, hardening_options, origin_error, warm_up


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
