"""The command line itself: parsing is cheap, the commands' modules load when they run."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("code", [
    # parsing (and refusing a bad option) must not wait for torch: commands are imported when they run
    "from harness.cli import build_parser; build_parser()",
    # the viewer runs on machines without the model: it needs the protocol, not the server's stack
    "import harness.serving.client",
])
def test_no_torch_where_none_is_needed(code):
    probe = f"import sys; {code}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
