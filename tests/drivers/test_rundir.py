"""The manifest records the command as one would type it again, never this checkout's path."""

from harness.drivers.rundir import command_line


def test_the_command_is_recorded_as_python_m_harness():
    argv = ["/some/checkout/harness/__main__.py", "serve", "--preset", "tiny", "--out", "runs/x"]
    assert command_line(argv) == ["python", "-m", "harness", "serve", "--preset", "tiny", "--out", "runs/x"]


def test_other_entry_points_keep_only_their_name():
    assert command_line(["/opt/venv/bin/pytest", "-q", "tests"]) == ["pytest", "-q", "tests"]
    assert command_line([]) == []
