"""Kernel breakdown: category by name (first match wins), totals, shares and the raw top list."""

from harness.measure.kernels import breakdown, category


def test_categories_of_real_kernel_names():
    assert category("void flash::FlashAttnFwdSm90<...>") == "attention-fa3"
    assert category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3") == "attention-cudnn"
    assert category("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128") == "gemm-fp8"
    assert category("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNT") == "gemm"
    assert category("triton_per_fused__to_copy_add_mul_0") == "triton"
    # Inductor names a kernel after what it fuses: the quantisation before an FP8 GEMM is Triton's
    assert category("triton_red_fused__scaled_mm__to_copy_abs_add_amax_clamp_clamp_min_div_gelu_t_1") == "triton"
    assert category("_bias_gelu_quant_kernel") == "triton"  # H6e's own
    assert category("_qk_norm_rope_kernel") == "triton"  # H2d's, not "elementwise" for its "norm"
    assert category("triton_tem_fused_mm_0") == "gemm" and category("triton_tem_fused__scaled_mm_1") == "gemm-fp8"
    assert category("void at::native::index_elementwise_kernel<128, 4>") == "copy"
    assert category("some_unknown_kernel") == "other"


def test_breakdown_totals_shares_and_top():
    rows = [("triton_poi_fused_0", 1000.0, 10), ("nvjet_tst_x", 3000.0, 5), ("void flash::FlashAttnFwdSm90<x>", 6000.0, 2)]
    b = breakdown(rows, top=2)
    assert b["total_ms"] == 10.0
    assert list(b["categories"]) == ["attention-fa3", "gemm", "triton"]
    assert b["categories"]["gemm"] == {"ms": 3.0, "calls": 5, "kernels": 1, "share": 0.3}
    assert [t["ms"] for t in b["top"]] == [6.0, 3.0]
    assert breakdown([])["total_ms"] == 0.0


def test_every_triton_kernel_of_the_harness_counts_as_triton():
    # a kernel the harness launches is named after its function; one missing from CATEGORIES would
    # land in whatever its name happens to contain ("norm" → elementwise), off the Triton figure
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "harness"
    names = {m for f in root.rglob("*.py")
             for m in re.findall(r"@triton\.jit\s*\ndef (_\w+_kernel)\(", f.read_text())}
    assert {"_qk_norm_rope_kernel", "_bias_gelu_quant_kernel", "_to_uint8_kernel"} <= names
    # the attention kernel counts as attention (the non-GEMM, non-attention figure leaves it out), its
    # operand passes as Triton
    attention = {"_fp8_attention_kernel"}
    assert attention <= names
    assert {n: category(n) for n in names} == {n: "attention-fp8-triton" if n in attention else "triton" for n in names}
