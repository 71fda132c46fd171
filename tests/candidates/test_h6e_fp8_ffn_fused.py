"""H6e: ``Fp8Ffn`` computes exactly what H6a's two ``Fp8Linear`` and the GELU between them compute
(on the CPU, where the op is its reference: byte-identical latents through the engine patch), and
the fused Triton kernel matches that reference — the per-row scales, and every e4m3 code but a
rare one a single step off — on rows with outliers, all zeros, e4m3-subnormal values, a width that
is no power of two, a strided input, and the full model's 13 824. On CUDA directly; without a GPU
through the Triton interpreter (Triton comes with the vllm extra). And SP 2 and 4 give SP 1's
latents through window eviction."""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.nn as nn

from harness.candidates import get, h6a_fp8_linear, h6e_fp8_ffn_fused
from harness.config import load_preset, override
from harness.engine.conditions import SessionConditions
from harness.engine.dit_engine import DitEngine
from harness.engine.fp8_ffn import Fp8Ffn, bias_gelu_quantize, bias_gelu_quantize_reference
from harness.engine.fp8_linear import Fp8Linear
from harness.engine.groups import RankGroup
from harness.errors import HarnessError
from tests.helpers.interpreter import check_in_interpreter


def _ffn(dim=64, hidden=256, seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, hidden, dtype=dtype), nn.GELU(approximate="tanh"),
                         nn.Linear(hidden, dim, dtype=dtype)).requires_grad_(False)


def _cpu_rowwise_scaled_mm() -> bool:
    """Row-wise scales in the CPU's _scaled_mm (torch ≥ 2.12; the GPU machine's 2.11 has per-tensor only)."""
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


cpu_fp8 = pytest.mark.skipif(not _cpu_rowwise_scaled_mm(), reason="this torch's CPU _scaled_mm has no row-wise scales")


@cpu_fp8
def test_fp8_ffn_is_h6a_ffn_bit_for_bit_on_cpu():
    ffn = _ffn()
    x = torch.randn(3, 40, 64, dtype=torch.bfloat16)
    x[1, 7] *= 300.0  # an outlier token
    h6a = nn.Sequential(Fp8Linear(ffn[0]), ffn[1], Fp8Linear(ffn[2]))
    fused = Fp8Ffn(ffn)
    y = fused(x)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert torch.equal(y, h6a(x))
    # traced as torch.compile traces it (the op's fake kernel gives the shapes), the same numbers
    assert torch.equal(torch.compile(fused, backend="eager", fullgraph=True)(x), y)


def test_fp8_ffn_refuses_what_it_cannot_fuse():
    with pytest.raises(HarnessError, match="GELU\\(tanh\\)"):
        Fp8Ffn(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)))
    with pytest.raises(HarnessError, match="already swapped"):
        Fp8Ffn(Fp8Ffn(_ffn()))
    with pytest.raises(HarnessError, match="has none"):
        Fp8Ffn(nn.Sequential(nn.Linear(16, 32, bias=False), nn.GELU(approximate="tanh"), nn.Linear(32, 16)))


def _latents(eng, n=2):
    s = eng.start_session(SessionConditions(prompt="h6e", seed=5))
    out = [eng.generate_chunk(s, ["W", "", "D"]).clone() for _ in range(n)]
    eng.end_session(s)
    return out


@cpu_fp8
def test_h6e_patch_equals_h6a_quantises_once_and_reverts():
    eng = DitEngine(override(load_preset("tiny"), parallel={"sp": 1}), group=RankGroup.single(), device=torch.device("cpu"), seed=1)
    originals = [b.ffn for b in eng.model.blocks]
    base = _latents(eng)
    revert = get("H6a").patch_dit(eng, "ffn")
    h6a = _latents(eng)
    revert()
    cand = get("H6e")
    revert = cand.patch_dit(eng, "ffn")
    fused = [b.ffn for b in eng.model.blocks]
    assert all(isinstance(f, Fp8Ffn) for f in fused)
    assert all(torch.equal(a, b) for a, b in zip(_latents(eng), h6a))  # H6a's numbers exactly
    revert()
    assert all(b.ffn is f for b, f in zip(eng.model.blocks, originals))
    assert all(torch.equal(a, b) for a, b in zip(_latents(eng), base))
    revert = cand.patch_dit(eng, "ffn")  # quantised once per engine: the same modules again
    assert all(b.ffn is f for b, f in zip(eng.model.blocks, fused))
    revert()
    assert eng in h6e_fp8_ffn_fused.QUANTISED and eng in h6a_fp8_linear.QUANTISED
    # ffn-mid keeps the first and last 2 blocks bf16: a 6-block stack to see it
    cfg6 = override(load_preset("tiny"), parallel={"sp": 1}, model={"num_layers": 6})
    eng6 = DitEngine(cfg6, group=RankGroup.single(), device=torch.device("cpu"), seed=1)
    revert = cand.patch_dit(eng6, "ffn-mid")
    assert [isinstance(b.ffn, Fp8Ffn) for b in eng6.model.blocks] == [False, False, True, True, False, False]
    revert()
    assert not any(isinstance(b.ffn, Fp8Ffn) for b in eng6.model.blocks)


