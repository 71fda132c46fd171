"""H6f's FP8 attention as one Triton kernel: FP8 in P·V only (``pv``) or per-block Q/K scales
(``qk-block``), the numerics of ``fp8_fine`` in FlashAttention's single pass.

``fp8_fine`` answers whether a placement passes the gate, slowly (it materialises the scores).
This is the kernel that answers what the placement buys: one program per (head, block of
``BLOCK_M`` queries) walks the keys in blocks of ``BLOCK_N`` with the online softmax and never
leaves registers for the scores.

* ``pv``: the scores from the inputs (bf16) with float32 accumulation, P = exp(s − m) scaled by
  448 and cast to e4m3, V in e4m3 with one scale per (head, channel) over the keys, the product
  on FP8 tensor cores; the output divided by the float32 sum of the unrounded P and multiplied
  by V's channel scales / 448 at the end.
* ``qk-block``: Q in e4m3 with one scale per query row, K with one per (head, block of
  ``fp8_fine.K_BLOCK`` keys) — a scalar per key block, since ``BLOCK_N`` divides ``K_BLOCK`` —
  the scores on FP8 tensor cores times the two scales; P rounded to bf16 for a bf16 P·V, as any
  bf16 flash kernel does (the one place it rounds where ``fp8_fine`` does not).

How it differs from ``fp8_fine``: the online softmax casts P against the running row maximum, not
the final one. e4m3 is a floating-point format, so a factor 2^(m_final − m_running) applied later
moves which values are subnormal (P·448 < 2⁻⁶) and nothing else; the sums run in another order.
The tests hold the kernel to the emulation where the keys fit one block and to the emulation's
error against the exact attention otherwise.

The operands are quantised before the kernel (``prepare``): V's channel scales need every key, so
each from Triton passes of its own: V's amax per channel over every key, then its codes stored
(H, D, Sk), since FP8 tensor cores read P·V's second operand K-major (``v_codes``); Q's codes a
row at a time and K's a key block at a time (``row_codes``).

Needs Triton (and a CUDA device, or the interpreter on CPU tensors): only the H6f backends'
CUDA path and the tests import this module.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from harness.engine.fa3 import FP8, FP8_MAX, MIN_AMAX
from harness.engine.fp8_fine import K_BLOCK
from harness.engine.triton_round import to_bf16, to_e4m3

LOG2E = math.log2(math.e)


@triton.jit
def _key_block(q, rs, m_i, l_i, acc, start, k_ptr, v_ptr, ks_ptr, sk, k_ss, v_sa, v_sb, qk_scale, dims,
               BLOCK_N: tl.constexpr, KB: tl.constexpr, QK8: tl.constexpr, PV8: tl.constexpr, FMAX: tl.constexpr,
               MASK: tl.constexpr, EMULATE: tl.constexpr):
    """One block of keys into the running (row max, row sum, accumulator); ``MASK`` only for the
    last, partial block (the pointers are the head's). V's block is (BLOCK_N, D): for FP8 its codes
    are stored (H, D, Sk), so the block is K-major."""
    n = start + tl.arange(0, BLOCK_N)
    km = n < sk
    if MASK:
        k = tl.load(k_ptr + n[:, None] * k_ss + dims[None, :], mask=km[:, None], other=0.0)
        v = tl.load(v_ptr + n[:, None] * v_sa + dims[None, :] * v_sb, mask=km[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + n[:, None] * k_ss + dims[None, :])
        v = tl.load(v_ptr + n[:, None] * v_sa + dims[None, :] * v_sb)
    if EMULATE:  # the interpreter's dot: float32 products of the operands' exact values
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k))
    if QK8:
        s = s * rs[:, None] * tl.load(ks_ptr + start // KB)
    else:
        s = s * qk_scale
    if MASK:
        s = tl.where(km[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if PV8:
        p8 = to_e4m3(p * FMAX, EMULATE)
        if EMULATE:
            acc += tl.dot(p8.to(tl.float32), v.to(tl.float32))
        else:
            acc = tl.dot(p8, v, acc)
    else:
        if EMULATE:
            acc += tl.dot(to_bf16(p, EMULATE), v.to(tl.float32))
        else:
            acc = tl.dot(p.to(tl.bfloat16), v, acc)
    return m_new, l_i, acc


@triton.jit
def _fp8_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, qs_ptr, ks_ptr, vs_ptr, sq, sk,
                          q_sh, q_ss, k_sh, k_ss, v_sh, v_sa, v_sb, o_sh, o_ss, ks_sh, qk_scale,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr,
                          QK8: tl.constexpr, PV8: tl.constexpr, FMAX: tl.constexpr, EMULATE: tl.constexpr):
    h = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    rm = rows < sq
    q = tl.load(q_ptr + h * q_sh + rows[:, None] * q_ss + dims[None, :], mask=rm[:, None], other=0.0)
    rs = qk_scale
    if QK8:
        rs = tl.load(qs_ptr + h * sq + rows, mask=rm, other=0.0) * qk_scale  # the row's scale and 1/√D·log2 e
    if EMULATE:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    k_ptr += h * k_sh
    v_ptr += h * v_sh
    ks_ptr += h * ks_sh
    whole = (sk // BLOCK_N) * BLOCK_N
    for start in range(0, whole, BLOCK_N):
        m_i, l_i, acc = _key_block(q, rs, m_i, l_i, acc, start, k_ptr, v_ptr, ks_ptr, sk, k_ss, v_sa, v_sb, qk_scale,
                                   dims, BLOCK_N, KB, QK8, PV8, FMAX, False, EMULATE)
    if whole < sk:
        m_i, l_i, acc = _key_block(q, rs, m_i, l_i, acc, whole, k_ptr, v_ptr, ks_ptr, sk, k_ss, v_sa, v_sb, qk_scale,
                                   dims, BLOCK_N, KB, QK8, PV8, FMAX, True, EMULATE)
    out = acc / l_i[:, None]
    if PV8:
        out = out * (tl.load(vs_ptr + h * D + dims) / FMAX)[None, :]
    tl.store(o_ptr + h * o_sh + rows[:, None] * o_ss + dims[None, :], out.to(o_ptr.dtype.element_ty),
             mask=rm[:, None])


@triton.jit
def _v_amax_kernel(v_ptr, amax_ptr, sk, v_sh, v_ss, D: tl.constexpr, BS: tl.constexpr):
    """Each channel's |V| maximum over one block of BS keys, folded into (H, D) by atomic max (the
    values are ≥ 0, so the float order is the integers')."""
    h = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BS + tl.arange(0, BS)
    dims = tl.arange(0, D)
    x = tl.load(v_ptr + h * v_sh + n[:, None] * v_ss + dims[None, :], mask=(n < sk)[:, None], other=0.0)
    tl.atomic_max(amax_ptr + h * D + dims, tl.max(tl.abs(x.to(tl.float32)), axis=0))


@triton.jit
def _v_codes_kernel(v_ptr, amax_ptr, codes_ptr, vs_ptr, sk, v_sh, v_ss, c_sh, c_sd, FMAX: tl.constexpr,
                    AMIN: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, EMULATE: tl.constexpr):
    """One block of BS keys of V as e4m3 codes with its channels' scales, written (H, D, Sk): the
    layout FP8 tensor cores read as P·V's second operand."""
    h = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    n = blk * BS + tl.arange(0, BS)
    dims = tl.arange(0, D)
    scale = tl.maximum(tl.load(amax_ptr + h * D + dims), AMIN) / FMAX
    if blk == 0:
        tl.store(vs_ptr + h * D + dims, scale)
    m = (n < sk)[:, None]
    x = tl.load(v_ptr + h * v_sh + n[:, None] * v_ss + dims[None, :], mask=m, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[None, :]), -FMAX), FMAX)
    tl.store(codes_ptr + h * c_sh + dims[None, :] * c_sd + n[:, None], to_e4m3(q, EMULATE), mask=m)


