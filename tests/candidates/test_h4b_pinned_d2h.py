"""H4b (CUDA only): the copy into a real shared-memory ring slot is byte-exact and goes straight
into the slot once the ring mapping is registered with the driver; memory the candidate cannot
pin (an array owning its memory) goes through the pinned staging buffer, also exactly; closing
unregisters, so the ring unmaps cleanly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_whole_ring_mapping_is_found_from_a_slot_view():
    """What gets registered: from any slot's view, the one mapping behind all slots (CPU-only logic)."""
    from harness.candidates.h4b_pinned_d2h import _mapping
    from harness.pipeline.ring import FrameRing

    ring = FrameRing.create("harness-test-h4b-map", 3, 4096 * 3)
    try:
        regions = []
        for i in range(3):
            ref = ring.acquire(0, i)
            view = ring.buffer(ref, (2, 8, 8, 3))
            regions.append(_mapping(view))
            assert regions[-1][0] <= view.ctypes.data < regions[-1][0] + regions[-1][1]
            del view
        assert len(set(regions)) == 1 and regions[0][1] >= 3 * 4096 * 3
        assert _mapping(np.zeros((2, 8, 8, 3), np.uint8)) is None  # owns its memory: staged, not pinned
    finally:
        ring.close()
        ring.unlink()


@cuda
def test_pinned_copy_into_ring_slot_is_exact():
    from harness.candidates.h4b_pinned_d2h import PinnedCopy
    from harness.pipeline.ring import FrameRing

    shape = (12, 480, 832, 3)
    ring = FrameRing.create("harness-test-h4b", 2, int(np.prod(shape)))
    copier = PinnedCopy()
    try:
        for i in range(3):  # more chunks than slots: slots are reused, registration is not repeated
            frames = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
            ref = ring.acquire(0, i)
            dst = ring.buffer(ref, shape)
            copier(frames, dst)
            assert torch.from_numpy(dst).is_pinned(), copier.describe()
            assert np.array_equal(dst, frames.cpu().numpy())
            del dst
            ref = ring.publish(ref, shape)
            ring.claim(ref)
            ring.release(ref)
        assert copier.stats == {"direct": 3, "staged": 0}, copier.describe()
        own = np.empty(shape, np.uint8)
        copier(frames, own)
        assert np.array_equal(own, frames.cpu().numpy()) and copier.stats["staged"] == 1
    finally:
        copier.close()
        ring.close()
        ring.unlink()
    assert copier.describe()["registered_bytes"] == 0
