"""A test module's ``check(device, bound)`` run through the Triton interpreter on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch


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


def steps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements of a (a kernel's) and b (the module ops') that differ, after checking that none is
    further than the kernel's float32 error can move it: a few float32 steps of the row's
    largest value, plus, in bf16, one bf16 step of the value itself."""
    x, y = a.double(), b.double()
    bound = 1e-6 * y.abs().amax(dim=-1, keepdim=True) + (2.0 ** -7 * y.abs() if a.dtype == torch.bfloat16 else 0)
    err = (x - y).abs()
    assert bool((err <= bound).all()), f"{int((err > bound).sum())} elements off by up to {float(err.max()):.3g}"
    return int((a != b).sum())
