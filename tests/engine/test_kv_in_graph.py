"""H1f on CPU: the block writes the chunk's K/V into the cache itself (``dit.store_kv``).

The store by block id fills a pool exactly as the attention core's write does, in both layouts,
through saturation, eviction and chunks dropped before their commit. Whole engines give the same
latent bytes with the switch on and off, eager and compiled (where the store is part of the
block's graph: the core writes nothing, and nothing recompiles after the first chunk), on one rank
and under SP with 2 and 4 ranks (where the core keeps the write), and with H5b's deferred commits
of two interleaved sessions."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import get_static_address_type

from harness import candidates as C
from harness.config import load_preset, override
from harness.engine import dit
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup, run_ranks
from harness.engine.kv_fp8 import Fp8KVCache
from harness.engine.kvcache import PagedKVCache
from harness.errors import HarnessError
from tests.helpers.ranks import assert_ranks_match
from tests.helpers.sessions import interleaved_bytes, session_bytes

#: saturated at chunk 2, evicting from chunk 3 (as in test_dit_sp)
CACHE = {"sink_frames": 3, "window_frames": 9}
CHUNKS = 5


def _cfg(sp: int = 1, mode: str = "eager"):
    return override(load_preset("tiny"), parallel={"sp": sp}, cache=CACHE, runtime={"mode": mode})


@pytest.mark.parametrize("layout", ["paged", "window"])
def test_store_by_block_id_fills_the_pool_as_the_write_does(layout):
    cfg = override(load_preset("tiny"), parallel={"sp": 1}, cache={"max_sessions": 2})
    caches = [PagedKVCache.from_config(cfg, sp=1, dtype=torch.float32, device=torch.device("cpu")) for _ in range(2)]
    sessions = [c.open(layout) for c in caches]
    g = torch.Generator().manual_seed(0)
    shape = (cfg.tokens_per_chunk, cfg.model.num_heads, cfg.model.head_dim)
    for chunk in range(14):
        for c, s in zip(caches, sessions):
            c.begin_chunk(s, cfg.video.frames_per_chunk)
        for layer in range(cfg.model.num_layers):
            k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
            caches[0].write(layer, sessions[0], k, v)
            dest = caches[1].graph_destination(layer, sessions[1])
            assert dest[0] is caches[1].k[layer] and dest[1] is caches[1].v[layer]
            # V arrives as a strided slice of the fused QKV output, as in the block
            qkv = torch.cat([k, k, v], dim=-1)
            dit.store_kv(dest, k, qkv[..., 2 * shape[-1]:])
            for pools in ("k", "v"):  # what attention reads: the visible blocks, the chunk's among them
                a, b = (getattr(c, pools)[layer][c.visible(s)] for c, s in zip(caches, sessions))
                assert torch.equal(a, b), f"chunk {chunk} layer {layer} {pools}"
        if chunk not in (4, 8):  # two chunks dropped before their commit: the retry writes over them
            for c, s in zip(caches, sessions):
                c.commit(s)
    assert all(get_static_address_type(p) == "unguarded" for p in (*caches[1].k, *caches[1].v))
    assert get_static_address_type(caches[0].k[0]) is None  # only a cache a graph writes is marked


def test_a_cache_that_stores_something_else_gives_no_destination():
    cfg = override(load_preset("tiny"), parallel={"sp": 1})
    fp8 = Fp8KVCache.from_config(cfg, sp=1, device=torch.device("cpu"), kernel="emulated")
    s = fp8.open()
    fp8.begin_chunk(s, cfg.video.frames_per_chunk)
    assert fp8.graph_destination(0, s) is None


class _CountingWrites:
    """Counts the attention core's K/V writes of an engine's cache."""

    def __init__(self, cache: PagedKVCache):
        self.n, self._write = 0, cache.write
        cache.write = self

    def __call__(self, *a, **kw):
        self.n += 1
        return self._write(*a, **kw)


def _sessions(eng: DitEngine, variants: list[tuple[str, str]]) -> dict:
    """(kv layout, kv_write) → (every chunk's latent bytes, the core's K/V writes), in one engine
    switching between sessions as ab-engine does."""
    out = {}
    for layout, write in variants:
        eng.kv_layout, eng.kv_write = layout, write
        writes = _CountingWrites(eng.cache)
        out[(layout, write)] = (session_bytes(eng, "h1f", CHUNKS), writes.n)
        eng.cache.write = writes._write
    return out


VARIANTS = [(layout, write) for layout in ("paged", "window") for write in ("copy", "graph")]


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_engine_bytes_equal_the_core_writing_them(mode):
    eng = DitEngine(_cfg(mode=mode), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    out = _sessions(eng, VARIANTS)
    copy = out[("paged", "copy")][0]
    layers = eng.cfg.model.num_layers
    for (layout, write), (chunks, writes) in out.items():
        assert chunks == copy, (layout, write)
        # 5 forwards a chunk; with the switch on, no K/V reach the core to be written
        assert writes == (0 if write == "graph" else CHUNKS * 5 * layers), (layout, write, writes)
    if mode == "compiled":
        # a switch setting's first chunk may trace its graphs; no chunk after it compiles anything
        per_chunk = eng.compile_stats()["compiles_per_chunk"]
        assert len(per_chunk) == CHUNKS * len(VARIANTS), per_chunk
        for v in range(len(VARIANTS)):
            assert per_chunk[v * CHUNKS + 1 : (v + 1) * CHUNKS] == [0] * (CHUNKS - 1), (VARIANTS[v], per_chunk)


def _rank(group: RankGroup, cfg) -> dict:
    eng = DitEngine(override(cfg, parallel={"sp": group.size}), group=group, device=torch.device("cpu"), seed=3)
    out = _sessions(eng, [("window", "copy"), ("window", "graph"), ("paged", "graph")])
    return {"/".join(k): v for k, v in out.items()}


@pytest.mark.parametrize("sp", [2, 4])
def test_sp_ranks_keep_the_core_write_and_match_one_rank(sp):
    """Under SP the K/V reach their heads' ranks in the core's all-to-all: the core writes them,
    with the switch on or off, and every rank gives the same bytes, within SP's tolerance of one."""
    one = run_ranks(_rank, 1, _cfg())[0]
    ranks = run_ranks(_rank, sp, _cfg())
    layers = _cfg().model.num_layers
    for r in ranks:
        for key, (chunks, writes) in r.items():
            assert writes == CHUNKS * 5 * layers, key
            assert chunks == r["window/copy"][0], key
    assert one["window/graph"][1] == 0 and one["window/graph"][0] == one["window/copy"][0]
    assert_ranks_match([r["window/graph"][0] for r in ranks], ranks[0]["window/graph"][0],
                       one["window/graph"][0], 1e-4)


def test_candidate_sets_the_switch_and_refuses_its_conflicts():
    cfg = C.configure(["H1f"], load_preset("tiny"))
    assert cfg.runtime.kv_write == "graph" and C.get("H1f").gate == "exact"
    for other in ("H1e", "H6d:emulated"):
        with pytest.raises(HarnessError, match="conflict"):
            C.configure(["H1f", other], load_preset("tiny"))


def test_deferred_commits_of_interleaved_sessions_store_into_their_own_blocks():
    """With H5b a session's commit pass runs at the engine's next call — here the other session's
    chunk — so the K/V the graph stores must go by the committing session's block ids, not the
    caller's: two window-layout sessions in turn give the inline, copying engine's bytes."""
    def interleaved(kv_write: str, commit: str) -> list[list[bytes]]:
        cfg = override(_cfg(), runtime={"kv_write": kv_write, "commit": commit, "kv_layout": "window"},
                       cache={"max_sessions": 2})
        eng = DitEngine(cfg, group=RankGroup.single(), device=torch.device("cpu"), seed=3)
        return interleaved_bytes(eng, "h1f", CHUNKS)

    assert interleaved("graph", "deferred") == interleaved("copy", "inline")
