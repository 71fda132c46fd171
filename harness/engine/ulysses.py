"""Ulysses sequence parallelism over a ``RankGroup``.

Tokens of a chunk (flattened frame, h, w order) are sharded over the group in contiguous slices.
Around attention one all-to-all turns (local tokens, all heads) into (all tokens, local heads) and
one turns it back; everything else in a block is per-token and runs on the local slice. With a
group of one every function is the identity and no collective is issued.

Head layout: rank r owns heads [r·H/sp, (r+1)·H/sp); token layout: rank r owns tokens
[r·N/sp, (r+1)·N/sp). ``all_to_all_single`` splits its input along dim 0 by destination rank and
stacks its output along dim 0 by source rank, so both directions are a reshape, one (permuting)
copy into a contiguous send buffer and the collective.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from harness.engine.groups import RankGroup


def token_range(n_tokens: int, group: RankGroup) -> tuple[int, int]:
    n = n_tokens // group.size
    return group.rank * n, (group.rank + 1) * n


def seq_to_heads(xs: Sequence[Tensor], group: RankGroup) -> list[Tensor]:
    """Each (n_local, H, D) of ``xs`` (q, k, v) → (N, H/sp, D), all through one collective. Each
    tensor is copied once, straight into its place in the send buffer (no stack, then permute)."""
    if not group.active:
        return list(xs)
    n, h, d = xs[0].shape
    sp, kk = group.size, len(xs)
    send = xs[0].new_empty(sp, n, kk, h // sp, d)
    for i, x in enumerate(xs):
        send[:, :, i].copy_(x.view(n, sp, h // sp, d).transpose(0, 1))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group.group)
    return list(recv.view(sp * n, kk, h // sp, d).unbind(1))


def heads_to_seq(x: Tensor, group: RankGroup) -> Tensor:
    """(N, H/sp, D) → (n_local, H, D)."""
    if not group.active:
        return x
    nn_, hl, d = x.shape
    sp = group.size
    send = x.contiguous().view(sp, nn_ // sp, hl, d)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group.group)
    return recv.permute(1, 0, 2, 3).reshape(nn_ // sp, sp * hl, d)


def gather_tokens(x: Tensor, group: RankGroup) -> Tensor:
    """(n_local, C) on every rank → (N, C) on every rank, in token order."""
    if not group.active:
        return x
    out = x.new_empty(x.shape[0] * group.size, *x.shape[1:])
    _all_gather(out, x.contiguous(), group=group.group)
    return out


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; pyproject allows ≥ 2.4.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
