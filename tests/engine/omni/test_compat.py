"""The adaptations in harness/engine/omni/compat.py do what their reasons say."""

from __future__ import annotations

import pytest
import torch

from harness.engine.omni import compat


def test_rotary_fix_broadcasts_over_heads(lingbot):
    from vllm_omni.diffusion.layers.rope import RotaryEmbeddingWan

    g = torch.Generator().manual_seed(0)
    seq, heads, dim = 5, 3, 8
    x = torch.randn(1, seq, heads, dim, generator=g)
    angle = torch.randn(seq, dim // 2, generator=g)
    rope = RotaryEmbeddingWan(is_neox_style=False, half_head_dim=True)
    with pytest.raises(RuntimeError):  # the upstream bug: [S, D/2] cos/sin against [B, S, H, D/2]
        rope(x, angle.cos(), angle.sin())
    assert compat.fix_rotary(torch.nn.Sequential(rope)) == 1
    # interleaved pairs rotated by the angle: x as complex numbers times e^{iθ}, per head
    want = torch.view_as_real(torch.view_as_complex(x.view(1, seq, heads, dim // 2, 2))
                              * torch.polar(torch.ones_like(angle), angle)[None, :, None]).flatten(-2)
    torch.testing.assert_close(rope(x, angle.cos(), angle.sin()), want)


def test_cpu_platform_runs_vllm_omni_sdpa(omni_dist):
    from vllm_omni.diffusion.attention.layer import Attention

    with compat.vllm_config():
        attn = Attention(num_heads=2, head_size=8, causal=False, softmax_scale=8 ** -0.5, qkv_layout="BSND",
                         skip_sequence_parallel=True)
    assert attn.attn_backend.get_name() == "SDPA"
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, n, 2, 8, generator=g) for n in (4, 6, 6))
    want = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    torch.testing.assert_close(attn(q, k, v), want)
