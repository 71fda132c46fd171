"""One WebSocket session on the server side (``StreamSession``), without a socket: what an
acknowledgement counts for, and a connection that fails inside the session's own code."""

from harness.serving import protocol as W
from harness.serving.server import StreamSession


def test_an_ack_counts_only_for_media_that_left_the_server():
    """A client acknowledging chunks it has not read (blind acks) gets no credit: the window bounds
    the bytes in flight, since only media the transport took can be acknowledged."""

    class Conn:
        open, written = True, set()

        def post(self, item) -> None:
            pass

    conn = Conn()
    sess = StreamSession(conn, W.Start(preset="tiny", seed=0), chunks=3, frames_per_chunk=3, window=1,
                    action_timeout_s=1.0, stall_timeout_s=1.0)
    sess.sent.append(0)  # posted to the connection's queue, not yet written to the socket
    assert "before its media left the server" in sess.ack(W.Ack(chunk=0, received_ns=1))
    assert "which was not sent" in sess.ack(W.Ack(chunk=1, received_ns=1))
    conn.written.add(0)
    assert sess.ack(W.Ack(chunk=0, received_ns=1)) is None and 0 in sess.acks


def test_a_failure_in_a_sessions_own_code_cancels_that_session_only():
    """A session whose connection raises while the driver forwards its media (or asks its actions)
    records the reason and asks to be cancelled (``should_cancel``, the driver's ordinary cancel
    path); nothing raises into the driver's callbacks."""

    class BrokenConn:
        open, written = True, set()

        def post(self, item) -> None:
            raise RuntimeError("socket exploded")

    sess = StreamSession(BrokenConn(), W.Start(preset="tiny", seed=0), chunks=3, frames_per_chunk=3, window=1,
                    action_timeout_s=1.0, stall_timeout_s=1.0)
    assert sess.actions_for(0) == [""] * 3
    assert sess.reason == "session failed: RuntimeError: socket exploded" and sess.should_cancel(0, [])

    class Msg:
        encoded, media, pixel_sha256, frame_sha256 = 1, b"x", "", []

    class Ev:
        session, chunk, frames, blocked_ns = 0, 0, 9, {}

    sess2 = StreamSession(BrokenConn(), W.Start(preset="tiny", seed=0), chunks=3, frames_per_chunk=3, window=1,
                     action_timeout_s=1.0, stall_timeout_s=1.0)
    sess2.on_chunk(Ev(), Msg())  # must not raise
    assert sess2.reason.startswith("session failed:") and 0 in sess2.events
