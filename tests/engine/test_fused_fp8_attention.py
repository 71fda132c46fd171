"""H6f's Triton kernel (engine/fused_fp8_attention.py) in the interpreter (on a GPU, on CUDA):
where the keys fit one block it rounds what the emulation (engine/fp8_fine.py) rounds, P·V-only
to float32 noise and ``qk-block`` within its one extra rounding (P to bf16); over many blocks its
error against the exact attention is the emulation's; it reads (1, H, S, D) views of token-major
storage in place and writes token-major; it refuses what it cannot run with one line; and H6f
picks it on CUDA, the emulation elsewhere."""

from __future__ import annotations

import pytest
import torch

from harness import candidates as C
from harness.config import load_preset, override
from harness.engine import attention as A
from harness.engine import fp8_fine as F8
from harness.errors import HarnessError
from harness.experiments.bench_engine import meta_attention
from tests.helpers.interpreter import check_in_interpreter


def _exact(q, k, v):
    s = torch.einsum("hqd,hkd->hqk", q.double(), k.double()) * q.shape[-1] ** -0.5
    return torch.einsum("hqk,hkd->hqd", torch.softmax(s, -1), v.double())


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _qkv(g, h, sq, sk, d, device):
    """Token-major (S, H, D) storage seen as (H, S, D), as the dense backends see it; V with a
    channel offset and K with one large block, so the per-channel and per-block scales matter."""
    q, k, v = (torch.randn(n, h, d, generator=g) for n in (sq, sk, sk))
    v[:, :, 0] += 3.0
    k[: min(sk, 16)] *= 8.0
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return [x.to(dtype).to(device).transpose(0, 1) for x in (q, k, v)]


def check(device: str, bound: float) -> None:
    """``bound``: the kernel's largest rel-L2 from the emulation where no online rescaling happens
    (the keys in one block) and P·V is the only FP8 product."""
    from harness.engine import fused_fp8_attention as K

    g = torch.Generator().manual_seed(0)
    d = 16 if device == "cpu" else 128
    for mode, (qk_block, pv) in F8.MODES.items():
        for sk in (30, 300):  # one block of keys (the interpreter's 32, the GPU's ≥ 64), then many
            q, k, v = _qkv(g, 3, 40, sk, d, device)
            got = K.attention(q, k, v, qk_block=qk_block, pv=pv)
            assert got.shape == q.shape and got.dtype == q.dtype
            assert got.transpose(0, 1).is_contiguous()  # token-major, the layout the model holds
            emu = F8.attention(q, k, v, qk_block=qk_block, pv=pv)
            exact = _exact(q, k, v)
            err, emu_err = _rel(got, exact), _rel(emu, exact)
            assert 1e-4 < emu_err < 0.2, (mode, sk, emu_err)  # FP8 rounds: the check could fail
            if sk == 30:
                # P·V only: the same codes, to float32's noise; qk-block: P's bf16 rounding on top
                limit = bound if mode == "pv" else bound + 2 ** -8
                assert _rel(got, emu) <= limit, (mode, _rel(got, emu))
            assert err <= 1.25 * emu_err + 2 ** -9, (mode, sk, err, emu_err)
    # V's codes from the kernel's own pass are the emulation's, scale for scale and code for code
    for sk in (1, 70, 300):
        v = _qkv(g, 2, 1, sk, d, device)[2]
        codes, vs = K.v_codes(v)
        want_s = F8.amax_scale(v.float(), dim=1)
        assert codes.stride(1) == 1 and codes.stride(2) % 16 == 0 and torch.equal(vs, want_s[:, 0])
        assert torch.equal(codes.float(), F8.e4m3_codes(v.float(), want_s).float())
        # Q's per row and K's per key block, likewise
        codes, qs = K.row_codes(v, block=None)
        want_s = F8.amax_scale(v.float(), dim=2)
        assert torch.equal(qs, want_s[..., 0]) and torch.equal(codes.float(), F8.e4m3_codes(v.float(), want_s).float())
        codes, ks = K.row_codes(v, block=F8.K_BLOCK)
        assert torch.equal(ks, F8.block_amax_scales(v.float()))
        assert torch.equal(codes.float(), F8.e4m3_codes(v.float(), F8.key_block_scales(v.float())).float())
    # views of token-major storage are read in place: the same bytes as from contiguous copies
    q, k, v = _qkv(g, 2, 20, 100, d, device)
    a = K.attention(q, k, v, qk_block=True, pv=True)
    assert torch.equal(a, K.attention(q.contiguous(), k.contiguous(), v.contiguous(), qk_block=True, pv=True))
    assert K.attention(q[:, :0], k, v, qk_block=False, pv=True).shape == (2, 0, d)
    into = torch.full((20, 2, d), float("nan"), dtype=q.dtype, device=device).transpose(0, 1)  # H1d's buffer
    assert K.attention(q, k, v, qk_block=True, pv=True, out=into) is into and torch.equal(into, a)
    with pytest.raises(ValueError):
        K.attention(q, k, v, qk_block=True, pv=True, out=into[:, :5])
    for bad in ((q[..., :12], k[..., :12], v[..., :12]), (q, k[:, :50], v), (q, k[:, :0], v[:, :0])):
        with pytest.raises(ValueError):
            K.attention(*bad, qk_block=False, pv=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test covers it")
def test_kernel_rounds_as_the_emulation_in_the_interpreter():
    pytest.importorskip("triton")
    check_in_interpreter(__file__, bound=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_rounds_as_the_emulation_on_cuda():
    pytest.importorskip("triton")
    check("cuda", bound=5e-3)  # exp2 on the GPU moves a few P values across an e4m3 boundary


def test_h6f_runs_the_kernel_on_cuda_and_the_emulation_elsewhere():
    tiny = load_preset("tiny")
    assert C.configure(["H6f:pv"], tiny).runtime.attention == "fp8-pv-emulated"
    on_gpu = override(tiny, runtime={"device": "cuda", "dtype": "bfloat16"})
    for mode in F8.MODES:
        name = C.configure([f"H6f:{mode}"], on_gpu).runtime.attention
        assert name == f"fp8-{mode}" and name in A.WRITES_INTO and A.gpu_only(name) and meta_attention(name) == "sdpa"
    with pytest.raises(HarnessError, match="bf16"):
        C.configure(["H6f"], override(tiny, runtime={"device": "cuda", "dtype": "float32"}))
    with pytest.raises(HarnessError, match="CUDA only"):
        A.check_backend("fp8-pv", "cpu")
    A.check_backend("fp8-pv-emulated", "cpu")  # the emulation runs anywhere


def test_one_reason_refuses_every_gpu_only_backend_off_the_gpu():
    """``unavailable_reason`` is what both a command (``check_backend``) and a replay row refuse with."""
    for name in ("fa3", "fa3-fp8", "fa3-fp8-smooth", *A.TRITON_DENSE):
        why = A.unavailable_reason(name, "cpu")
        assert A.gpu_only(name) and why
        with pytest.raises(HarnessError) as e:
            A.check_backend(name, "cpu")
        assert str(e.value) == f"runtime.attention={name}: {why}"
    for name in ("sdpa", "sdpa-math", "fp8-pv-emulated", "fp8-emulated"):
        assert not A.gpu_only(name) and A.unavailable_reason(name, "cpu") is None