@triton.jit
def _row_codes_kernel(x_ptr, codes_ptr, s_ptr, n_rows, x_sh, x_ss, c_sh, c_ss, s_sh, FMAX: tl.constexpr,
                      AMIN: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, PER_ROW: tl.constexpr,
                      EMULATE: tl.constexpr):
    """BS rows of one head as e4m3 codes: one scale per row (``PER_ROW``: Q) or one for the BS rows
    together (K's key block)."""
    h = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    r = blk * BS + tl.arange(0, BS)
    dims = tl.arange(0, D)
    m = (r < n_rows)[:, None]
    x = tl.load(x_ptr + h * x_sh + r[:, None] * x_ss + dims[None, :], mask=m, other=0.0).to(tl.float32)
    if PER_ROW:
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), AMIN) / FMAX
        tl.store(s_ptr + h * s_sh + r, scale, mask=r < n_rows)
        q = tl.math.div_rn(x, scale[:, None])
    else:
        scale = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), AMIN) / FMAX
        tl.store(s_ptr + h * s_sh + blk, scale)
        q = tl.math.div_rn(x, scale)
    q = tl.minimum(tl.maximum(q, -FMAX), FMAX)
    tl.store(codes_ptr + h * c_sh + r[:, None] * c_ss + dims[None, :], to_e4m3(q, EMULATE), mask=m)


