"""H1d and H1e on CPU. H1d: the attention cores' results in persistent buffers
(``attention.OutputBuffers``) are the bytes of fresh results on 1, 2 and 4 ranks, through window
saturation and eviction, with a kernel that copies its result in and with one that writes it in
place (FA3's ``out=`` contract, here a CPU kernel that keeps it); the buffers are stable,
static-address views. H1e: a kernel that writes the chunk's K/V into the window slot itself (FA3's
append-KV contract, kept by a CPU kernel) leaves the cache and the latents byte for byte as the
core's copy does, through eviction and chunks dropped before their commit, on 1, 2 and 4 ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import get_static_address_type

from harness import candidates as C
from harness.config import load_preset, override
from harness.engine import attention as A
from harness.engine.conditions import SessionConditions
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup, run_ranks
from harness.engine.kv_fp8 import Fp8KVCache
from harness.engine.kvcache import PagedKVCache

#: saturated at chunk 2, evicting at chunks 3 and 4 (as in test_dit_sp)
CACHE = {"sink_frames": 3, "window_frames": 9}
CHUNKS = 5
ACTIONS = [["W", "WJ", ""], ["D", "", "I"], ["", "", ""], ["SL", "K", "A"]]
INTO = "math-into"  # a CPU kernel with FA3's out= contract, registered for this module only


def _math_into(q, k, v, *, out=None):
    r = F.scaled_dot_product_attention(q, k, v)
    if out is None:
        return r
    assert out.shape == r.shape
    return out.copy_(r)


def _math_append(q, k, v, k_new, v_new, kept, *, out=None):
    """FA3's append-KV contract: k_new, v_new into the span's last tokens, then attention over it."""
    n = k_new.shape[0]
    assert int(kept) == k.shape[0] - n  # a host read: fine in a CPU test, never in the engine
    k[k.shape[0] - n :].copy_(k_new)
    v[v.shape[0] - n :].copy_(v_new)
    r = A._shd(_math_into(A._bhsd(q), A._bhsd(k), A._bhsd(v)))
    return r if out is None else out.copy_(r)


def _register() -> None:
    A.register_dense(INTO, _math_into, writes_into=True)
    A.APPEND_KV[INTO] = _math_append


@pytest.fixture(scope="module", autouse=True)
def _into_kernel():
    _register()
    yield
    A.DENSE.pop(INTO)
    A.WRITES_INTO.discard(INTO)
    A.APPEND_KV.pop(INTO)


def _cfg(sp: int = 1):
    return override(load_preset("tiny"), parallel={"sp": sp}, cache=CACHE)


def test_slots_are_persistent_static_views():
    bufs = A.OutputBuffers()
    q = torch.randn(12, 4, 8)
    a, b = bufs.take("self_attention", q), bufs.take("self_attention", q.clone())
    assert a is b and a.rows.shape == q.shape and a.flat.shape == (12, 32)
    assert a.flat.data_ptr() == a.rows.data_ptr()  # one storage, two shapes
    assert get_static_address_type(a.flat) == "unguarded"
    c = bufs.take("cross_attention", q)
    assert c.rows.data_ptr() != a.rows.data_ptr() and len(bufs) == 2
    assert bufs.take("self_attention", q[:6]).rows.shape == (6, 4, 8) and len(bufs) == 3


def test_settle_copies_only_results_from_elsewhere():
    slot = A.OutputBuffers().take("self_attention", torch.zeros(5, 2, 3))
    r = torch.randn(5, 2, 3)
    flat = A.settle(r, slot)
    assert flat is slot.flat and torch.equal(slot.rows, r)
    slot.rows.fill_(7.0)  # a kernel that wrote in place: nothing is copied over it
    assert torch.equal(A.settle(slot.rows, slot), torch.full((5, 6), 7.0))


def test_writing_into_hands_the_kernel_the_slot():
    slot = A.OutputBuffers().take("cross_attention", torch.zeros(6, 2, 4))
    q, k, v = (torch.randn(1, 2, n, 4) for n in (6, 10, 10))
    ref = _math_into(q, k, v)
    o = A.writing_into(_math_into, slot)(q, k, v)
    assert o.data_ptr() == slot.rows.data_ptr() and torch.equal(o, ref)
    assert torch.equal(A.settle(A._shd(o), slot), ref[0].transpose(0, 1).reshape(6, 8))
    named = lambda q, k, v, **kw: _math_into(q, k, v, **kw)  # noqa: E731
    named._capture_name = "sdpa"
    assert A.writing_into(named, slot)._capture_name == "sdpa"
    assert A.AttentionChoice(dense=INTO).writes_into and not A.AttentionChoice(dense="sdpa").writes_into


def _sessions(eng: DitEngine, variants: list[tuple[str, ...]]) -> dict:
    """(kv layout, dense kernel, attention_out[, kv_write]) → every chunk's latent bytes, in one
    engine switching between sessions as ab-engine does."""
    out = {}
    for variant in variants:
        layout, dense, how, *write = variant
        eng.kv_layout, eng.attention, eng.attention_out = layout, dense, how
        eng.kv_write = write[0] if write else "copy"
        s = eng.start_session(SessionConditions(prompt="h1d", seed=11))
        out[variant] = [eng.generate_chunk(s, ACTIONS[c % 4]).numpy().tobytes() for c in range(CHUNKS)]
        eng.end_session(s)
    return out


def test_engine_bytes_equal_fresh_results_one_rank():
    eng = DitEngine(_cfg(), group=RankGroup.single(), device=torch.device("cpu"), seed=3)
    # the appending kernel, alone and writing its result into a buffer; "append" with a kernel
    # that cannot (sdpa) and on the paged layout keeps the copy
    variants = [("window", INTO, how, "append") for how in ("fresh", "static")]
    variants += [("window", "sdpa", "fresh", "append"), ("paged", INTO, "fresh", "append")]
    variants += [(layout, dense, how) for layout in ("paged", "window") for dense in ("sdpa", INTO)
                 for how in ("fresh", "static")]
    out = _sessions(eng, variants)
    fresh = out[("paged", "sdpa", "fresh")]
    assert len(out) == len(variants)
    for key, chunks in out.items():
        assert chunks == fresh, key
    assert eng.attention_out == "static" and len(eng.outputs) == 2  # one slot per role
    kept = eng.outputs
    eng.attention_out = "fresh"
    assert eng.outputs is None
    # switched back (ab-engine does, every other session): the same buffers, the same static
    # addresses, so no CUDA graph reading them is recorded again
    eng.attention_out = "static"
    assert eng.outputs is kept and len(kept) == 2


def _rank(group: RankGroup, cfg) -> dict:
    _register()  # a rank is a process of its own
    eng = DitEngine(override(cfg, parallel={"sp": group.size}), group=group, device=torch.device("cpu"), seed=3)
    out = _sessions(eng, [("window", INTO, "fresh"), ("window", INTO, "static"), ("paged", "sdpa", "static"),
                          ("window", INTO, "static", "append")])
    # numpy bytes, not tensors: run_ranks' pickler shares tensor memory by fd, which races the exit
    return {"/".join(k): v for k, v in out.items()}


@pytest.mark.parametrize("sp", [2, 4])
def test_sp_ranks_bytes_equal_fresh_results(sp):
    """Under SP the self-attention result comes from the all-to-all and is copied into the slot;
    the cross-attention kernel writes into its slot; the appending kernel writes each rank's heads. Every rank, every variant: the same bytes as
    fresh results on those ranks, and within SP's tolerance of one rank."""
    one = run_ranks(_rank, 1, _cfg())[0]
    results = run_ranks(_rank, sp, _cfg())
    for r in results:
        assert r == results[0]
        fresh = r["window/math-into/fresh"]
        assert r["window/math-into/static"] == fresh and r["paged/sdpa/static"] == fresh
        assert r["window/math-into/static/append"] == fresh
    for a, b in zip(results[0]["window/math-into/static"], one["window/math-into/fresh"]):
        x, y = np.frombuffer(a, np.float32), np.frombuffer(b, np.float32)
        assert np.linalg.norm(x - y) / np.linalg.norm(y) <= 1e-4


