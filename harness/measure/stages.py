"""The stage table: every named interval of the event table, as (name, start boundary, end boundary).

One table for every reader — the figures (``metrics``), the Perfetto trace (``hooks.trace``), the
report's plots and the long-tail breakdown — so a stage name means one interval everywhere
(DESIGN §4).

- ``STAGES``: the hops between consecutive boundaries of one chunk, in data-flow order; together
  they tile submit → delivered.
- ``GAP`` and ``HANDOFF`` span two chunks of a session: they start at a boundary of chunk i−1
  and end at one of chunk i. ``gap`` is the driver's reaction that no stage covers; ``handoff``
  is the Case D critical path from frames in host memory to the next DiT forward (negative under
  Case E, where the next forward starts first).
"""

from __future__ import annotations

from typing import NamedTuple

class Stage(NamedTuple):
    name: str
    start: str
    end: str


STAGES: tuple[Stage, ...] = (
    Stage("dit_queue", "submit", "dit_start"),
    Stage("dit", "dit_start", "dit_end"),
    Stage("latent_ipc", "dit_end", "latent_ready"),
    Stage("decode_wait", "latent_ready", "decode_submit"),
    Stage("decode_queue", "decode_submit", "decode_start"),
    Stage("decode", "decode_start", "decode_end"),
    Stage("convert", "decode_end", "gpu_ready"),
    Stage("d2h", "gpu_ready", "cpu_ready"),
    Stage("ipc", "cpu_ready", "received"),
    Stage("encode", "received", "encoded"),
    Stage("sink", "encoded", "delivered"),
)
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)
#: name → (start, end), for lookups by name.
INTERVALS: dict[str, tuple[str, str]] = {s.name: (s.start, s.end) for s in STAGES}

#: start at chunk i−1, end at chunk i
GAP = Stage("gap", "cpu_ready", "submit")
HANDOFF = Stage("handoff", "cpu_ready", "dit_start")
