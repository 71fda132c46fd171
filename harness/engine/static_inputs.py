"""Persistent, static-address homes for the values the compiled blocks read that the host side
makes afresh (H1g): the chunk's RoPE table, each forward's timestep modulation, the camera tokens.

Under CUDA graphs, a graph input that is neither a parameter, a static address nor an output of an
earlier graph of the tree is copied into the graph's own buffer at every replay — once per graph
that reads it, so a table made once per chunk is copied by each of a chunk's 200 block graphs
(``graph_inputs`` names such copies). Handed on through one of these buffers instead, it is copied
once, where it is made, and every graph reads it in place.

A buffer holds one value at a time. That is safe in stream order because each value is held before
the forwards that read it are launched and is not held again until they are: the RoPE table once
per chunk, before its denoise passes (a deferred commit, H5b, runs at the engine's next call,
before that call holds its own chunk's table); the modulation and camera tokens at the start of
every forward.
"""

from __future__ import annotations

import torch
from torch import Tensor


class StaticInputs:
    """One persistent tensor per (name, shape, dtype, device), marked a static address."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, Tensor] = {}

    def hold(self, name: str, value: Tensor) -> Tensor:
        """``value`` copied into the name's buffer, which is returned (contiguous, its shape)."""
        key = (name, tuple(value.shape), value.dtype, value.device)
        buf = self._buffers.get(key)
        if buf is None:
            from torch._dynamo import mark_static_address  # dynamo only where buffers are used

            buf = self._buffers[key] = torch.empty(value.shape, dtype=value.dtype, device=value.device)
            mark_static_address(buf)
        return buf.copy_(value)

    def __len__(self) -> int:
        return len(self._buffers)
