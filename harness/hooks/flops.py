"""Nominal FLOPs of ATen ops, from shapes alone (no torch import, no tensor values read).

Conventions, chosen to match how model FLOPs and MFU are quoted for this model (DESIGN §8, §12):

- matmul family (mm, addmm, bmm, baddbmm, matmul, linear, …): 2·M·N·K; the bias add and the
  ``beta·self`` term are not counted.
- convolution: 2·out_numel·(Cin/groups)·kernel_volume; the conv's own padding enters through the
  output size. Explicit padding ops (``constant_pad_nd``, ``pad``, halo exchange copies) are data
  movement and count 0. Transposed convolution: 2·in_numel·(Cout/groups)·kernel_volume.
- attention: 2·Sq·Skv·D (QKᵀ) + 2·Sq·Skv·Dv (PV) per batch·head, i.e. 4·Sq·Skv·H·D, with Skv the KV
  length actually passed (the *effective* length, not the cache capacity). Causal masking does not
  reduce the count (nominal, like the matmul formula).
- everything else (norms, softmax, elementwise, copies, collectives) counts 0 and is "other".

Categories: ``linear``, ``self_attention``, ``cross_attention``, ``attention`` (an attention op
whose role the caller did not state), ``vae_conv``, ``other``. Rules in ``categorize``.

Varlen/paged fused kernels (``_flash_attention_forward`` with ``cum_seq_*`` or ``block_table``,
``_efficient_attention_forward`` with ``cu_seqlens_*``) carry their lengths in tensors; reading
them would sync the device, so the count uses total_q·max_k, which is exact for one sequence
(this harness) and an upper bound for a ragged batch.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

Shape = tuple[int, ...]

MATMUL, CONV, ATTENTION = "matmul", "conv", "attention"
CATEGORIES: tuple[str, ...] = ("linear", "self_attention", "cross_attention", "attention", "vae_conv", "other")
ATTENTION_ROLES = frozenset({"self_attention", "cross_attention"})
#: Stages whose convolutions are patch embeddings, i.e. GEMMs written as convs.
DIT_STAGES = frozenset({"dit"})


def shape_of(x: Any) -> Shape:
    """A tensor's shape, or a shape given directly (so formulas run without torch)."""
    s = getattr(x, "shape", x)
    return tuple(int(d) for d in s)


def _prod(xs: Sequence[int]) -> int:
    return math.prod(int(x) for x in xs)


# ---- formulas ------------------------------------------------------------------------------


def linear_flops(x: Any, weight: Any) -> int:
    """``x @ weight.T`` with x (..., K) and weight (N, K)."""
    xs, ws = shape_of(x), shape_of(weight)
    n = ws[0] if len(ws) == 2 else 1
    return 2 * _prod(xs[:-1]) * xs[-1] * n


def matmul_flops(a: Any, b: Any) -> int:
    """``torch.matmul`` semantics: 1-D operands are promoted, leading batch dims broadcast."""
    sa, sb = shape_of(a), shape_of(b)
    if len(sa) == 1:
        sa = (1,) + sa
    if len(sb) == 1:
        sb = sb + (1,)
    m, k = sa[-2], sa[-1]
    n = sb[-1]
    ba, bb = sa[:-2], sb[:-2]
    nd = max(len(ba), len(bb))
    ba, bb = (1,) * (nd - len(ba)) + ba, (1,) * (nd - len(bb)) + bb
    batch = _prod(max(x, y) for x, y in zip(ba, bb))
    return 2 * batch * m * k * n


def _tuple(v: Any, n: int, name: str) -> tuple[int, ...]:
    if isinstance(v, int):
        return (v,) * n
    v = tuple(int(x) for x in v)
    if len(v) == 1 and n > 1:
        return v * n
    if len(v) != n:
        raise ValueError(f"conv {name} {v} does not match {n} spatial dims")
    return v


