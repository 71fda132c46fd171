"""Torch's intra-op threads, limited for the tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_thread() -> Iterator[None]:
    """The tiny preset's ops are far too small to split (the convs take ATen's single-threaded slow
    path anyway); a second thread on a shared 2-core box only adds contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
