"""Paged KV cache for the causal DiT: per-layer block pools, a block table per session, sink + window.

Every layer has a K pool and a V pool of shape (num_blocks, block_size, local_heads, head_dim);
under Ulysses SP each rank holds all tokens of its local heads. A session's blocks are tracked per
absolute latent frame. The visible window (``cache.window_frames``) includes the chunk being
generated: at each chunk boundary the committed frames are cut back to the sink (the session's
first ``sink_frames`` frames, kept forever) plus the most recent
``window − sink − frames_per_chunk`` frames, and then the new chunk's blocks are allocated. The
denoise passes overwrite the new chunk's blocks; the commit pass leaves the final K/V in them and
``commit`` makes them part of the history later chunks see.

All bookkeeping is on the host (small Python lists); each chunk's block table goes to the device
once, so the forwards of a chunk never wait on the host.

Two layouts of a session's blocks (``layout`` at ``open``), the same pool either way:

* ``paged`` — blocks come from a free heap, so a session's visible blocks lie anywhere in the pool
  and attention either gathers them into a contiguous tensor (a copy of the whole window in every
  forward of every layer: ≈ 134 ms of a 480×832 chunk on an H200) or walks the block table.
* ``window`` — the session owns one contiguous slot of ``window_frames`` frames and keeps its
  visible frames at the front of it, in frame order: the sink, the recent frames, the chunk in
  flight. The visible K/V is then a *view* of the pool (``visible_span``), equal element for element
  to what the gather would copy, so a dense kernel reads it in place. Eviction pays for it once per
  chunk instead of once per forward: the recent frames that stay move forward over the evicted ones
  (at 480×832, 6 frames of K and V per layer per chunk against 18 per layer per forward).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from harness.config import HarnessConfig
from harness.errors import HarnessError


@dataclass
class SessionKV:
    sid: int
    frames: dict[int, list[int]] = field(default_factory=dict)  # absolute latent frame → block ids
    pending: list[int] = field(default_factory=list)  # frames of the chunk in flight (not committed)
    next_frame: int = 0
    visible_ids: Tensor | None = None  # (n_visible_blocks,) int64 on the device, frame order
    current_ids: Tensor | None = None  # (n_current_blocks,) the chunk in flight, token order
    visible_blocks: int = 0
    closed: bool = False
    layout: str = "paged"
    slot: int | None = None  # window layout: the first block of the session's slot
    #: window layout: the visible blocks as a slice of the pool (a view, no index)
    visible_span: slice | None = None
    #: window layout: the chunk in flight's blocks as a slice (the pool write is a plain copy)
    current_span: slice | None = None
    #: window layout: (1,) int32 on the device, the visible tokens before the chunk in flight —
    #: the cache length a kernel that appends the chunk's K/V itself is given (H1e)
    kept_tokens: Tensor | None = None

    @property
    def blocks(self) -> int:
        return sum(len(b) for b in self.frames.values())


def _to_device(ids: list[int], device: torch.device, dtype: torch.dtype = torch.long) -> Tensor:
    t = torch.tensor(ids, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


#: how a session's blocks are placed in the pool (see the module docstring)
LAYOUTS = ("paged", "window")


class PagedKVCache:
    #: whether a kernel may write the pools itself (``attend_appending``); a cache that stores
    #: something else than the K/V it is given (FP8) says no
    appends = True

    def __init__(self, *, num_layers: int, local_heads: int, head_dim: int, block_size: int, tokens_per_frame: int,
                 sink_frames: int, window_frames: int, max_sessions: int, dtype: torch.dtype, device: torch.device):
        if tokens_per_frame % block_size:
            raise HarnessError(f"KV block size {block_size} does not divide {tokens_per_frame} tokens per frame")
        self.block_size = block_size
        self.blocks_per_frame = tokens_per_frame // block_size
        self.sink_frames, self.window_frames = sink_frames, window_frames
        self.num_blocks = max_sessions * window_frames * self.blocks_per_frame
        self.max_sessions = max_sessions
        self.device = device
        shape = (self.num_blocks, block_size, local_heads, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free = list(range(self.num_blocks))  # a min-heap: lowest ids first keeps runs repeatable
        self._sessions: dict[int, SessionKV] = {}
        self._ids = itertools.count()
        self.slot_blocks = window_frames * self.blocks_per_frame
        self._static_marked = False

    @classmethod
    def from_config(cls, cfg: HarnessConfig, *, sp: int, dtype: torch.dtype, device: torch.device) -> "PagedKVCache":
        m = cfg.model
        return cls(num_layers=m.num_layers, local_heads=m.num_heads // sp, head_dim=m.head_dim,
                   block_size=cfg.block_size, tokens_per_frame=cfg.tokens_per_frame,
                   sink_frames=cfg.cache.sink_frames, window_frames=cfg.cache.window_frames,
                   max_sessions=cfg.cache.max_sessions, dtype=dtype, device=device)

    # ---- session lifecycle ---------------------------------------------------------------------
    def open(self, layout: str = "paged") -> SessionKV:
        if layout not in LAYOUTS:
            raise HarnessError(f"unknown KV layout {layout!r} (known: {', '.join(LAYOUTS)})")
        if len(self._sessions) >= self.max_sessions:
            raise HarnessError(f"KV cache holds {len(self._sessions)} sessions already "
                               f"(cache.max_sessions = {self.max_sessions})")
        s = SessionKV(next(self._ids), layout=layout)
        if layout == "window":
            s.slot = self._take_slot()
        self._sessions[s.sid] = s
        return s

    def _take_slot(self) -> int:
        """The lowest whole slot of ``slot_blocks`` free blocks, taken out of the heap."""
        free = set(self._free)
        for base in range(0, self.num_blocks, self.slot_blocks):
            if all(b in free for b in range(base, base + self.slot_blocks)):
                taken = set(range(base, base + self.slot_blocks))
                self._free = [b for b in self._free if b not in taken]
                heapq.heapify(self._free)
                return base
        raise HarnessError(f"KV pool has no whole window slot free for a window-layout session "
                           f"({len(self._free)} of {self.num_blocks} blocks free, in pieces)")

    def begin_chunk(self, s: SessionKV, frames: int) -> None:
        """Evict to sink + recent, then allocate the blocks of the next ``frames`` latent frames."""
        if s.closed:
            raise HarnessError(f"KV session {s.sid} is closed")
        recent = self.window_frames - self.sink_frames - frames
        if recent < 0:
            raise HarnessError(f"a chunk of {frames} frames does not fit the window of {self.window_frames} "
                               f"after {self.sink_frames} sink frames")
        if s.layout == "window":
            self._begin_window_chunk(s, frames, recent)
        else:
            self._begin_paged_chunk(s, frames, recent)
        visible = [b for f in sorted(s.frames) for b in s.frames[f]]
        s.visible_ids = _to_device(visible, self.device)
        s.current_ids = _to_device([b for f in s.pending for b in s.frames[f]], self.device)
        s.visible_blocks = len(visible)
        if s.layout == "window":
            s.visible_span = slice(s.slot, s.slot + len(visible))
            first = s.frames[s.pending[0]][0]
            s.current_span = slice(first, first + len(s.pending) * self.blocks_per_frame)
            s.kept_tokens = _to_device([(first - s.slot) * self.block_size], self.device, torch.int32)

    def _begin_paged_chunk(self, s: SessionKV, frames: int, recent: int) -> None:
        for f in s.pending:  # a chunk that never committed (cancelled mid-chunk) is dropped
            self._release(s.frames.pop(f))
        s.pending = []
        old = sorted(f for f in s.frames if f >= self.sink_frames)
        for f in old[:max(0, len(old) - recent)]:
            self._release(s.frames.pop(f))
        need = frames * self.blocks_per_frame
        if need > len(self._free):
            raise HarnessError(f"KV pool exhausted: need {need} blocks, {len(self._free)} free of {self.num_blocks}")
        for f in range(s.next_frame, s.next_frame + frames):
            s.frames[f] = [heapq.heappop(self._free) for _ in range(self.blocks_per_frame)]
            s.pending.append(f)

    def _begin_window_chunk(self, s: SessionKV, frames: int, recent: int) -> None:
        """Keep the sink and the ``recent`` newest committed frames, moved to the front of the slot
        in frame order, then give the chunk the positions right after them."""
        for f in s.pending:  # never committed: its positions are simply written again
            s.frames.pop(f)
        s.pending = []
        committed = sorted(s.frames)
        old = [f for f in committed if f >= self.sink_frames]
        kept = [f for f in committed if f < self.sink_frames] + old[max(0, len(old) - recent):]
        moves = []  # (from position, to position), positions only ever move forward (lower)
        for pos, f in enumerate(kept):
            was = (s.frames[f][0] - s.slot) // self.blocks_per_frame
            if was != pos:
                moves.append((was, pos))
        self._move_frames(s.slot, moves)
        s.frames = {f: self._frame_blocks(s.slot, pos) for pos, f in enumerate(kept)}
        for i, f in enumerate(range(s.next_frame, s.next_frame + frames)):
            s.frames[f] = self._frame_blocks(s.slot, len(kept) + i)
            s.pending.append(f)

    def _frame_blocks(self, slot: int, pos: int) -> list[int]:
        first = slot + pos * self.blocks_per_frame
        return list(range(first, first + self.blocks_per_frame))

    def _move_frames(self, slot: int, moves: list[tuple[int, int]]) -> None:
        """Copy frames to lower positions of the slot, in runs that never overlap their own source:
        a run is consecutive frames that all move by the same distance, cut at that distance, so
        each copy reads positions no earlier copy has written (moves go in increasing order)."""
        bpf, i = self.blocks_per_frame, 0
        while i < len(moves):
            src, dst = moves[i]
            n = 1
            while (i + n < len(moves) and moves[i + n] == (src + n, dst + n) and n < src - dst):
                n += 1
            a, b = slot + src * bpf, slot + dst * bpf
            for pool in (*self.k, *self.v):
                pool[b : b + n * bpf].copy_(pool[a : a + n * bpf])
            i += n

    def commit(self, s: SessionKV) -> None:
        """The commit pass has written the chunk's final K/V: later chunks may attend to it."""
        s.next_frame += len(s.pending)
        s.pending = []

    def free_session(self, s: SessionKV) -> None:
        if s.closed:
            return
        if s.slot is not None:  # the whole slot, its unused positions included
            self._release(list(range(s.slot, s.slot + self.slot_blocks)))
        else:
            for blocks in s.frames.values():
                self._release(blocks)
        s.frames.clear()
        s.pending = []
        s.visible_ids = s.current_ids = s.visible_span = s.current_span = s.kept_tokens = None
        s.visible_blocks = 0
        s.closed = True
        self._sessions.pop(s.sid, None)

    def _release(self, blocks: list[int]) -> None:
        for b in blocks:
            heapq.heappush(self._free, b)

    # ---- data path -----------------------------------------------------------------------------
    def write(self, layer: int, s: SessionKV, k: Tensor, v: Tensor) -> None:
        """k, v: (tokens of the chunk in flight, local_heads, head_dim), already RoPE-rotated."""
        shape = (-1, self.block_size, *k.shape[1:])
        if s.current_span is not None:  # contiguous positions: a copy at memory speed, no index kernel
            self.k[layer][s.current_span].copy_(k.reshape(shape))
            self.v[layer][s.current_span].copy_(v.reshape(shape))
            return
        self.k[layer].index_copy_(0, s.current_ids, k.reshape(shape))
        self.v[layer].index_copy_(0, s.current_ids, v.reshape(shape))

    def graph_destination(self, layer: int, s: SessionKV) -> tuple[Tensor, Tensor, Tensor] | None:
        """(K pool, V pool, the chunk in flight's block ids) of a layer, for the block's traced code
        to write the chunk's K/V into itself (``dit.store_kv``, H1f); None in a cache that stores
        something else than the K/V it is given. The pools are marked static addresses the first
        time: CUDA graphs then write them in place, where an input not static would be copied
        into the graph (a whole pool) before every replay."""
        if not self.appends:
            return None
        if not self._static_marked:
            from torch._dynamo import mark_static_address  # dynamo only where a graph writes them

            for pool in (*self.k, *self.v):
                mark_static_address(pool)
            self._static_marked = True
        return self.k[layer], self.v[layer], s.current_ids

    def attend(self, layer: int, s: SessionKV, q: Tensor, kv_fn, *, attend, group_blocks: int) -> Tensor:
        """Self-attention of the chunk's queries over the session's visible K/V through a KV path
        (``attention.KV_PATHS``); an FP8 cache (``kv_fp8``) reads its pools its own way."""
        return kv_fn(q, self.k[layer], self.v[layer], self.visible(s), attend=attend, group_blocks=group_blocks)

    def can_append(self, s: SessionKV) -> bool:
        """Whether a kernel may write the chunk's K/V itself (``attend_appending``): the window
        layout, whose chunk in flight is the tail of the visible span, in a cache of plain pools."""
        return self.appends and s.visible_span is not None

    def attend_appending(self, layer: int, s: SessionKV, q: Tensor, k: Tensor, v: Tensor, *, append) -> Tensor:
        """``write`` and ``attend`` in one kernel call (H1e): ``append`` (``attention.APPEND_KV``)
        writes the chunk's k, v (tokens, H, D) behind the session's kept tokens and attends over
        the whole visible span, so no copy kernel writes them."""
        return append(q, self.k[layer][s.visible_span].flatten(0, 1), self.v[layer][s.visible_span].flatten(0, 1),
                      k, v, s.kept_tokens)

    def visible(self, s: SessionKV) -> Tensor | slice:
        """What a KV path reads the session's visible blocks through: a slice of the pool (a view)
        in the window layout, the block table otherwise."""
        return s.visible_span if s.visible_span is not None else s.visible_ids

    def visible_tokens(self, s: SessionKV) -> int:
        return s.visible_blocks * self.block_size

    # ---- accounting ----------------------------------------------------------------------------
    @property
    def blocks_free(self) -> int:
        return len(self._free)

    @property
    def blocks_used(self) -> int:
        return self.num_blocks - len(self._free)

    def session_blocks(self, s: SessionKV) -> int:
        return s.blocks

    def bytes_total(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def stats(self) -> dict:
        return {
            "block_size": self.block_size,
            "blocks_per_frame": self.blocks_per_frame,
            "blocks_total": self.num_blocks,
            "blocks_used": self.blocks_used,
            "blocks_free": self.blocks_free,
            "bytes_total": self.bytes_total(),
            "sessions": {sid: s.blocks for sid, s in self._sessions.items()},
        }
