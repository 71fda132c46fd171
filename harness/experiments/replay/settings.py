"""What a replay runs over and how often: the op kinds, the timing defaults, the synthetic grid.

No torch here on purpose: the command line reads these to build its parser for every command
(see the package docstring).
"""

from __future__ import annotations

KINDS: tuple[str, ...] = ("attention", "linear", "conv", "convert")
DEFAULT_WARMUP = 3
DEFAULT_REPEATS = 20
#: --synthetic: effective K lengths and SP degrees of the production attention grid.
SYNTHETIC_KV = (4680, 14040, 28080)
SYNTHETIC_SP = (1, 2)
