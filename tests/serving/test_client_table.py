"""The viewer's session table: every column a figure of the one table (its definition printed under
it), and the server's warm-up session named as such."""

from __future__ import annotations

from harness.measure import figures as F
from harness.serving import client as C
from harness.serving import protocol as W


def _report(session: int, epoch: int) -> C.SessionReport:
    st = W.Started(session=session, epoch=epoch, seed=session, preset="tiny", chunks=3, latent_frames_per_chunk=3, fps=16,
                   width=64, height=64, window=18, action_timeout_s=30.0)
    return C.SessionReport(seed=session, chunks=3, outcome="complete", session=session, started=st, t_start_ns=0,
                           t_first_media_ns=5_000_000, receipts_ns=[5_000_000, 1_005_000_000],
                           play=C.PlayStats(21, 9, 5.0, 1, 12.5, 1300.0, 0.99))


def test_every_column_is_a_figure_defined_under_the_table_and_the_warm_up_is_named():
    lines = C.table([_report(0, 0), _report(1, 1)])
    heads = [F.label(n) for n in C.TABLE_COLUMNS]
    assert lines[0].split() == " ".join(heads).split()
    for name in C.TABLE_COLUMNS:
        assert F.resolve(F.label(name)).name == name  # one figure per printed label
    for name in C.TABLE_COLUMNS[1:]:
        assert f"  {F.label(name)}: {F.define(name).formula}" in lines
    rows = {l.split()[0]: l for l in lines[1:3]}
    assert "0 warm-up" in rows["0"] and "warm-up" not in rows["1"] and "99.0 %" in rows["0"]
    assert "  session 0 was the server's warm-up (epoch 0): served like any other, never counted in the server's summary" in lines


def test_a_client_whose_first_session_is_not_the_servers_warm_up_says_nothing_of_one():
    lines = C.table([_report(3, 3)])
    assert not any("warm-up" in l for l in lines if not l.startswith("  epoch:"))
