"""The recorder on CUDA: each SDPA backend reaches the mode as its own fused op (or, for math,
as bmm inside the SDPA call), and every one gives the same attention count. GPU only."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness.hooks.active import activate
from harness.hooks import context as hctx
from harness.hooks.dispatch import DispatchRecorder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

B, H, SQ, SKV, D = 1, 8, 96, 224, 64


@pytest.fixture(autouse=True)
def _clean():
    yield
    hctx.reset_for_tests()


@pytest.mark.parametrize("backend,op", [
    (SDPBackend.FLASH_ATTENTION, "aten._scaled_dot_product_flash_attention.default"),
    (SDPBackend.EFFICIENT_ATTENTION, "aten._scaled_dot_product_efficient_attention.default"),
    (SDPBackend.CUDNN_ATTENTION, "aten._scaled_dot_product_cudnn_attention.default"),
    (SDPBackend.MATH, "aten.bmm.default"),
])
def test_every_sdpa_backend_counts_attention_once(tmp_path, backend, op):
    q = torch.randn(B, H, SQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, H, SKV, D, device="cuda", dtype=torch.bfloat16)
    rec = DispatchRecorder(tmp_path / "d.jsonl")
    with sdpa_kernel(backend), rec, hctx.phase(role="cross_attention"):
        F.scaled_dot_product_attention(q, k, k)
    rec.close()
    want = 4 * B * H * SQ * SKV * D
    cats = rec.flops_by_category()
    assert cats["cross_attention"] == want and rec.total_flops == want
    ops = [json.loads(line)["op"] for line in (tmp_path / "d.jsonl").read_text().splitlines()
           if json.loads(line)["flops"]]
    assert set(ops) == {op}, ops


def test_profile_window_on_cuda_captures_kernels(tmp_path):
    a = torch.randn(512, 512, device="cuda")
    with activate("profile=0:0", out_dir=tmp_path, label="dit0"):
        with hctx.phase(session=1, epoch=1), hctx.phase(chunk=0):
            for _ in range(3):
                a @ a
        torch.cuda.synchronize()
    trace = json.loads((tmp_path / "profile.dit0.json").read_text())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])


def test_real_nvtx_on_cuda(tmp_path):
    from harness.hooks import nvtx_ranges

    with activate("nvtx", out_dir=tmp_path):
        assert isinstance(nvtx_ranges._backend, nvtx_ranges.NvtxBackend)
        with hctx.phase(chunk=0, stage="dit"), hctx.phase(layer=0):
            torch.ones(4, device="cuda").sum().item()
    assert not nvtx_ranges.ENABLED
