"""Paged KV cache: sink + window accounting chunk by chunk, paged attention == gather, cleanup."""

from __future__ import annotations

import pytest
import torch

from harness.config import load_preset, override
from harness.engine.attention import DENSE, _blocks, gather_attention, paged_attention
from harness.engine.conditions import SessionConditions
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup
from harness.engine.kvcache import PagedKVCache
from harness.errors import HarnessError

CHUNKS = 9


@pytest.fixture(scope="module")
def cfg():
    return override(load_preset("tiny"), parallel={"sp": 1})


@pytest.fixture(scope="module")
def engine(cfg):
    return DitEngine(cfg, group=RankGroup.single(), device=torch.device("cpu"), seed=0)


def _expected_frames(chunk: int, fpc: int, sink: int, window: int) -> set[int]:
    """Latent frames cached after chunk ``chunk`` completes: sink ∪ the most recent ones."""
    done = fpc * (chunk + 1)
    recent = window - sink
    return set(range(min(sink, done))) | set(range(max(sink, done - recent), done))


def test_kv_accounting_chunk_by_chunk(engine, cfg):
    fpc, sink, window = cfg.video.frames_per_chunk, cfg.cache.sink_frames, cfg.cache.window_frames
    bpf = engine.cache.blocks_per_frame
    total = engine.kv_stats()["blocks_total"]
    assert total == cfg.cache.max_sessions * window * bpf
    s = engine.start_session(SessionConditions(prompt="kv", seed=0))
    for c in range(CHUNKS):
        engine.generate_chunk(s, ["W", "", "J"])
        frames = _expected_frames(c, fpc, sink, window)
        assert set(s.kv.frames) == frames, f"chunk {c}: cached frames {sorted(s.kv.frames)}"
        used = min(fpc * (c + 1), window) * bpf
        stats = engine.kv_stats()
        assert stats["blocks_used"] == used == stats["sessions"][s.kv.sid], f"chunk {c}"
        assert stats["blocks_free"] == total - used
    # effective K length in chunks' worth of tokens: 1, 2, …, 6, 6, 6 (18 frames = 6 chunks)
    assert [t // cfg.tokens_per_chunk for t in s.kv_tokens] == [1, 2, 3, 4, 5, 6, 6, 6, 6]
    assert all(t % cfg.tokens_per_chunk == 0 for t in s.kv_tokens)
    engine.end_session(s)
    engine.end_session(s)  # idempotent
    stats = engine.kv_stats()
    assert stats["blocks_used"] == 0 and stats["blocks_free"] == total and stats["sessions"] == {}
    with pytest.raises(HarnessError, match="ended"):
        engine.generate_chunk(s, ["", "", ""])


def test_full_size_kv_lengths():
    """480×832: 4680 tokens a chunk, saturating at 28080 (DESIGN §2), on the meta device."""
    for name, tokens, sat in [("lingbot-480x832", 4680, 28080), ("lingbot-704x1280", 10560, 63360)]:
        c = load_preset(name)
        cache = PagedKVCache.from_config(c, sp=4, dtype=torch.bfloat16, device=torch.device("meta"))
        s = cache.open()
        seen = []
        for _ in range(8):
            cache.begin_chunk(s, c.video.frames_per_chunk)
            seen.append(cache.visible_tokens(s))
            cache.commit(s)
        assert c.tokens_per_chunk == tokens
        assert seen == [tokens * k for k in (1, 2, 3, 4, 5, 6, 6, 6)] and seen[-1] == sat
        assert cache.k[0].shape == (cache.num_blocks, c.block_size, 10, 128)
        cache.free_session(s)
        assert cache.blocks_used == 0


def test_uncommitted_chunk_is_dropped_and_sessions_are_bounded(cfg):
    cache = PagedKVCache.from_config(cfg, sp=1, dtype=torch.float32, device=torch.device("cpu"))
    s = cache.open()
    cache.begin_chunk(s, 3)
    cache.commit(s)
    cache.begin_chunk(s, 3)  # cancelled before its commit pass …
    cache.begin_chunk(s, 3)  # … so the retry reuses the same frames
    assert sorted(s.frames) == [0, 1, 2, 3, 4, 5]
    assert cache.blocks_used == 6 * cache.blocks_per_frame
    with pytest.raises(HarnessError, match="max_sessions"):
        cache.open()
    cache.free_session(s)
    assert cache.blocks_used == 0
    cache.open()  # capacity is back


@pytest.mark.parametrize("group_blocks", [1, 2, 5])
def test_paged_equals_gather_kernel(group_blocks):
    g = torch.Generator().manual_seed(0)
    pool_k = torch.randn(12, 16, 4, 32, generator=g)
    pool_v = torch.randn(12, 16, 4, 32, generator=g)
    q = torch.randn(48, 4, 32, generator=g)
    ids = torch.tensor([7, 0, 3, 11, 5, 9, 2])
    ref = gather_attention(q, pool_k, pool_v, ids, attend=DENSE["math"], group_blocks=group_blocks)
    out = paged_attention(q, pool_k, pool_v, ids, attend=DENSE["sdpa"], group_blocks=group_blocks)
    assert out.shape == (48, 4, 32)
    assert (out - ref).abs().max().item() <= 1e-5
    # a direct softmax over the gathered keys agrees too
    k = pool_k[ids].flatten(0, 1)
    v = pool_v[ids].flatten(0, 1)
    p = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / 32**0.5, dim=-1)
    assert (torch.einsum("hqk,khd->qhd", p, v) - ref).abs().max().item() <= 1e-5


