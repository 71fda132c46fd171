"""A test module's ``check(device, bound)`` run through the Triton interpreter on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def check_in_interpreter(test_file: str, bound: float) -> None:
    """Runs ``check("cpu", bound)`` of the module at ``test_file`` in a fresh process with
    ``TRITON_INTERPRET=1``: Triton reads it when a kernel is defined, so not in this process."""
    folder, module = os.path.split(os.path.abspath(test_file))
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {folder!r})
        from {module.removesuffix('.py')} import check
        check("cpu", bound={bound!r})
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
