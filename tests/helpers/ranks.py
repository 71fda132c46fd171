"""What an SP test asserts of its ranks' outputs (each rank: one bytes string of float32 per chunk)."""

from __future__ import annotations

import numpy as np


def assert_ranks_match(ranks: list[list[bytes]], same_as: list[bytes], one_rank: list[bytes], tol: float) -> None:
    """Every rank returned ``same_as`` byte for byte, and each chunk is within relative L2 ``tol``
    of ``one_rank``'s (SP reorders sums: the rounding moves, the values stay)."""
    for r in ranks:
        assert r == same_as
    for a, b in zip(same_as, one_rank):
        x, y = np.frombuffer(a, np.float32), np.frombuffer(b, np.float32)
        assert np.linalg.norm(x - y) / np.linalg.norm(y) <= tol
