"""The command line itself: parsing is cheap, the commands' modules load when they run."""

import subprocess
import sys


def test_help_imports_no_command_module_that_needs_torch():
    """Parsing (and refusing a bad option) must not wait for torch: commands are imported when they run."""
    code = "import sys; from harness.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
