"""The non-dominated points of a sweep: higher is better on one axis, lower on the other."""

from __future__ import annotations

from typing import Sequence


def pareto_front(points: Sequence[tuple[float | None, float | None]]) -> list[int]:
    """Indices of the points (cost, value) that no other point dominates — lower cost, higher
    value: q dominates p when q's cost ≤ p's and q's value ≥ p's, one of them strictly. A point
    missing either coordinate is never on the front (it cannot be compared)."""
    ok = [i for i, (c, v) in enumerate(points) if c is not None and v is not None]
    front = []
    for i in ok:
        ci, vi = points[i]
        if not any(points[j][0] <= ci and points[j][1] >= vi and (points[j][0] < ci or points[j][1] > vi)
                   for j in ok if j != i):
            front.append(i)
    return front
