"""The dispatch recorder against hand counts, on CPU and on the meta device."""

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.hooks import context as hctx
from harness.hooks.dispatch import DispatchRecorder, count_flops, merge_process_files

TOKENS, DIM, HEADS, KV = 6, 32, 4, 10
HD = DIM // HEADS


class Tiny(nn.Module):
    """Linear → SDPA over a longer K/V (Sq ≠ Skv) → Conv3d with padding."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, DIM)
        self.conv = nn.Conv3d(2, 4, 3, padding=1)

    def forward(self, x, kv, video):
        q = self.proj(x).view(1, TOKENS, HEADS, HD).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, kv, kv)
        return a, self.conv(video)


def hand_count():
    linear = 2 * TOKENS * 16 * DIM
    attention = 4 * TOKENS * KV * HEADS * HD
    conv = 2 * (4 * 3 * 5 * 5) * 2 * 27  # padding 1 keeps (3, 5, 5)
    return linear, attention, conv


def inputs(device, dtype):
    return (torch.randn(TOKENS, 16, device=device, dtype=dtype),
            torch.randn(1, HEADS, KV, HD, device=device, dtype=dtype),
            torch.randn(1, 2, 3, 5, 5, device=device, dtype=dtype))


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), ("meta", torch.float32), ("meta", torch.bfloat16)])
def test_totals_equal_hand_count_and_attention_is_counted_once(tmp_path, device, dtype):
    model = Tiny().to(device=device, dtype=dtype)
    args = inputs(device, dtype)
    path = tmp_path / "dispatch.jsonl"
    rec = DispatchRecorder(path)
    with torch.no_grad(), rec:
        model(*args)
    rec.close()
    linear, attention, conv = hand_count()
    cats = rec.flops_by_category()
    assert cats["linear"] == linear
    assert cats["attention"] == attention
    assert cats["vae_conv"] == conv
    assert rec.total_flops == linear + attention + conv

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == rec.calls
    assert [r["seq"] for r in lines] == list(range(rec.calls))
    for r in lines:
        assert {"op", "shapes", "dtypes", "strides", "out", "flops", "cat"} <= r.keys()
        assert len(r["shapes"]) == len(r["dtypes"]) == len(r["strides"])
    att = [r for r in lines if r["cat"] == "attention"]
    if device == "cpu":  # one fused kernel
        assert [r["op"] for r in att] == ["aten._scaled_dot_product_flash_attention_for_cpu.default"]
    else:  # the math path decomposed: its two bmm carry the attention FLOPs, marked as inside SDPA
        assert [r["op"] for r in att] == ["aten.bmm.default"] * 2
        assert all(r.get("sdpa") for r in att)
    assert sum(r["flops"] for r in att) == attention
    assert sum(r["flops"] for r in lines) == rec.total_flops
    addmm = next(r for r in lines if r["op"].startswith("aten.addmm"))
    assert addmm["shapes"] == [[DIM], [TOKENS, 16], [16, DIM]]
    assert addmm["strides"][2] == [1, 16]  # the transposed weight view
    assert addmm["dtypes"] == [str(dtype).removeprefix("torch.")] * 3


def test_phase_context_roles_and_paged_bmm_blocks():
    """A paged attention written as bmm blocks counts as self-attention under its role; the
    projections outside the role stay linear; records carry the phase."""
    q_proj = nn.Linear(DIM, DIM, bias=False)
    x = torch.randn(TOKENS, DIM)
    pool = torch.randn(5, 4, HEADS, HD)  # 5 blocks of 4 tokens
    blocks = [0, 2, 3]
    rec = DispatchRecorder(group_by=("session", "chunk", "step", "layer", "role"))
    with rec:
        with hctx.phase(session=1, chunk=2, stage="dit"):
            for step in range(2):
                with hctx.phase(step=step), hctx.phase(layer=0):
                    q = q_proj(x).view(TOKENS, HEADS, HD).transpose(0, 1)  # (H, Sq, D)
                    with hctx.phase(role="self_attention"):
                        for b in blocks:
                            kb = pool[b].transpose(0, 1)  # (H, 4, D)
                            s = torch.bmm(q, kb.transpose(1, 2))
                            torch.bmm(s.softmax(-1), kb)
    skv = 4 * len(blocks)
    by = rec.flops_by("session", "chunk", "step")
    for step in range(2):
        assert by[(1, 2, step)]["self_attention"] == 4 * TOKENS * skv * HEADS * HD
        assert by[(1, 2, step)]["linear"] == 2 * TOKENS * DIM * DIM
    s = rec.summary(group_by=("step",))
    assert s["by_category"]["self_attention"] == 2 * 4 * TOKENS * skv * HEADS * HD
    assert {(r["step"], r["category"]) for r in s["phases"] if r["flops"]} == {
        (0, "linear"), (0, "self_attention"), (1, "linear"), (1, "self_attention")}
    assert not hctx.ACTIVE and hctx.current() == hctx.EMPTY


def test_records_carry_phase_fields(tmp_path):
    rec = DispatchRecorder(tmp_path / "d.jsonl")
    with rec, hctx.phase(session=0, epoch=0, chunk=3, stage="decode"):
        F.conv2d(torch.randn(1, 2, 4, 4), torch.randn(3, 2, 3, 3))
    rec.close()
    (conv,) = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()
               if "convolution" in line]
    assert conv["session"] == 0 and conv["chunk"] == 3 and conv["stage"] == "decode"
    assert conv["cat"] == "vae_conv" and conv["flops"] == 2 * (3 * 2 * 2) * 2 * 9


def test_conv_in_dit_stage_is_a_patch_embedding_gemm():
    conv = nn.Conv3d(4, 8, (1, 2, 2), stride=(1, 2, 2))
    rec = DispatchRecorder()
    with rec, hctx.phase(stage="dit"):
        conv(torch.randn(1, 4, 3, 4, 4))
    tokens = 3 * 2 * 2
    assert rec.flops_by_category()["linear"] == 2 * tokens * 8 * (4 * 4)
    assert rec.flops_by_category()["vae_conv"] == 0


def test_summary_only_mode_writes_nothing_and_count_flops(tmp_path):
    model = Tiny()
    _, rec = count_flops(model, *inputs("cpu", torch.float32))
    assert rec.path is None
    assert rec.total_flops == sum(hand_count())
    s = rec.summary()
    json.dumps(s)
    assert s["total_flops"] == rec.total_flops and s["calls"] == rec.calls
    assert s["by_op"]["aten.addmm.default"] == {"flops": hand_count()[0], "calls": 1}
    assert list(tmp_path.iterdir()) == []


def test_recorder_only_tracks_while_entered():
    assert not hctx.ACTIVE
    rec = DispatchRecorder()
    with rec:
        assert hctx.ACTIVE
    assert not hctx.ACTIVE
    with pytest.raises(ValueError):
        DispatchRecorder(group_by=("sesion",))


def test_phase_is_a_shared_nullcontext_when_off():
    assert not hctx.ACTIVE
    a, b = hctx.phase(layer=1), hctx.phase(chunk=2, role="self_attention")
    assert a is b
    with a:
        assert hctx.current() == hctx.EMPTY
    with pytest.raises(TypeError):
        hctx.phase(lyer=1)  # misspelt fields fail even when off


def test_merge_process_files(tmp_path):
    for label in ("dit0", "vae0"):
        rec = DispatchRecorder(tmp_path / f"dispatch.{label}.jsonl", process=label)
        with rec:
            torch.mm(torch.randn(2, 3), torch.randn(3, 4))
        rec.close()
    n = merge_process_files([(p, tmp_path / f"dispatch.{p}.jsonl") for p in ("dit0", "vae0")], tmp_path / "dispatch.jsonl")
    lines = [json.loads(line) for line in (tmp_path / "dispatch.jsonl").read_text().splitlines()]
    assert n == len(lines) and {r["proc"] for r in lines} == {"dit0", "vae0"}
    assert sum(r["flops"] for r in lines) == 2 * 2 * (2 * 3 * 4)


def test_a_failing_formula_is_reported_not_fatal(monkeypatch):
    from harness.hooks import flops as fl

    def broken(args, kwargs):
        raise IndexError("unexpected signature")

    monkeypatch.setitem(fl.OPS, "aten::mm", (fl.MATMUL, broken))
    rec = DispatchRecorder()
    with rec:
        torch.mm(torch.randn(2, 3), torch.randn(3, 4))
    assert rec.total_flops == 0
    assert rec.summary()["formula_errors"] == {"aten.mm.default": "IndexError: unexpected signature"}
