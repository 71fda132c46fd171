"""The RoPE position table's bound inside the engine: a chunk that ends exactly at the table's last
frame is served, one frame further is refused (the same bound ``limits`` checks up front)."""

from __future__ import annotations

import pytest
import torch

from harness.engine.dit import RopeTables, TokenLayout
from harness.errors import HarnessError
from harness.limits import ROPE_MAX_FRAMES, session_frames_error


def test_a_chunk_may_end_at_the_last_position_and_not_beyond():
    frames, h, w = 3, 2, 2
    tables = RopeTables(12, (frames, h, w), TokenLayout(frames, h * w, 0, frames * h * w), torch.device("cpu"), max_frames=9)
    last = tables.for_chunk(6)  # frames 6, 7, 8: the table's last three
    assert last.shape == (frames * h * w, 1, 6, 2)
    # the frame rows of that chunk are the table's own rows 6..8 (no clamping, no wrap)
    assert torch.equal(last[:, 0, : tables.cos_f.shape[1], 0], tables.cos_f[6:9].index_select(0, tables.fi))
    with pytest.raises(HarnessError, match="exceeds 9 latent frames"):
        tables.for_chunk(7)


def test_the_up_front_bound_admits_exactly_the_table():
    assert session_frames_error(ROPE_MAX_FRAMES // 4, 4) is None
    assert "at most" in session_frames_error(ROPE_MAX_FRAMES // 4 + 1, 4)
