"""The FP64 reference a backend's result is checked against, and the check.

References (float64, on the replay device):
* attention — a sample of query positions × heads (``SAMPLE_QUERIES`` × ``SAMPLE_HEADS``, spread
  evenly, first and last included) against *all* effective keys;
* linear — a sample of rows of the input against the full weight;
* conv — a sample of output channels over the full output;
* convert — the exact reference rule (``engine.convert.to_uint8`` in float32 on the host); a
  single differing byte fails.
Pass: ``allclose(atol=0.03, rtol=0.03)`` and relative L2 ≤ 0.01 (DESIGN §5's threshold gate),
applied to the sampled values.
"""

from __future__ import annotations

import torch

from harness.engine.convert import to_uint8
from harness.experiments.replay.op_backends import attn_views, conv_args, conv_fn, linear_operands
from harness.experiments.replay.cases import Case
from harness.measure.gates import DEFAULT_THRESHOLDS

# the threshold gate's latent tolerances: a kernel passes here on the terms the model's output must meet
ATOL = DEFAULT_THRESHOLDS.latent_atol
RTOL = DEFAULT_THRESHOLDS.latent_rtol
REL_L2 = DEFAULT_THRESHOLDS.latent_rel_l2
SAMPLE_QUERIES = 64
SAMPLE_HEADS = 8
SAMPLE_ROWS = 128
SAMPLE_CHANNELS = 8


def _spread(n: int, k: int, device):
    return torch.linspace(0, n - 1, min(n, k), device=device).round().long().unique()


def reference(case: Case, t: dict, device) -> dict:
    """FP64 reference values at sampled positions, with the index used to pick the same values
    out of a backend's result (see the module docstring)."""
    if case.kind == "attention":
        a = attn_views(case, t)
        q, k, v = a["q"], a["k"], a["v"]
        hs, qs = _spread(q.shape[1], SAMPLE_HEADS, q.device), _spread(q.shape[2], SAMPLE_QUERIES, q.device)
        qd = q[0].index_select(0, hs).index_select(1, qs).double()
        kd, vd = k[0].index_select(0, hs).double(), v[0].index_select(0, hs).double()
        p = torch.softmax((qd @ kd.transpose(-1, -2)) * q.shape[-1] ** -0.5, dim=-1)
        return {"values": p @ vd, "pick": lambda o: o[0].index_select(0, hs).index_select(1, qs)}
    if case.kind == "linear":
        x, w, b = linear_operands(case, t, device)
        x2 = x.reshape(-1, x.shape[-1])
        rows = _spread(x2.shape[0], SAMPLE_ROWS, x.device)
        ref = x2.index_select(0, rows).double() @ w.double().t()
        if b is not None:
            ref = ref + b.double()
        return {"values": ref, "pick": lambda o: o.reshape(-1, o.shape[-1]).index_select(0, rows)}
    if case.kind == "conv":
        conv, kw = conv_fn(case), conv_args(case)
        x, w, b = t["input"], t["weight"], t.get("bias")
        if int(kw.get("groups", 1)) != 1:
            return {"values": conv(x.double(), w.double(), None if b is None else b.double(), **kw), "pick": lambda o: o}
        oc = _spread(w.shape[0], SAMPLE_CHANNELS, w.device)
        ref = conv(x.double(), w.index_select(0, oc).double(), None if b is None else b.index_select(0, oc).double(), **kw)
        return {"values": ref, "pick": lambda o: o.index_select(1, oc)}
    return {"values": to_uint8(t["frames"].detach().to("cpu", torch.float32)), "pick": lambda o: o, "exact": True}


def _check_exact(got, want) -> dict:
    got = got.to(want.device)
    bad = int((got != want).sum())
    diff = int((got.int() - want.int()).abs().max()) if got.numel() else 0
    return {"passed": bad == 0, "mismatches": bad, "max_abs": diff, "samples": want.numel(),
            **({} if bad == 0 else {"reason": f"{bad} of {want.numel()} bytes differ from the reference rule (max |Δ| {diff})"})}


def check(ref: dict, out) -> dict:
    """Whether ``out`` matches the reference at its sampled values, with the error figures."""
    got = ref["pick"](out)
    want = ref["values"]
    if tuple(got.shape) != tuple(want.shape):
        return {"passed": False, "reason": f"shape {tuple(got.shape)} != reference {tuple(want.shape)}"}
    if ref.get("exact"):
        return _check_exact(got, want)
    g = got.double().to(want.device)
    finite = bool(torch.isfinite(g).all())
    d = (g - want).abs()
    max_abs = float(d.max()) if d.numel() else 0.0
    rel_l2 = float(torch.linalg.vector_norm(g - want) / torch.linalg.vector_norm(want).clamp_min(1e-300))
    close = bool((d <= ATOL + RTOL * want.abs()).all())
    res = {"passed": finite and close and rel_l2 <= REL_L2, "max_abs": max_abs, "rel_l2": rel_l2, "allclose": close,
           "samples": want.numel()}
    if not res["passed"]:
        why = ["non-finite values"] if not finite else []
        if not close:
            why.append(f"not allclose(atol={ATOL}, rtol={RTOL}): max |Δ| {max_abs:.3g}")
        if rel_l2 > REL_L2:
            why.append(f"relative L2 {rel_l2:.3g} > {REL_L2}")
        res["reason"] = "; ".join(why) or "check failed"
    return res
