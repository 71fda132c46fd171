"""The WebSocket server's Host/Origin rule (DNS rebinding, foreign pages), as a pure function."""

from harness.serving.guards import origin_error


def test_origin_rules():
    listen = ("127.0.0.1", 8000)
    assert origin_error("127.0.0.1:8000", None, listen, ()) is None
    assert origin_error("localhost:8000", "http://localhost:8000", listen, ()) is None
    assert "Host" in origin_error("127.0.0.1:8001", None, listen, ())  # another port: a rebound name
    assert "Origin" in origin_error("127.0.0.1:8000", "https://a.example", listen, ())
    assert origin_error("127.0.0.1:8000", "https://a.example", listen, ("https://a.example",)) is None
    assert origin_error("proxy.example", "https://b.example", listen, ("*",)) is None
    assert origin_error("anything:9000", None, ("0.0.0.0", 9000), ()) is None
