"""Reference conversion of decoded frames to uint8 pixels — the exact rule later kernels must match.

``to_uint8(frames)``: frames (3, T, H, W), float in [-1, 1] → (T, H, W, 3) uint8 (RGB, HWC per frame,
what the encoder stage takes), computed in float32 as

    y = (x + 1) * 127.5          # two float32 roundings, in that order
    y = round_half_to_even(y)    # torch.round: 127.5 → 128, 0.5 → 0, 254.5 → 254
    y = clamp(y, 0, 255)         # ±inf and anything outside [-1, 1] saturate
    NaN → 0                      # explicitly; a bare float→uint8 cast of NaN is undefined

so −1 → 0, 0 → 128, 1 → 255. bf16/fp16 inputs are upcast to float32 first (exactly).
"""

from __future__ import annotations

import torch


def to_uint8(frames: torch.Tensor) -> torch.Tensor:
    if frames.dim() != 4 or frames.shape[0] != 3:
        raise ValueError(f"expected frames of shape (3, T, H, W), got {tuple(frames.shape)}")
    y = ((frames.float() + 1.0) * 127.5).round_().clamp_(0.0, 255.0)
    y = torch.nan_to_num_(y, nan=0.0)
    return y.to(torch.uint8).permute(1, 2, 3, 0).contiguous()
