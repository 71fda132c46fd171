"""FA3 and FP8 on a Hopper GPU with the fa3-fwd wheel (skipped elsewhere): bf16 FA3 against
float64 attention and SDPA, its LSE for the paged walk, the FP8 variants' errors (printed, and
bounded), the emulation's fidelity to the FP8 kernel, and FP8 linear layers eager and compiled."""

from __future__ import annotations

import pytest
import torch

from harness.engine import attention as A
from harness.engine import fa3

pytestmark = pytest.mark.skipif(fa3.unavailable_reason("cuda") is not None,
                                reason=fa3.unavailable_reason("cuda") or "")


def _qkv(sq=1024, sk=4096, h=8, d=128, seed=0, v_offset=0.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # token-major storage, (1, H, S, D) views: what the engine hands the dense kernels
    q, k, v = (torch.randn(s, h, d, generator=g, device="cuda").to(torch.bfloat16) for s in (sq, sk, sk))
    v = (v.float() + v_offset).to(torch.bfloat16)
    return tuple(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))


def _ref(q, k, v):
    q, k, v = q.double(), k.double(), v.double()
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, -1) @ v


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_fa3_bf16_matches_float64_and_sdpa():
    q, k, v = _qkv()
    ref = _ref(q, k, v)
    o = A.dense("fa3")(q, k, v)
    assert o.shape == q.shape and o.dtype == torch.bfloat16
    assert _rel(o, ref) < 0.01
    assert _rel(o, A.dense("sdpa")(q, k, v)) < 0.01


def test_fa3_writes_into_a_given_buffer_bit_identically():
    """H1d's in-place write: the same kernel with the same arguments as flash_attn_func, so the
    same bytes, in the buffer it was given (token-major storage, a (1, H, Sq, D) view)."""
    q, k, v = _qkv()
    assert "fa3" in A.WRITES_INTO and A.AttentionChoice(dense="fa3").writes_into
    slot = A.OutputBuffers().take("self_attention", q[0].transpose(0, 1))
    o = A.writing_into(A.dense("fa3"), slot)(q, k, v)
    assert o.data_ptr() == slot.rows.data_ptr()
    assert torch.equal(o, A.dense("fa3")(q, k, v))
    assert torch.equal(A.settle(A._shd(o), slot), A.dense("fa3")(q, k, v)[0].transpose(0, 1).reshape(q.shape[2], -1))


def test_fa3_append_kv_fills_the_span_and_attends_over_it():
    """H1e's kernel: given the visible span whose tail is the chunk's, it writes the chunk's K/V
    there (bit for bit what the copy writes, V strided as the engine's split leaves it) and attends
    over the span. Whether its result is the plain kernel's bytes is printed; it is bounded."""
    sq, kept, h, d = 1024, 3072, 8, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(sq, h, d, generator=g, device="cuda").to(torch.bfloat16)
    kv = torch.randn(sq, 2 * h * d, generator=g, device="cuda").to(torch.bfloat16)
    k_new, v_new = (x.view(sq, h, d) for x in kv.split(h * d, dim=-1))  # strided rows, as in the engine
    span = [torch.randn(kept + sq, h, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2)]
    copied = [x.clone() for x in span]
    copied[0][kept:].copy_(k_new)
    copied[1][kept:].copy_(v_new)
    kept_t = torch.tensor([kept], dtype=torch.int32, device="cuda")
    o = fa3.fa3_bf16_append(q, span[0], span[1], k_new, v_new, kept_t)
    assert torch.equal(span[0], copied[0]) and torch.equal(span[1], copied[1])
    plain = A._shd(A.dense("fa3")(*(A._bhsd(x) for x in (q, *copied))))
    print(f"append vs plain FA3: bit-identical {torch.equal(o, plain)}, rel-L2 {_rel(o, plain):.2e}")
    assert _rel(o, plain) < 1e-3
    out = torch.empty_like(q)
    again = fa3.fa3_bf16_append(q, span[0], span[1], k_new, v_new, kept_t, out=out)
    assert again.data_ptr() == out.data_ptr() and torch.equal(again, o)


def test_fa3_partial_lse_and_paged_walk():
    q, k, v = _qkv(sq=256, sk=1024)
    o, lse = fa3.fa3_partial(q, k, v)
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    torch.testing.assert_close(lse.reshape(1, q.shape[1], -1)[..., : q.shape[2]].double(), s.logsumexp(-1), atol=2e-3, rtol=0)
    bs = 64
    kp, vp = (x[0].transpose(0, 1).reshape(-1, bs, *x.shape[1:2], x.shape[-1]) for x in (k, v))
    ids = torch.arange(kp.shape[0], device="cuda")
    old = A.PAGED_PARTIAL_CUDA
    try:
        A.PAGED_PARTIAL_CUDA = "fa3"
        paged = A.paged_attention(q[0].transpose(0, 1), kp, vp, ids, attend=None, group_blocks=4)
    finally:
        A.PAGED_PARTIAL_CUDA = old
    assert _rel(paged.transpose(0, 1).unsqueeze(0), _ref(q, k, v)) < 0.01


@pytest.mark.parametrize("name", ["fa3-fp8", "fa3-fp8-smooth"])
@pytest.mark.parametrize("v_offset", [0.0, 3.0])
def test_fa3_fp8_error_and_emulation_fidelity(name, v_offset):
    from harness.experiments.replay.op_backends_fa3 import emulate_fp8_attention

    q, k, v = _qkv(v_offset=v_offset)
    ref = _ref(q, k, v)
    o = A.dense(name)(q, k, v)
    err = _rel(o, ref)
    emu = emulate_fp8_attention(q, k, v, "qkvp", smoothed=name.endswith("smooth"))
    gap = _rel(o, emu)
    print(f"{name} v_offset={v_offset}: rel-L2 vs fp64 {err:.4f}, emulation {_rel(emu, ref):.4f}, kernel vs emulation {gap:.4f}")
    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all()
    assert err < 0.1
    assert gap < err  # the emulation models the kernel's roundings closer than the error itself


def test_fp8_linear_cuda_eager_and_compiled():
    from harness.engine.fp8_linear import Fp8Linear

    lin = torch.nn.Linear(5120, 13824, dtype=torch.bfloat16, device="cuda").requires_grad_(False)
    x = torch.randn(4680, 5120, dtype=torch.bfloat16, device="cuda")
    ref = torch.nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double())
    f8 = Fp8Linear(lin)
    y = f8(x)
    assert y.dtype == torch.bfloat16 and _rel(y, ref) < 0.06
    yc = torch.compile(lambda t: f8(torch.nn.functional.gelu(t, approximate="tanh")))(x)
    ye = f8(torch.nn.functional.gelu(x, approximate="tanh"))
    assert _rel(yc, ye) < 0.02  # fused amax/cast vs eager: the same scales up to rounding
