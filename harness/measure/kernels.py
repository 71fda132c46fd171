"""Per-kernel breakdown of a profiled interval: GPU kernel time by category, and the top kernels.

Pure: it takes (kernel name, device µs, calls) rows, so it can be tested and re-run on stored
profiles anywhere. The categories are matched on kernel names in order (first match wins); names
are the vendors' and change between library versions, so the top kernels by time are kept raw
beside the categories — a kernel that fell into "other" shows up there.
"""

from __future__ import annotations

#: (category, substrings of the lower-cased kernel name), first match wins. Triton first: Inductor
#: names a kernel after the ops it fuses ("triton_red_fused__scaled_mm_…_amax" is the activation's
#: quantisation before an FP8 GEMM, not the GEMM), and the harness's own kernels by their functions.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gemm-fp8", ("triton_tem_fused__scaled_mm",)),  # Inductor's GEMM templates (max-autotune) are GEMMs
    ("gemm", ("triton_tem_",)),
    ("attention-fp8-triton", ("_fp8_attention_kernel",)),  # H6f's Triton attention: attention, not "triton"
    ("triton", ("triton_", "_bias_gelu_quant_kernel", "_to_uint8_kernel", "_qk_norm_rope_kernel", "_ffn_norm_kernel",
                "_add_norm_kernel", "_v_amax_kernel", "_v_codes_kernel", "_row_codes_kernel")),
    ("attention-fa3", ("flashattnfwdsm90", "flash::", "flash_fwd")),
    ("attention-cudnn", ("cudnn", "fmha", "sdpa")),
    ("attention-other", ("attention", "flash")),
    ("gemm-fp8", ("e4m3", "f8f8", "fp8", "_qqtst", "scaled_mm")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "sm90_")),
    ("copy", ("copy", "memcpy", "index", "gather", "scatter", "cat_", "memset")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "norm", "softmax")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def breakdown(rows: list[tuple[str, float, int]], top: int = 60) -> dict:
    """rows: (kernel name, total device µs, calls) → ms and share per category, top kernels."""
    total_us = sum(us for _, us, _ in rows)
    cats: dict[str, dict] = {}
    for name, us, calls in rows:
        c = cats.setdefault(category(name), {"ms": 0.0, "calls": 0, "kernels": 0})
        c["ms"] += us / 1e3
        c["calls"] += calls
        c["kernels"] += 1
    for c in cats.values():
        c["share"] = c["ms"] * 1e3 / total_us if total_us else 0.0
    ranked = sorted(rows, key=lambda r: -r[1])[:top]
    return {"total_ms": total_us / 1e3,
            "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1]["ms"])),
            "top": [{"name": n[:160], "ms": us / 1e3, "calls": k, "category": category(n)} for n, us, k in ranked]}


def render(b: dict) -> str:
    """A few lines for a console: categories with ms and share."""
    parts = [f"{c} {v['ms']:.1f} ms ({v['share']:.0%})" for c, v in b["categories"].items()]
    return f"kernels {b['total_ms']:.1f} ms: " + ", ".join(parts)
