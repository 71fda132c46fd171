"""FFN-up's FP8 epilogue (bias, tanh-GELU, per-row e4m3 quantisation) at the full model's shape:
what H6e's one-pass Triton kernel saves against what ``torch.compile`` makes of the same ops.

    python -m harness gpu-checks ffn-epilogue [--json F]

One chunk's FFN hidden activation at the 480×832 preset (tokens per chunk × ffn_dim, bf16, random
values) goes through three implementations of one function: the eager reference (H6a's order of
ops), the reference under ``torch.compile`` (the kernel a compiled H6a block runs), and the fused
kernel (``engine/fused_gelu_quant``). Each is timed as the median of ``rounds`` CUDA-event windows
of ``calls`` back-to-back calls (per call, so launch gaps are averaged in, as inside a block), beside
the bytes a single pass must move; the fused output is compared with the eager reference.
"""

from __future__ import annotations

import statistics

import torch

from harness.config import load_preset
from harness.engine.fp8_ffn import bias_gelu_quantize_reference

PRESET = "lingbot-480x832"


def _per_call_ms(fn, u, b, calls: int, rounds: int) -> float:
    fn(u, b)  # compile / autotune outside the windows
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn(u, b)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def check_ffn_epilogue(calls: int = 20, rounds: int = 15) -> dict:
    from harness.engine.fused_gelu_quant import bias_gelu_quantize as fused, tune  # Triton

    cfg = load_preset(PRESET)
    m, n = cfg.tokens_per_chunk, cfg.model.ffn_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    u = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    config = tune(m, n, u.device)
    impls = {"eager": bias_gelu_quantize_reference,
             "compiled": torch.compile(bias_gelu_quantize_reference, fullgraph=True),
             "fused": fused}
    ms = {name: _per_call_ms(fn, u, b, calls, rounds) for name, fn in impls.items()}
    q0, s0 = bias_gelu_quantize_reference(u, b)
    q, s = fused(u, b)
    one_pass = m * n * (2 + 1)  # read bf16, write e4m3 (the bias and the scales are noise)
    blocks, forwards = cfg.model.num_layers, len(cfg.schedule.timesteps) + 1  # the denoise forwards + the commit
    return {"shape": [m, n], "fused_config": config, "per_call_ms": ms, "one_pass_bytes": one_pass,
            "one_pass_gb_per_s": {k: one_pass / (v / 1e3) / 1e9 for k, v in ms.items()},
            "calls_per_chunk": blocks * forwards,
            "per_chunk_ms": {k: v * blocks * forwards for k, v in ms.items()},
            "saved_per_chunk_ms": (ms["compiled"] - ms["fused"]) * blocks * forwards,
            "codes_differing": float((q.float() != q0.float()).float().mean()),
            "scale_max_rel": float(((s - s0).abs() / s0).max())}
