"""`scenario cancel --points list` prints the points of the transport it would run."""

from harness.cli import main
from harness.experiments.scenario.points import cancel_points, ws_cancel_points


def _listed(capsys, *extra):
    assert main(["scenario", "cancel", "--points", "list", *extra]) == 0
    return [line.split()[0] for line in capsys.readouterr().out.splitlines()]


def test_points_list_follows_the_transport(capsys):
    inproc = _listed(capsys)
    ws = _listed(capsys, "--over", "websocket")
    assert inproc == [p.name for p in cancel_points(1, 1, 3)]
    assert ws == [p.name for p in ws_cancel_points(1.0, 3)]
    assert "keep-partial-media" in inproc and "disconnect-mid-media" in ws
