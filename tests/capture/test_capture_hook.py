"""``--hooks capture``: grammar, one file per distinct signature, effective K/V, hashes, budget."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from harness.engine import attention as A
from harness.errors import HarnessError
from harness.hooks import DEFAULT_CAPTURE_BUDGET, HookSet, parse_hooks
from harness.hooks.capture import load_capture, read_index, sha256

from capture_helpers import capture_run


@pytest.mark.parametrize("spec,budget,canonical", [
    ("capture", DEFAULT_CAPTURE_BUDGET, "capture"),
    ("capture=64M", 64 << 20, "capture=64M"),
    ("capture=1.5G", 3 << 29, "capture=1536M"),
    ("capture=512k", 512 << 10, "capture=512K"),
    ("capture=4096", 4096, "capture=4K"),
    ("capture=1000", 1000, "capture=1000"),
    ("capture=2GiB", 2 << 30, "capture=2G"),
])
def test_parse_capture(spec, budget, canonical):
    h = parse_hooks(f"nvtx,{spec}")
    assert h.capture == budget
    assert canonical in h.items()
    assert parse_hooks(str(h)) == h
    assert HookSet().capture is None and "capture" not in str(HookSet())


@pytest.mark.parametrize("spec", ["capture=lots", "capture=-1M", "capture=1T", "capture=inf", "capture=nan", "capture=", "capture,capture"])
def test_bad_capture_specs_are_one_line_errors(spec):
    with pytest.raises(HarnessError) as e:
        parse_hooks(spec)
    assert "\n" not in str(e.value)


def _saved(run):
    return [r for r in read_index(run["dir"]) if r["status"] == "saved"]


def test_one_file_per_distinct_signature(captured):
    recs = read_index(captured["dir"])
    assert recs and all(r["status"] == "saved" for r in recs)  # 256M holds the whole tiny run
    sigs = Counter(r["signature"] for r in recs)
    assert max(sigs.values()) == 1
    files = sorted(p.name for p in (captured["dir"] / "capture").glob("*.safetensors"))
    assert files == sorted(r["file"] for r in recs)
    ops = Counter(r["op"] for r in recs)
    assert {"self_attention", "cross_attention", "linear", "conv3d", "convert_uint8"} <= set(ops)
    # two sessions of three chunks ran; the second added no new signature, layers deduplicate
    assert all(r["context"]["session"] == 0 for r in recs)
    assert all(r["context"].get("layer", 0) == 0 for r in recs)
    rep = captured["report"]["capture"]
    assert rep["saved"] == len(recs) and rep["skipped"] == 0 and rep["errors"] == []


def test_self_attention_holds_the_effective_kv_per_phase(captured):
    recs = [r for r in _saved(captured) if r["op"] == "self_attention"]
    cfg = captured["cfg"]
    m = cfg.model
    by_phase = {}
    for r in recs:
        by_phase.setdefault(r["phase"], []).append(r)
        assert r["role"] == "self_attention" and r["context"]["role"] == "self_attention"
        assert r["context"]["step"] in (0, 4)  # first denoise step, or the commit pass
        k = r["tensors"]["k"]["shape"]
        assert r["tensors"]["q"]["shape"] == [cfg.tokens_per_chunk, m.num_heads, m.head_dim]
        assert r["tensors"]["block_ids"]["shape"] == [k[0] // cfg.block_size]
        assert r["meta"]["block_size"] == cfg.block_size
    # K grows with the chunk (cache + this chunk), as the engine reports it, in both phases
    want = captured["kv_tokens"][0]
    for phase in ("denoise", "commit"):
        assert [r["tensors"]["k"]["shape"][0] for r in by_phase[phase]] == want


def test_saved_tensors_match_their_hashes_and_context(captured):
    for r in _saved(captured):
        tensors, meta = load_capture(captured["dir"] / "capture" / r["file"])
        assert set(tensors) == set(r["tensors"])
        for name, t in tensors.items():
            d = r["tensors"][name]
            assert list(t.shape) == d["shape"] and str(t.dtype).removeprefix("torch.") == d["dtype"]
            assert sha256(t) == d["sha256"]
        assert meta == r["meta"]
        assert {"session", "epoch", "chunk", "stage"} <= set(r["context"]) and r["phase"] != "other"
    conv = next(r for r in _saved(captured) if r["op"] == "conv3d" and r["phase"] == "decode")
    assert {"input", "weight"} <= set(conv["tensors"]) and "padding" in conv["meta"]
    lin = next(r for r in _saved(captured) if r["op"] == "linear")
    assert lin["meta"]["weight_saved"] is True  # tiny weights are cheap
    cvt = next(r for r in _saved(captured) if r["op"] == "convert_uint8")
    assert cvt["phase"] == "convert" and cvt["tensors"]["frames"]["shape"][0] == 3


def test_registries_are_wrapped_inside_the_hook_and_restored_after(tmp_path):
    from harness.hooks.active import activate

    before = {id(reg): dict(reg) for reg in (A.DENSE, A.KV_PATHS)}
    with activate("capture", out_dir=tmp_path, label="t0"):
        for reg in (A.DENSE, A.KV_PATHS):
            assert all(getattr(fn, "_capture_of", None) is before[id(reg)][name] for name, fn in reg.items())
    for reg in (A.DENSE, A.KV_PATHS):
        assert reg == before[id(reg)]


def test_small_budget_keeps_the_first_signatures_and_records_the_rest(tmp_path, captured):
    budget = 150_000
    run = capture_run(tmp_path, f"capture={budget}", sessions=1, chunks=2)
    recs = read_index(tmp_path)
    saved = [r for r in recs if r["status"] == "saved"]
    skipped = [r for r in recs if r["status"] == "skipped"]
    files = list((tmp_path / "capture").glob("*.safetensors"))
    assert sum(p.stat().st_size for p in files) <= budget
    assert sum(r["bytes"] for r in saved) == sum(p.stat().st_size for p in files)
    assert len(files) == len(saved) > 0 and skipped
    assert recs[0]["status"] == "saved"  # first come, first kept
    assert all(r["reason"] == "budget" and r["estimate_bytes"] > r["left_bytes"] for r in skipped)
    assert max(Counter(r["signature"] for r in recs).values()) == 1  # a skip is recorded once
    # the same signatures as the unbounded run, in the same order: the budget decides, not the ops seen
    full = [r["signature"] for r in read_index(captured["dir"]) if r["context"].get("chunk", 0) < 2]
    assert [r["signature"] for r in recs] == full
    assert run["report"]["capture"]["skipped"] == len(skipped)


def test_zero_budget_saves_nothing(tmp_path):
    capture_run(tmp_path, "capture=0", sessions=1, chunks=1)
    recs = read_index(tmp_path)
    assert recs and all(r["status"] == "skipped" for r in recs)
    assert not list((tmp_path / "capture").glob("*.safetensors"))


def test_index_lines_are_json(captured):
    for line in (captured["dir"] / "capture" / "index.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert rec["op_id"].startswith(rec["op"] + "-")