def v_codes(v: Tensor) -> tuple[Tensor, Tensor]:
    """(H, Sk, D) with unit last stride → e4m3 codes (H, Sk, D), stored (H, D, Sk), and the scales
    (H, D) fp32: ``e4m3_codes(v, amax_scale(v, dim=1))``, two passes over V."""
    h, sk, d = v.shape
    # each channel's row of codes starts 16-byte aligned (Triton then loads the P·V operand in
    # vectors, not byte by byte: 14 040 keys at 480×832 is not a multiple of 16)
    codes = torch.empty(h, d, triton.cdiv(sk, 128) * 128, dtype=FP8, device=v.device)[:, :, :sk]
    vs = torch.empty(h, d, dtype=torch.float32, device=v.device)
    amax = torch.zeros(h, d, dtype=torch.float32, device=v.device)
    bs = 64 if v.is_cuda else 32
    grid = (h, triton.cdiv(sk, bs))
    _v_amax_kernel[grid](v, amax, sk, v.stride(0), v.stride(1), D=d, BS=bs)
    _v_codes_kernel[grid](v, amax, codes, vs, sk, v.stride(0), v.stride(1), codes.stride(0), codes.stride(1),
                          FMAX=FP8_MAX, AMIN=MIN_AMAX, D=d, BS=bs, EMULATE=not v.is_cuda)
    return codes.transpose(1, 2), vs


def row_codes(x: Tensor, *, block: int | None) -> tuple[Tensor, Tensor]:
    """(H, S, D) with unit last stride → e4m3 codes (H, S, D) and their scales: (H, S), one per row
    (``block`` None: Q), or (H, ⌈S / block⌉), one per block of rows (K), as ``fp8_fine`` scales them."""
    h, n, d = x.shape
    codes = torch.empty(h, n, d, dtype=FP8, device=x.device)
    bs = block or (64 if x.is_cuda else 16)
    scales = torch.empty(h, n if block is None else triton.cdiv(n, block), dtype=torch.float32, device=x.device)
    _row_codes_kernel[(h, triton.cdiv(n, bs))](x, codes, scales, n, x.stride(0), x.stride(1), codes.stride(0),
                                               codes.stride(1), scales.stride(0), FMAX=FP8_MAX, AMIN=MIN_AMAX, D=d,
                                               BS=bs, PER_ROW=block is None, EMULATE=not x.is_cuda)
    return codes, scales


