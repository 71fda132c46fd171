"""A session's noise: which Gaussian draws a seed stands for (``schedule.noise``).

``session-stream`` (the default) is production's convention (vLLM-Omni 0.30.0): the worker seeds
one ``torch.Generator`` on its own device with the request's seed, and the session draws from it
in order: for every chunk the initial latent noise, then the re-noise of each denoise step after
the first (4 draws of (16, F, h, w) float32 a chunk with the 4-step schedule). The same request
therefore means the same noise as in production, and a chunk's noise depends on every chunk before
it. The stream's position is committed with the chunk: a chunk that fails part-way and is run again
redraws the same noise, and every session has its own stream, so a cancelled session cannot shift
another one's.

``per-chunk-step`` re-seeds every draw from (seed, chunk, step): a chunk's noise is a pure function
of those three, whatever ran before it. It does not reproduce production's video for a seed; it
serves comparisons of single chunks (or sessions cut short) between two arms.
"""

from __future__ import annotations

import torch
from torch import Tensor

from harness.config import NOISE_CONVENTIONS
from harness.engine.conditions import derive_seed
from harness.errors import HarnessError


class SessionNoise:
    """The draws of one session on one device; every rank of an SP group holds an identical one."""

    def __init__(self, convention: str, seed: int, device: torch.device):
        if convention not in NOISE_CONVENTIONS:
            raise HarnessError(f"unknown noise convention {convention!r} (known: {', '.join(NOISE_CONVENTIONS)})")
        self.convention, self.seed = convention, int(seed)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(self.seed)
        self._committed = self.generator.get_state()

    def begin_chunk(self) -> None:
        """Rewind to where the last committed chunk left the stream (a no-op unless the previous
        attempt at this chunk failed after drawing)."""
        if self.convention == "session-stream":
            self.generator.set_state(self._committed)

    def commit_chunk(self) -> None:
        if self.convention == "session-stream":
            self._committed = self.generator.get_state()

    def generator_for(self, chunk: int, step: int) -> torch.Generator:
        """The generator whose next draw is the noise of (chunk, step): for the session stream the
        stream itself, which must be drawn in order (step 0, 1, …, then the next chunk)."""
        if self.convention == "per-chunk-step":
            self.generator.manual_seed(derive_seed("noise", self.seed, chunk, step))
        return self.generator

    def draw(self, chunk: int, step: int, shape: tuple[int, ...]) -> Tensor:
        gen = self.generator_for(chunk, step)
        return torch.randn(shape, generator=gen, device=gen.device, dtype=torch.float32)
