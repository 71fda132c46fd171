"""H4a: the fused Triton conversion is byte-exact with ``convert.to_uint8`` — on crafted edge
values (every rounding boundary k + ½ and its float neighbours, ±0, NaN, ±inf, out of range,
subnormals), random data in float32/bf16/fp16, non-contiguous input and a real 12-frame 480×832
chunk. On CUDA with Triton; without a GPU, through the Triton interpreter when Triton is
importable (it is not a dependency, so CI skips both)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed (optional; the GPU machine has it)")

from harness.engine.convert import to_uint8 as reference  # noqa: E402


def edge_values() -> torch.Tensor:
    s = 1 / 127.5
    base = torch.tensor([-1.0, 1.0, 0.0, -0.0, 0.5 * s, -0.5 * s, 1.5 * s - 1, 0.5 * s - 1, 1 - 0.5 * s, 1 - 1.5 * s,
                         float("nan"), float("inf"), float("-inf"), 2.0, -2.0, 1e30, -1e30, 3.4e38, 1e-40, -1e-40])
    k = torch.arange(0, 256, dtype=torch.float32)
    mid = (k + 0.5) / 127.5 - 1.0  # inputs whose y lands on (or next to) a .5 boundary
    up, down = torch.nextafter(mid, torch.tensor(2.0)), torch.nextafter(mid, torch.tensor(-2.0))
    return torch.cat([base, mid, up, down, k / 127.5 - 1.0])


def as_frames(v: torch.Tensor) -> torch.Tensor:
    v = torch.cat([v, v.new_zeros((-v.numel()) % 3)])
    return v.view(3, 1, 1, -1)


def check(device: str) -> None:
    from harness.engine.fused_convert import to_uint8 as fused

    g = torch.Generator().manual_seed(0)
    cases = {"edges": as_frames(edge_values())}
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        cases[f"random {dt}"] = (torch.randn(3, 2, 16, 24, generator=g) * 0.8).to(dt)
    cases["non-contiguous"] = torch.randn(3, 3, 5, 7, generator=g).transpose(2, 3)
    cases["empty"] = torch.empty(3, 0, 4, 4)
    if device == "cuda":
        cases["12x480x832"] = torch.rand(3, 12, 480, 832, generator=g) * 2.2 - 1.1
    for name, x in cases.items():
        x = x.to(device)
        a, b = reference(x), fused(x)
        assert b.dtype == torch.uint8 and b.shape == a.shape and b.is_contiguous(), name
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} bytes differ"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_conversion_is_byte_exact_on_cuda():
    check("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test covers it")
def test_fused_conversion_is_byte_exact_in_the_interpreter():
    # TRITON_INTERPRET is read when a kernel is defined, so the check runs in a fresh process
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_h4a_fused_output import check
        check("cpu")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