#: on the GPU: (BLOCK_M, BLOCK_N, warps, stages) timed at the first call of each form (not per key
#: count: the window grows over the first chunks, and each new count would time them all again)
_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
            for m, n, w, st in ((128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3), (64, 128, 4, 3), (128, 64, 4, 3))]
_tuned_kernel = triton.autotune(configs=_CONFIGS, key=["D", "QK8", "PV8"])(_fp8_attention_kernel)
#: the interpreter's blocks: small, so a test's few hundred keys take several blocks
CPU_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 32}


class Prepared(NamedTuple):
    """The kernel's operands: e4m3 codes or the inputs as given, and the scales (None where a mode
    has none): Q's per row (H, Sq), K's per key block (H, blocks), V's per channel (H, D)."""

    q: Tensor
    k: Tensor
    v: Tensor
    qs: Tensor | None
    ks: Tensor | None
    vs: Tensor | None


def prepare(q: Tensor, k: Tensor, v: Tensor, *, qk_block: bool, pv: bool) -> Prepared:
    """(H, Sq, D), (H, Sk, D), (H, Sk, D) views → the kernel's operands, quantised as ``fp8_fine``
    rounds them (the same scales, the same codes)."""
    qs = ks = vs = None
    if qk_block:
        q, qs = row_codes(q, block=None)
        k, ks = row_codes(k, block=K_BLOCK)
    if pv:
        v, vs = v_codes(v)
    return Prepared(q, k, v, qs, ks, vs)


def attention(q: Tensor, k: Tensor, v: Tensor, *, qk_block: bool, pv: bool, out: Tensor | None = None) -> Tensor:
    """(H, Sq, D), (H, Sk, D), (H, Sk, D) → (H, Sq, D) in q's dtype, stored token-major ((Sq, H, D)
    memory, the layout the model holds) — or written into ``out`` (an (H, Sq, D) view with unit
    last stride, H1d's static buffer) and returned."""
    if q.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"expected (H, Sq, D) and two (H, Sk, D), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    h, sq, d = q.shape
    sk = k.shape[1]
    if d not in (16, 32, 64, 128, 256) or sk == 0:
        raise ValueError(f"the kernel takes a head dim of 16..256 (a power of two) and ≥ 1 key, got D={d}, Sk={sk}")
    if q.is_cuda and not q.dtype == k.dtype == v.dtype == torch.bfloat16:
        raise ValueError(f"on CUDA the kernel attends bf16 inputs, got {q.dtype}, {k.dtype}, {v.dtype}")
    if out is None:
        out = torch.empty(sq, h, d, dtype=q.dtype, device=q.device).transpose(0, 1)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1 or out.device != q.device:
        raise ValueError(f"expected an output {tuple(q.shape)} {q.dtype} with unit last stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if sq == 0:
        return out
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    p = prepare(q, k, v, qk_block=qk_block, pv=pv)
    dummy = out  # a pointer for the scales a mode does not read
    args = (p.q, p.k, p.v, out, p.qs if qk_block else dummy, p.ks if qk_block else dummy, p.vs if pv else dummy, sq, sk,
            p.q.stride(0), p.q.stride(1), p.k.stride(0), p.k.stride(1), *p.v.stride(), out.stride(0), out.stride(1),
            p.ks.stride(0) if qk_block else 0, d ** -0.5 * LOG2E)  # scores in log2 units: exp2 is the GPU's instruction
    consts = dict(D=d, KB=K_BLOCK, QK8=qk_block, PV8=pv, FMAX=FP8_MAX, EMULATE=not q.is_cuda)
    if q.is_cuda:
        def grid(meta):
            return (triton.cdiv(sq, meta["BLOCK_M"]), h)

        _tuned_kernel[grid](*args, **consts)
    else:
        _fp8_attention_kernel[(triton.cdiv(sq, CPU_BLOCKS["BLOCK_M"]), h)](*args, **consts, **CPU_BLOCKS)
    return out