def test_paged_equals_gather_engine(cfg):
    outs = {}
    for path in ("gather", "paged"):
        eng = DitEngine(override(cfg, runtime={"kv_path": path}), group=RankGroup.single(), device=torch.device("cpu"), seed=1)
        s = eng.start_session(SessionConditions(prompt="paged", seed=2))
        outs[path] = [eng.generate_chunk(s, ["D", "L", ""]) for _ in range(8)]
        eng.end_session(s)
    for c, (a, b) in enumerate(zip(outs["gather"], outs["paged"])):
        assert (a - b).abs().max().item() <= 1e-5, f"chunk {c}"


def test_switches_refuse_unknown_names(engine):
    with pytest.raises(HarnessError, match="unknown KV path"):
        engine.kv_path = "nope"
    with pytest.raises(HarnessError, match="unknown attention backend"):
        engine.attention = "nope"
    engine.attention = "math"
    assert engine.attention_description() == "gather+math"
    engine.attention = "sdpa"


def _visible(cache: PagedKVCache, s, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = cache.visible(s)
    return _blocks(cache.k[layer], ids), _blocks(cache.v[layer], ids)


def test_window_layout_holds_what_the_paged_layout_gathers(cfg):
    """The same K/V written chunk by chunk — through saturation (chunk 5), eviction (from chunk 6)
    and two chunks dropped before their commit (a cancel mid-chunk) — reads back identically, bit
    for bit and in the same token order, as a view of the window layout's slot and as the paged
    layout's gather; the window layout's view is a view (no copy) of the pool."""
    caches = {lay: PagedKVCache.from_config(override(cfg, cache={"max_sessions": 2}), sp=1, dtype=torch.float32,
                                            device=torch.device("cpu")) for lay in ("paged", "window")}
    sessions = {lay: c.open(lay) for lay, c in caches.items()}
    other = caches["paged"].open("paged")  # a second session in the paged pool: its free heap interleaves
    caches["paged"].begin_chunk(other, 3)
    g = torch.Generator().manual_seed(0)
    fpc, tokens = cfg.video.frames_per_chunk, cfg.tokens_per_chunk
    shape = (tokens, cfg.model.num_heads, cfg.model.head_dim)
    dropped = {4, 8}
    for chunk in range(14):
        data = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(cfg.model.num_layers)]
        for lay, cache in caches.items():
            cache.begin_chunk(sessions[lay], fpc)
            for layer, (k, v) in enumerate(data):
                cache.write(layer, sessions[lay], k, v)
        for layer in range(cfg.model.num_layers):
            kp, vp = _visible(caches["paged"], sessions["paged"], layer)
            kw, vw = _visible(caches["window"], sessions["window"], layer)
            assert torch.equal(kp, kw) and torch.equal(vp, vw), f"chunk {chunk} layer {layer}"
            assert kw.data_ptr() == caches["window"].k[layer].data_ptr()  # the slot's front, a view: no copy
        assert sorted(sessions["window"].frames) == sorted(sessions["paged"].frames)
        if chunk not in dropped:
            for lay, cache in caches.items():
                cache.commit(sessions[lay])
    w = caches["window"]
    assert w.blocks_used == w.slot_blocks  # the slot is the session's whole
    w.free_session(sessions["window"])
    assert w.blocks_used == 0
    assert w.open("window").slot == 0  # and whole again


def test_window_layout_needs_a_whole_slot(cfg):
    cache = PagedKVCache.from_config(override(cfg, cache={"max_sessions": 2}), sp=1, dtype=torch.float32,
                                     device=torch.device("cpu"))
    a = cache.open("paged")
    cache.begin_chunk(a, 3)  # the paged session's blocks come from the front of the pool
    assert cache.open("window").slot == cache.slot_blocks  # slot 0 is partly used: slot 1
    with pytest.raises(HarnessError, match="unknown KV layout"):
        cache.open("nope")


def test_window_layout_engine_is_bit_identical(cfg):
    """The engine with the window layout (H1c) generates exactly the bytes of the paged layout's
    gather, past eviction, in one engine switching layouts between sessions (as ab-engine does)."""
    eng = DitEngine(cfg, group=RankGroup.single(), device=torch.device("cpu"), seed=1)
    outs = {}
    for layout in ("paged", "window", "paged"):
        eng.kv_layout = layout
        s = eng.start_session(SessionConditions(prompt="window", seed=2))
        outs.setdefault(layout, []).append([eng.generate_chunk(s, ["D", "L", ""]).numpy().tobytes() for _ in range(8)])
        eng.end_session(s)
    assert outs["paged"][0] == outs["paged"][1] == outs["window"][0]
    assert eng.attention_description() == "gather+sdpa"
    eng.kv_layout = "window"
    assert eng.attention_description() == "window:gather+sdpa"
