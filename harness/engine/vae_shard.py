"""Width sharding of the VAE decoder over a RankGroup: halo exchange, key/value gather, final gather.

Rank r of M owns columns [r·w/M, (r+1)·w/M) at every resolution (the decoder only doubles widths,
so strips stay aligned). Before every convolution with a spatial kernel, ranks swap their edge
columns with their neighbours only — point-to-point through ``batch_isend_irecv``, which NCCL
coalesces into one launch and gloo runs as plain isend/irecv — and zero padding is applied only
at the global left and right edges. Upsampling is local (nearest ×2 of a strip is the strip of
the upsampled frame); its halo is swapped after upsampling, at the resolution the conv runs at.
The attention block all-gathers keys and values over the width and keeps its queries local.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness.engine.groups import RankGroup
from harness.engine.vae import WidthOps


class WidthShard(WidthOps):
    def __init__(self, group: RankGroup):
        self.group = group
        self.rank, self.size = group.rank, group.size
        self._left = group.global_rank(self.rank - 1) if self.rank > 0 else None
        self._right = group.global_rank(self.rank + 1) if self.rank < self.size - 1 else None
        self._root = group.global_rank(0)
        self.halo_bytes = 0  # sent by this rank, for communication accounting

    # -- strips ------------------------------------------------------------------------------
    def strip(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a full-width tensor (last dim)."""
        w = x.shape[-1] // self.size
        return x[..., self.rank * w : (self.rank + 1) * w]

    # -- halos --------------------------------------------------------------------------------
    def pad2d(self, x: torch.Tensor, ph: int, pw: int) -> torch.Tensor:
        out = F.pad(x, (pw, pw, ph, ph)) if ph or pw else x
        if not pw or not self.group.active:
            return out
        if x.shape[-1] < pw:
            raise ValueError(f"strip of {x.shape[-1]} columns is narrower than its {pw}-column halo")
        ops, recvs = [], []
        rows = slice(ph, ph + x.shape[-2])
        for peer, send_cols, recv_cols in (
            (self._left, slice(0, pw), slice(0, pw)),
            (self._right, slice(x.shape[-1] - pw, x.shape[-1]), slice(out.shape[-1] - pw, out.shape[-1])),
        ):
            if peer is None:
                continue
            send = x[..., send_cols].contiguous()
            recv = torch.empty_like(send)
            ops += [dist.P2POp(dist.isend, send, peer, self.group.group), dist.P2POp(dist.irecv, recv, peer, self.group.group)]
            recvs.append((recv, recv_cols))
            self.halo_bytes += send.numel() * send.element_size()
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for recv, cols in recvs:
            out[..., rows, cols] = recv
        return out

    # -- gathers ------------------------------------------------------------------------------
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        if not self.group.active:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group.group)
        return torch.cat(parts, dim=-1)

    def gather_to_root(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's strip along the width on group rank 0; None elsewhere."""
        if not self.group.active:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=self._root, group=self.group.group)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None