def test_candidate_sets_the_switch():
    cfg = C.configure(["H1d"], load_preset("tiny"))
    assert cfg.runtime.attention_out == "static"
    assert C.get("H1d").gate == "exact"


def test_appended_kv_is_what_the_copy_writes():
    """Chunk by chunk — through saturation, eviction and two chunks dropped before their commit —
    a slot filled by the appending kernel holds the bytes a slot filled by ``write`` holds, and the
    kept length it is given is the visible span less the chunk."""
    cfg = override(load_preset("tiny"), parallel={"sp": 1}, cache={"max_sessions": 2})
    caches = [PagedKVCache.from_config(cfg, sp=1, dtype=torch.float32, device=torch.device("cpu")) for _ in range(2)]
    sessions = [c.open("window") for c in caches]
    g = torch.Generator().manual_seed(0)
    shape = (cfg.tokens_per_chunk, cfg.model.num_heads, cfg.model.head_dim)
    for chunk in range(14):
        for c, s in zip(caches, sessions):
            c.begin_chunk(s, cfg.video.frames_per_chunk)
        assert caches[1].can_append(sessions[1])
        kept = (sessions[1].visible_blocks * caches[1].block_size) - shape[0]
        assert sessions[1].kept_tokens.dtype == torch.int32 and int(sessions[1].kept_tokens) == kept
        for layer in range(cfg.model.num_layers):
            q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
            caches[0].write(layer, sessions[0], k, v)
            want = caches[0].attend(layer, sessions[0], q, A.gather_attention, attend=_math_into, group_blocks=0)
            got = caches[1].attend_appending(layer, sessions[1], q, k, v, append=_math_append)
            assert torch.equal(got, want), f"chunk {chunk} layer {layer}"
            for pools in ("k", "v"):
                a, b = (getattr(c, pools)[layer][s.visible_span] for c, s in zip(caches, sessions))
                assert torch.equal(a, b)
        if chunk not in (4, 8):
            for c, s in zip(caches, sessions):
                c.commit(s)
    paged = caches[0].open("paged")
    caches[0].begin_chunk(paged, cfg.video.frames_per_chunk)
    assert not caches[0].can_append(paged) and not Fp8KVCache.appends


def test_appender_only_where_it_applies():
    plain = A.AttentionChoice(kv_path="gather", dense=INTO)
    assert plain.appender(A.gather_attention) is _math_append
    assert A.AttentionChoice(kv_path="paged", dense=INTO).appender(A.paged_attention) is None
    assert A.AttentionChoice(kv_path="gather", dense="sdpa").appender(A.gather_attention) is None

    def wrapped(*a, **kw):  # what the capture hook puts in the KV path table while it is on
        return A.gather_attention(*a, **kw)

    wrapped._capture_of = A.gather_attention
    assert plain.appender(wrapped) is None
    cfg = C.configure(["H1e"], load_preset("tiny"))
    assert (cfg.runtime.kv_layout, cfg.runtime.kv_write) == ("window", "append")
    with pytest.raises(Exception, match="conflict"):
        C.configure(["H1e", "H1a"], load_preset("tiny"))