def test_h6e_resolution_refusals(monkeypatch):
    from harness import candidates as C

    cpu = load_preset("tiny")
    with pytest.raises(HarnessError, match="needs cuda"):
        C.resolve(["H6e"], cpu)
    monkeypatch.setattr(C, "_available", lambda need, device: True)  # as on an H200 with Triton
    assert [c.id for c, _ in C.resolve(["H6e", "H1c"], cpu)] == ["H1c", "H6e"]
    with pytest.raises(HarnessError, match="H6e and H6a conflict"):
        C.resolve(["H6a", "H6e"], cpu)
    # before launch: the kernel rounds as bf16 does, a float32 model is refused in one line
    f32 = override(cpu, runtime={"dtype": "float32"})
    with pytest.raises(HarnessError, match="H6e fuses a bf16 FFN epilogue; this run's runtime.dtype is float32"):
        C.configure_resolved(C.resolve(["H6e"], f32), f32)


# ---- the Triton kernel against the reference --------------------------------------------------------
def _rows(n: int, m: int, g: torch.Generator) -> torch.Tensor:
    u = torch.randn(m, n, generator=g) * 2.0
    u[1] *= 1e4  # saturating outliers: the GELU's large positive and (≈ 0) negative ends
    u[2] = 0.0  # an all-zero row (bias only)
    u[3] *= 1e-3  # values around zero: the GELU's linear part
    u[4, : n // 2] = -3.0 - torch.rand(n // 2, generator=g) * 4  # the negative tail, tiny GELUs
    u[4, 0] = 200.0  # one large value: the tail's codes fall into e4m3's subnormals
    return u


def compare(u: torch.Tensor, b: torch.Tensor, name: str) -> tuple[int, int]:
    """The fused kernel against the reference on one input: (codes that differ, codes)."""
    from harness.engine.fused_gelu_quant import bias_gelu_quantize as fused

    q0, s0 = bias_gelu_quantize_reference(u, b)
    q, s = fused(u, b)
    assert q.dtype == torch.float8_e4m3fn and q.shape == u.shape and s.shape == (u.shape[0], 1), name
    # the scales: the amax of g, one bf16 value, the same unless that one value rounded apart
    rel = ((s - s0).abs() / s0).max().item()
    assert rel <= 2.0 ** -7, f"{name}: scale off by {rel}"
    a, r = q.float() * s, q0.float() * s0
    # a code that differs is one e4m3 step from the reference's: ≤ 2⁻³ of it, or one subnormal step
    step = torch.maximum(r.abs() * 2.0 ** -3, s0 * 2.0 ** -9) * (1 + 2.0 ** -7)
    assert bool(((a - r).abs() <= step).all()), f"{name}: a code more than one e4m3 step off"
    return int((a != r).sum()), a.numel()


def check(device: str, bound: float) -> None:
    from harness.engine.fused_gelu_quant import bias_gelu_quantize as fused

    g = torch.Generator().manual_seed(0)
    cases = {f"{m}x{n}": (_rows(n, m, g), torch.randn(n, generator=g)) for m, n in ((7, 1000), (9, 64), (5, 13824))}
    u, b = cases["9x64"]
    cases["strided"] = (torch.cat([u, u], dim=1)[:, ::2], b)
    total = off = 0
    for name, (u, b) in cases.items():
        d, n = compare(u.to(torch.bfloat16).to(device), b.to(torch.bfloat16).to(device), name)
        total, off = total + n, off + d
    assert off <= bound * total, f"{off} of {total} codes differ"
    with pytest.raises(ValueError, match="expected bf16"):
        fused(u.float(), b.float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_epilogue_matches_the_reference_on_cuda():
    pytest.importorskip("triton")
    # the GPU's fast exp and division move more GELU values across a bf16 boundary than the
    # interpreter's numpy: 0.22 % of the codes at the full shape on an H200 (gpu-batch17), each one step
    check("cuda", bound=5e-3)
    g = torch.Generator(device="cuda").manual_seed(1)
    u = torch.randn(4680, 13824, device="cuda", generator=g).to(torch.bfloat16)  # one 480×832 chunk's FFN hidden
    b = torch.randn(13824, device="cuda", generator=g).to(torch.bfloat16)
    from harness.engine.fused_gelu_quant import bias_gelu_quantize as fused

    assert torch.equal(bias_gelu_quantize(u, b)[0].view(torch.uint8), fused(u, b)[0].view(torch.uint8))  # the op runs the kernel
    off, n = compare(u, b, "4680x13824")
    assert off <= 5e-3 * n, f"{off} of {n} codes differ"
    # a NaN stays NaN where it is (the reference's row is all NaN), so a blow-up is not hidden from
    # the gate (the interpreter's e4m3 cast turns NaN into 0, so this is checked on the GPU only)
    u[1, 5] = float("nan")
    q, _ = fused(u[:2], b)
    assert bool(torch.isnan(q.float()[1, 5])) and not bool(torch.isnan(q.float()[0]).any())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA test covers it")
def test_fused_epilogue_matches_the_reference_in_the_interpreter():
    pytest.importorskip("triton", reason="Triton is not installed (it comes with the vllm extra)")
    check_in_interpreter(__file__, bound=1e-3)


# ---- SP: 1, 2 and 4 ranks, through window eviction --------------------------------------------------
#: the tiny preset with a 3-sink + 6-recent window (evicting from chunk 3) and 2 denoising steps
CACHE, STEPS, CHUNKS = {"sink_frames": 3, "window_frames": 9}, (1000, 500), 4


def _sp_run(group: RankGroup) -> dict:
    torch.set_num_threads(1)
    cfg = override(load_preset("tiny"), parallel={"sp": group.size}, cache=CACHE, schedule={"timesteps": STEPS})
    eng = DitEngine(cfg, group=group, device=torch.device("cpu"), seed=3)
    out = {}
    for tag, cid in (("bf16", None), ("h6e", "H6e")):
        revert = get(cid).patch_dit(eng, "ffn") if cid else (lambda: None)
        try:
            s = eng.start_session(SessionConditions(prompt="h6e sp", seed=11))
            out[tag] = [eng.generate_chunk(s, ["W", "", "D"]).numpy().copy() for _ in range(CHUNKS)]
            eng.end_session(s)
        finally:
            revert()
    return out


@cpu_fp8
def test_h6e_sp_ranks_give_sp1s_latents():
    """The FFN and its per-row (per-token) scales see one token at a time, so splitting the tokens
    over ranks changes nothing the FP8 path computes: where the bf16 path is bit-identical to SP=1
    (it is on this box), so is H6e's; in any case both within the SP test's 1e-4."""
    from harness.engine.groups import run_ranks

    sp1 = run_ranks(_sp_run, 1)[0]
    assert any(not np.array_equal(a, b) for a, b in zip(sp1["h6e"], sp1["bf16"]))  # FP8 changes the latents
    for sp in (2, 4):
        results = run_ranks(_sp_run, sp)
        bf16_exact = all(a.tobytes() == b.tobytes() for a, b in zip(results[0]["bf16"], sp1["bf16"]))
        for r in results:
            for tag in ("bf16", "h6e"):
                for c in range(CHUNKS):
                    assert np.array_equal(r[tag][c], results[0][tag][c]), f"SP={sp}: ranks differ, {tag} chunk {c}"
                    err = float(np.linalg.norm(r[tag][c] - sp1[tag][c]) / np.linalg.norm(sp1[tag][c]))
                    assert err <= 1e-4, f"SP={sp} {tag}: chunk {c} relative error {err:.2e}"
                    if bf16_exact:
                        assert r[tag][c].tobytes() == sp1[tag][c].tobytes(), f"SP={sp} {tag}: chunk {c} differs"


def test_a_worker_applying_h6e_for_good_lets_the_bf16_ffn_go():
    """The worker keeps no revert (``apply_for_good``): the bf16 FFN weights H6e replaced are
    unreachable when it returns, so on CUDA their memory can go back to the driver (batch 26: a
    480×832 DiT with the stack held 68.3 GiB, where its weights, FP8 copies and KV come to ≈ 58)."""
    import weakref

    from harness.workers.common import apply_for_good

    eng = DitEngine(override(load_preset("tiny"), parallel={"sp": 1}), group=RankGroup.single(), device=torch.device("cpu"), seed=1)
    gone = [weakref.ref(b.ffn[0].weight) for b in eng.model.blocks] + [weakref.ref(b.ffn[2].weight) for b in eng.model.blocks]
    assert apply_for_good(["H6e"], torch.device("cpu"), dit=eng) == ["H6e"]
    assert all(isinstance(b.ffn, Fp8Ffn) for b in eng.model.blocks)
    assert all(w() is None for w in gone)