def conv_output_spatial(
    in_spatial: Sequence[int],
    kernel: Sequence[int],
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    transposed: bool = False,
    output_padding: Any = 0,
) -> tuple[int, ...]:
    n = len(in_spatial)
    if isinstance(padding, str):
        if padding == "valid":
            padding = 0
        elif padding == "same":  # only legal with stride 1
            return tuple(int(x) for x in in_spatial)
        else:
            raise ValueError(f"unknown conv padding {padding!r}")
    s, p, d = _tuple(stride, n, "stride"), _tuple(padding, n, "padding"), _tuple(dilation, n, "dilation")
    if transposed:
        op = _tuple(output_padding, n, "output_padding")
        return tuple((i - 1) * s_ - 2 * p_ + d_ * (k - 1) + o + 1 for i, k, s_, p_, d_, o in zip(in_spatial, kernel, s, p, d, op))
    return tuple((i + 2 * p_ - d_ * (k - 1) - 1) // s_ + 1 for i, k, s_, p_, d_ in zip(in_spatial, kernel, s, p, d))


def conv_flops(
    x: Any,
    weight: Any,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    transposed: bool = False,
    output_padding: Any = 0,
    groups: int = 1,
) -> int:
    """x (N, Cin, *spatial) or unbatched (Cin, *spatial); weight (Cout, Cin/g, *k), or
    (Cin, Cout/g, *k) when transposed."""
    xs, ws = shape_of(x), shape_of(weight)
    kernel = ws[2:]
    batched = len(xs) == len(ws)
    n = xs[0] if batched else 1
    cin, in_spatial = (xs[1], xs[2:]) if batched else (xs[0], xs[1:])
    kvol = _prod(kernel)
    if transposed:
        cout_per_group = ws[1]
        return 2 * n * cin * _prod(in_spatial) * cout_per_group * kvol
    out_spatial = conv_output_spatial(in_spatial, kernel, stride, padding, dilation)
    cout = ws[0]
    return 2 * n * cout * _prod(out_spatial) * (cin // groups) * kvol


def attention_flops(q: Any, k: Any, v: Any = None, *, layout: str = "bhsd") -> int:
    """q/k/v as (..., H, S, D) (``bhsd``, SDPA's layout, any leading dims) or (B, S, H, D)
    (``bshd``, flash/efficient kernels). Skv is read from k; GQA is fine (q's heads count)."""
    qs, ks = shape_of(q), shape_of(k)
    vs = shape_of(v) if v is not None else ks
    if layout == "bhsd":
        bh, sq, d = _prod(qs[:-2]), qs[-2], qs[-1]
        skv = ks[-2]
    elif layout == "bshd":
        bh, sq, d = qs[0] * qs[2], qs[1], qs[3]
        skv = ks[1]
    else:
        raise ValueError(f"unknown attention layout {layout!r}")
    return 2 * bh * sq * skv * (d + vs[-1])


def packed_attention_flops(total_q: int, kv_len: int, heads: int, d: int, dv: int | None = None) -> int:
    """Varlen/paged kernels: total_q query tokens each attending to ``kv_len`` keys."""
    return 2 * total_q * kv_len * heads * (d + (d if dv is None else dv))


# ---- ATen op table -------------------------------------------------------------------------


def _arg(args: Sequence[Any], kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _mm(args, kw):  # mm(self, mat2); _int_mm; _scaled_mm(self, mat2, …)
    return matmul_flops(args[0], args[1])


def _addmm(args, kw):  # addmm(self, mat1, mat2); _addmm_activation; baddbmm; addbmm
    return matmul_flops(args[1], args[2])


def _addmv(args, kw):  # addmv(self, mat, vec)
    return matmul_flops(args[1], args[2])


def _linear(args, kw):
    return linear_flops(args[0], args[1])


def _convolution(args, kw):  # convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    return conv_flops(
        args[0], args[1],
        stride=_arg(args, kw, 3, "stride", 1), padding=_arg(args, kw, 4, "padding", 0),
        dilation=_arg(args, kw, 5, "dilation", 1), transposed=bool(_arg(args, kw, 6, "transposed", False)),
        output_padding=_arg(args, kw, 7, "output_padding", 0), groups=int(_arg(args, kw, 8, "groups", 1)),
    )


def _convnd(args, kw):  # conv{1,2,3}d(input, weight, bias, stride, padding, dilation, groups)
    return conv_flops(
        args[0], args[1], stride=_arg(args, kw, 3, "stride", 1), padding=_arg(args, kw, 4, "padding", 0),
        dilation=_arg(args, kw, 5, "dilation", 1), groups=int(_arg(args, kw, 6, "groups", 1)),
    )


def _conv_transposend(args, kw):  # conv_transpose{1,2,3}d(input, weight, bias, stride, padding, output_padding, groups, dilation)
    return conv_flops(
        args[0], args[1], stride=_arg(args, kw, 3, "stride", 1), padding=_arg(args, kw, 4, "padding", 0),
        output_padding=_arg(args, kw, 5, "output_padding", 0), groups=int(_arg(args, kw, 6, "groups", 1)),
        dilation=_arg(args, kw, 7, "dilation", 1), transposed=True,
    )


def _backend_conv(args, kw):  # cudnn_convolution(self, weight, padding, stride, dilation, groups, …)
    return conv_flops(
        args[0], args[1], padding=_arg(args, kw, 2, "padding", 0), stride=_arg(args, kw, 3, "stride", 1),
        dilation=_arg(args, kw, 4, "dilation", 1), groups=int(_arg(args, kw, 5, "groups", 1)),
    )


def _mkldnn_conv(args, kw):  # mkldnn_convolution(self, weight, bias, padding, stride, dilation, groups)
    return conv_flops(
        args[0], args[1], padding=_arg(args, kw, 3, "padding", 0), stride=_arg(args, kw, 4, "stride", 1),
        dilation=_arg(args, kw, 5, "dilation", 1), groups=int(_arg(args, kw, 6, "groups", 1)),
    )


def _sdpa_bhsd(args, kw):  # every SDPA-level fused op: (query, key, value, …) in (B, H, S, D)
    return attention_flops(args[0], args[1], args[2], layout="bhsd")


def _flash_forward(args, kw):
    # _flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, …, block_table=)
    q, k, v = shape_of(args[0]), shape_of(args[1]), shape_of(args[2])
    cum_q = _arg(args, kw, 3, "cum_seq_q")
    max_k = _arg(args, kw, 6, "max_k")
    paged = kw.get("block_table") is not None
    if cum_q is None and not paged:
        return attention_flops(q, k, v, layout="bshd")
    total_q = _prod(q[:-2])  # (total, H, D) packed, or (B, S, H, D) with a paged K
    kv_len = int(max_k) if max_k is not None else k[-3]
    return packed_attention_flops(total_q, kv_len, q[-2], q[-1], v[-1])


def _efficient_forward(args, kw):
    # _efficient_attention_forward(query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, …)
    q, k, v = shape_of(args[0]), shape_of(args[1]), shape_of(args[2])
    cu_q = _arg(args, kw, 4, "cu_seqlens_q")
    max_k = _arg(args, kw, 7, "max_seqlen_k")
    if cu_q is None or max_k is None:
        return attention_flops(q, k, v, layout="bshd")
    return packed_attention_flops(_prod(q[:-2]), int(max_k), q[-2], q[-1], v[-1])


Formula = Callable[[Sequence[Any], dict], int]

#: ATen op (schema name) → (kind, formula). Composite ops (linear, matmul, conv2d, the SDPA
#: entry point) normally decompose before a dispatch mode sees them; they are listed so that a
#: caller counting at a higher level (or a future backend that keeps them whole) gets it right.
OPS: dict[str, tuple[str, Formula]] = {
    **{f"aten::{n}": (MATMUL, _mm) for n in ("mm", "bmm", "matmul", "_int_mm", "_scaled_mm", "mv", "dot", "vdot")},
    **{f"aten::{n}": (MATMUL, _addmm) for n in ("addmm", "_addmm_activation", "baddbmm", "addbmm")},
    "aten::addmv": (MATMUL, _addmv),
    "aten::linear": (MATMUL, _linear),
    "aten::convolution": (CONV, _convolution),
    "aten::_convolution": (CONV, _convolution),
    **{f"aten::conv{d}d": (CONV, _convnd) for d in (1, 2, 3)},
    **{f"aten::conv_transpose{d}d": (CONV, _conv_transposend) for d in (1, 2, 3)},
    "aten::cudnn_convolution": (CONV, _backend_conv),
    "aten::mkldnn_convolution": (CONV, _mkldnn_conv),
    **{f"aten::{n}": (ATTENTION, _sdpa_bhsd) for n in (
        "scaled_dot_product_attention",
        "_scaled_dot_product_attention_math",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )},
    "aten::_flash_attention_forward": (ATTENTION, _flash_forward),
    "aten::_efficient_attention_forward": (ATTENTION, _efficient_forward),
}


def op_flops(name: str, args: Sequence[Any], kwargs: dict | None = None) -> tuple[int, str | None]:
    """(FLOPs, kind) of one call of the op ``name`` (``"aten::mm"``; ``"aten.mm.default"`` and
    ``"mm"`` are accepted too). Unknown ops are (0, None)."""
    entry = OPS.get(normalize_name(name))
    if entry is None:
        return 0, None
    kind, formula = entry
    return formula(args, kwargs or {}), kind


def normalize_name(name: str) -> str:
    if "::" in name:
        return name.split(".", 1)[0]
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] in ("aten", "prims"):
        return f"{parts[0]}::{parts[1]}"
    return f"aten::{parts[0]}"


def categorize(kind: str | None, *, role: str | None = None, stage: str | None = None, in_sdpa: bool = False) -> str:
    """The category of an op of ``kind`` in this context. Rules:

    - attention kernel → its role (``self_attention``/``cross_attention``), else ``attention``;
    - matmul inside an attention role (a paged attention written as bmm blocks) → that role;
      inside an SDPA call that decomposed to bmm (the math path, e.g. on the meta device) →
      the role, else ``attention`` — so attention is counted once, as attention;
      otherwise ``linear``;
    - convolution in a DiT stage (patch embeddings) → ``linear``; elsewhere → ``vae_conv``;
    - anything else → ``other``.
    """
    if kind == ATTENTION:
        return role if role in ATTENTION_ROLES else "attention"
    if kind == MATMUL:
        if role in ATTENTION_ROLES:
            return role
        return "attention" if in_sdpa else "linear"
    if kind == CONV:
        return "linear" if stage in DIT_STAGES else "vae_conv"
    return "other"


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the stated peak (a fraction, not %)."""
    if seconds <= 0 or peak_flops <= 0:
        raise ValueError(f"mfu needs positive seconds and peak (got {seconds}, {peak_flops})")
    return flops / seconds / peak_flops


#: Stated peaks (FLOP/s, dense, per GPU). The spec-sheet bf16 figure is the one that reproduces
#: DESIGN §12's "DiT MFU 49 %" from its 678 ms × 4 GPUs per chunk; the measured GEMM figure is §12's.
PEAKS: dict[str, float] = {
    "h200-bf16": 989.5e12,
    "h200-tf32": 494.7e12,
    "h200-fp32": 67.0e12,
    "h200-bf16-gemm-measured": 788e12,
}
