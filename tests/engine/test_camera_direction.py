"""The ground-plane direction of the camera's motion: the length is divided by n + 1e-6, so a
vanishing motion stays finite — visible at small lengths, where a relative tolerance sees it."""

from __future__ import annotations

import numpy as np
import pytest

from harness.engine import camera


@pytest.mark.parametrize("length", [1e-6, 1e-5, 1.0])
def test_the_direction_is_scaled_to_almost_unit_length(length):
    g = camera._ground(np.array([0.6 * length, 5.0, 0.8 * length]))
    assert g[1] == 0.0
    assert np.linalg.norm(g) == pytest.approx(length / (length + camera.DIRECTION_EPS), rel=1e-12)
    assert camera._ground(np.array([0.0, 1.0, 0.0])).tolist() == [0.0, 0.0, 0.0]
