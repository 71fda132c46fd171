"""The VAE probes of ``gpu-checks`` run on the CPU too: their figures are well-formed and their
comparisons are against the reference variant's own pixels."""

from harness.experiments.vae_probe import check_condition, check_vae_layout
from harness.measure.gates import psnr_db


def test_psnr_of_unit_range_frames():
    assert psnr_db(0.0) is None  # identical frames: no figure (JSON has no infinity)
    assert psnr_db(2.0) == 0.0  # an RMSE of the whole range
    assert abs(psnr_db(0.02) - 40.0) < 1e-9


def test_condition_probe_finds_the_fixed_point_and_stops_encoding():
    r = check_condition(9, preset="tiny", device="cpu", modes=("", "bf16-chunk"))
    fp32, bf16 = r["modes"]["fp32"], r["modes"]["bf16-chunk"]
    assert fp32["fixed_at"] is not None and fp32["encoded_chunks"] == fp32["fixed_at"] + 1
    assert len(fp32["chunk_ms"]) == 9 and "rel_l2" not in fp32
    # H3c's bf16 whole-chunk encoder: the same conditions to bf16's rounding, chunk by chunk
    assert len(bf16["rel_l2"]) == 9 and 0 < max(bf16["rel_l2"]) < 0.05, bf16["rel_l2"]


def test_layout_probe_compares_every_variant_with_the_reference():
    r = check_vae_layout(2, ("reference", "benchmark", "cl3d"), preset="tiny", device="cpu")
    rows = r["variants"]
    assert "psnr_db" not in rows["reference"] and rows["reference"]["ratio"] == 1
    # on the CPU neither autotuning nor the NDHWC layout changes a pixel of the tiny decode
    assert rows["benchmark"]["exact"] and rows["cl3d"]["worst_max_abs"] <= 0.02
    assert r["peak_tf32_tflops"] is None and rows["cl3d"]["tf32_mfu"] is None


def test_layout_probe_refuses_an_unknown_variant_before_building_anything():
    import pytest

    from harness.errors import HarnessError
    from harness.experiments.vae_probe import VARIANTS

    assert {"compile", "compile+chunk", "fp16chunk", "fp16chunk+compile"} <= set(VARIANTS)
    with pytest.raises(HarnessError, match=r"unknown vae-layout variant compiled \(known: reference"):
        check_vae_layout(2, ("reference", "compiled"), preset="tiny", device="cpu")
