"""The reference float → uint8 conversion: exact values, rounding rule, NaN, layout."""

from __future__ import annotations

import math

import pytest
import torch

from harness.engine.convert import to_uint8


def _u8(values):
    x = torch.tensor(values, dtype=torch.float32).view(1, 1, 1, -1).expand(3, 1, 1, -1)
    return to_uint8(x)[0, 0, :, 0].tolist()


def test_exact_values_and_rounding():
    assert _u8([-1.0, 1.0, 0.0]) == [0, 255, 128]  # 127.5 rounds half to even → 128
    # float32 inputs whose (x+1)*127.5 is exactly k + 0.5: half-to-even picks the even neighbour
    halves = {}
    for k in range(100, 255):
        lo = hi = torch.tensor((k + 0.5) / 127.5 - 1.0, dtype=torch.float32)
        for _ in range(8):
            for x in (lo, hi):
                if ((x + 1.0) * 127.5).item() == k + 0.5:
                    halves.setdefault(k, x.item())
            lo, hi = torch.nextafter(lo, torch.tensor(-2.0)), torch.nextafter(hi, torch.tensor(2.0))
    assert {127, 253, 254} <= halves.keys()
    assert _u8(list(halves.values())) == [k + (k % 2) for k in halves]
    assert _u8([-1.0 + 1 / 127.5, 1.0 - 1 / 127.5]) == [1, 254]


def test_clamp_and_nan():
    assert _u8([-3.0, 2.0, -math.inf, math.inf, math.nan]) == [0, 255, 0, 255, 0]


def test_layout_and_dtype():
    t, h, w = 2, 3, 5
    x = torch.empty(3, t, h, w)
    x[0], x[1], x[2] = -1.0, 0.0, 1.0  # R, G, B planes
    x[:, 1, 2, 4] = torch.tensor([1.0, 1.0, -1.0])
    y = to_uint8(x)
    assert y.shape == (t, h, w, 3) and y.dtype == torch.uint8 and y.is_contiguous()
    assert y[0, 0, 0].tolist() == [0, 128, 255]
    assert y[1, 2, 4].tolist() == [255, 255, 0]
    assert to_uint8(x.bfloat16()).equal(y)
    with pytest.raises(ValueError):
        to_uint8(torch.zeros(t, h, w, 3))
