"""FLOP formulas on shapes whose counts are worked out by hand."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from harness.config import load_preset
from harness.hooks import flops as fl


def test_linear_and_matmul_family():
    assert fl.linear_flops((2, 3, 8), (5, 8)) == 2 * 6 * 8 * 5
    assert fl.op_flops("aten::mm", [(6, 8), (8, 5)]) == (2 * 6 * 8 * 5, fl.MATMUL)
    assert fl.op_flops("aten.addmm.default", [(5,), (6, 8), (8, 5)]) == (2 * 6 * 8 * 5, fl.MATMUL)
    assert fl.op_flops("bmm", [(4, 8, 16), (4, 16, 12)])[0] == 2 * 4 * 8 * 16 * 12
    assert fl.op_flops("aten::baddbmm", [(4, 8, 12), (4, 8, 16), (4, 16, 12)])[0] == 2 * 4 * 8 * 16 * 12
    # broadcasting matmul and 1-D operands
    assert fl.matmul_flops((2, 3, 4, 5), (5, 6)) == 2 * 24 * 5 * 6
    assert fl.matmul_flops((7,), (7, 3)) == 2 * 7 * 3
    assert fl.matmul_flops((2, 1, 4, 5), (3, 5, 6)) == 2 * 6 * 4 * 5 * 6


def test_shapes_or_tensors_give_the_same_count():
    a, b = torch.empty(3, 4, 5, device="meta"), torch.empty(3, 5, 2, device="meta")
    assert fl.op_flops("aten::bmm", [a, b]) == fl.op_flops("aten::bmm", [(3, 4, 5), (3, 5, 2)])


def test_conv3d_with_padding_counts_through_the_output_size():
    # (1, 2, 3, 5, 5) * (4, 2, 3, 3, 3), padding 1: output (1, 4, 3, 5, 5) = 300 elements, each
    # a dot product of 2·27 terms.
    assert fl.conv_flops((1, 2, 3, 5, 5), (4, 2, 3, 3, 3), padding=1) == 2 * 300 * 2 * 27
    # no temporal padding (Wan's causal conv pads time explicitly): output T = 1
    assert fl.conv_flops((1, 2, 3, 5, 5), (4, 2, 3, 3, 3), padding=(0, 1, 1)) == 2 * 100 * 2 * 27
    # the explicit pad op itself is not FLOPs
    assert fl.op_flops("aten::constant_pad_nd", [(1, 2, 3, 5, 5), [1, 1]]) == (0, None)
    # groups divide the input channels each output sees
    assert fl.conv_flops((1, 4, 6, 6), (8, 2, 3, 3), groups=2) == 2 * (8 * 16) * 2 * 9
    # ATen's convolution signature
    args = [(1, 2, 3, 5, 5), (4, 2, 3, 3, 3), None, [1, 2, 2], [0, 1, 1], [1, 1, 1], False, [0, 0, 0], 1]
    assert fl.op_flops("aten::convolution", args) == (2 * (4 * 1 * 3 * 3) * 2 * 27, fl.CONV)


def test_conv_output_size_matches_torch():
    x = torch.empty(1, 2, 7, 9)
    for k, s, p, d in itertools.product((1, 2, 3), (1, 2), (0, 1, 2), (1, 2)):
        w = torch.empty(3, 2, k, k)
        try:
            y = F.conv2d(x, w, stride=s, padding=p, dilation=d)
        except RuntimeError:
            continue
        assert fl.conv_output_spatial((7, 9), (k, k), s, p, d) == tuple(y.shape[2:]), (k, s, p, d)
        assert fl.conv_flops(x, w, s, p, d) == 2 * y.numel() * 2 * k * k


def test_transposed_conv():
    x, w = torch.empty(1, 4, 5, 5), torch.empty(4, 3, 2, 2)  # (Cin, Cout/g, k, k)
    y = F.conv_transpose2d(x, w, stride=2)
    assert fl.conv_output_spatial((5, 5), (2, 2), 2, 0, 1, True, 0) == tuple(y.shape[2:])
    assert fl.conv_flops(x, w, stride=2, transposed=True) == 2 * (4 * 25) * 3 * 4


def test_attention_with_sq_not_skv():
    q, k = (1, 4, 8, 16), (1, 4, 12, 16)
    expected = 4 * 8 * 12 * 4 * 16
    assert fl.attention_flops(q, k, k) == expected
    assert fl.op_flops("aten::_scaled_dot_product_flash_attention_for_cpu", [q, k, k]) == (expected, fl.ATTENTION)
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable"):
        assert fl.op_flops(f"aten::{name}", [q, k, k, None, False])[0] == expected
    # GQA: the query heads count
    assert fl.attention_flops((1, 8, 8, 16), (1, 2, 12, 16)) == 2 * expected
    # value head dim different from the query/key one
    assert fl.attention_flops(q, k, (1, 4, 12, 32)) == 2 * 4 * 8 * 12 * (16 + 32)


def test_flash_forward_dense_varlen_and_paged():
    q, k = (1, 8, 4, 16), (1, 12, 4, 16)  # (B, S, H, D)
    expected = 4 * 8 * 12 * 4 * 16
    args = [q, k, k, None, None, 8, 12, 0.0, False, False]
    assert fl.op_flops("aten::_flash_attention_forward", args)[0] == expected
    # packed varlen, one sequence: (total, H, D) with max lengths
    args = [(8, 4, 16), (12, 4, 16), (12, 4, 16), (2,), (2,), 8, 12, 0.0, False, False]
    assert fl.op_flops("aten::_flash_attention_forward", args)[0] == expected
    # paged K (num_blocks, block_size, H, D): the effective length is max_k, not the pool
    args = [q, (50, 4, 4, 16), (50, 4, 4, 16), None, None, 8, 12, 0.0, False, False]
    assert fl.op_flops("aten::_flash_attention_forward", args, {"block_table": (1, 3)})[0] == expected
    eff = [q, k, k, None, None, None, None, None, 0.0, 0]
    assert fl.op_flops("aten::_efficient_attention_forward", eff)[0] == expected


def test_categories():
    c = fl.categorize
    assert c(fl.MATMUL) == "linear"
    assert c(fl.MATMUL, in_sdpa=True) == "attention"
    assert c(fl.MATMUL, role="self_attention") == "self_attention"
    assert c(fl.MATMUL, role="cross_attention", in_sdpa=True) == "cross_attention"
    assert c(fl.MATMUL, role="ffn") == "linear"  # other roles only label
    assert c(fl.ATTENTION) == "attention"
    assert c(fl.ATTENTION, role="cross_attention") == "cross_attention"
    assert c(fl.CONV) == "vae_conv"
    assert c(fl.CONV, stage="dit") == "linear"  # patch embedding
    assert c(None, role="self_attention") == "other"
    assert set(fl.CATEGORIES) >= {"linear", "self_attention", "cross_attention", "vae_conv", "other"}


def test_mfu_and_the_stated_peak_reproduce_design_section_12():
    """DiT FLOPs of one steady chunk at 480×832 from the model shapes, over 4 GPUs × 678 ms."""
    cfg = load_preset("lingbot-480x832")
    m = cfg.model
    d, n = m.dim, cfg.tokens_per_chunk
    per_token = 2 * (4 * d * d + 2 * d * d + 2 * d * m.ffn_dim + 4 * d * d)  # self qkvo, cross q/o, ffn, camera ×4
    linear = per_token * n
    self_attn = fl.attention_flops((m.num_heads, n, m.head_dim), (m.num_heads, cfg.max_kv_tokens, m.head_dim))
    cross = fl.attention_flops((m.num_heads, n, m.head_dim), (m.num_heads, m.text_len, m.head_dim))
    chunk = 5 * m.num_layers * (linear + self_attn + cross)
    assert fl.mfu(chunk, 4 * 0.678, fl.PEAKS["h200-bf16"]) == pytest.approx(0.49, abs=0.005)
    with pytest.raises(ValueError):
        fl.mfu(1.0, 0.0, 1.0)
