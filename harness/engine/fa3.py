"""FlashAttention-3 forward (the ``fa3-fwd`` wheel, Hopper only) as attention backends.

* ``fa3`` — bf16 FA3 on the gather path's contiguous K/V (and an LSE-returning partial for the
  paged walk). The wheel is built without paged KV (``FLASHATTENTION_DISABLE_PAGEDKV``), so it
  cannot read the engine's block pool in place: the in-place paged path stays out of reach with
  this wheel, and ``paged`` can only use it group by group like the other partials.
* ``fa3-fp8`` — Q, K, V cast to e4m3 with one scale per head (amax over the head's tokens and
  channels), the descales handed to the kernel; Q and K arrive after their RMSNorm and RoPE (the
  engine's attention core sees them so). P is rounded to e4m3 inside the kernel.
* ``fa3-fp8-smooth`` — the same after two exact shifts that shrink what the e4m3 grid must hold:
  K minus its per-(head, channel) mean over the visible tokens (every score of one query moves by
  the same q·mean, which softmax ignores) and V minus its mean (rows of P sum to 1, so the mean
  is added back to the output in fp32).

e4m3 keeps 3 mantissa bits whatever the scale: a per-head scale only avoids overflow and the
subnormal range, it does not buy precision. Whether FP8 attention passes a gate is therefore a
question of how the model's outputs propagate a few-percent element error, decided by the
harness's gates (H6b), not assumed here.

Quantisation runs in the attention core (outside the compiled block graphs): per tensor, column
statistics of the (S, H·D) matrix (ATen reductions) and one fused scale-and-cast pass
(``torch.compile``'d on CUDA, dynamic shapes since the K length grows chunk by chunk). A first
version that reduced over (tokens, channels) of (S, H, D) in one compiled function spent ≈ 720 ms
of a 480×832 chunk (≈ 3.5 ms per self-attention call) in its Triton reductions, more than FP8
saved. Even now every call re-quantises the whole K/V window (28080 tokens at 480×832), which
costs about what the FP8 kernel saves; quantising K/V once, when a chunk is written to the cache
(an FP8 KV cache), is what would make FP8 attention pay.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import Tensor

from harness.errors import HarnessError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn
MIN_AMAX = 1e-12  # an all-zero head (or row) still gets a finite scale
PACKAGE = "fa3-fwd"
MODULE = "fa3_fwd_interface"


def unavailable_reason(device: torch.device | str | None = None) -> str | None:
    """Why FA3 cannot run here (None: it can). Checks the package, then the device."""
    try:
        importlib.import_module(MODULE)
    except Exception as e:  # noqa: BLE001  (a wheel built for another torch raises more than ImportError)
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"FlashAttention-3 needs the {PACKAGE} package ({MODULE} not importable: {msg})"
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda":
        return f"FlashAttention-3 runs on CUDA (Hopper) only, not on {dev.type}"
    if not torch.cuda.is_available():
        return "FlashAttention-3 needs a CUDA device and none is visible"
    major, _ = torch.cuda.get_device_capability()
    if major != 9:
        return f"FlashAttention-3 needs a Hopper GPU (sm_90), this one is sm_{major}x"
    return None


@functools.cache
def _interface():
    return importlib.import_module(MODULE)


@functools.cache
def _checked(device_type: str) -> str | None:
    return unavailable_reason(device_type)


def _require(x: Tensor):
    """The interface, or a one-line refusal; checked once per device type (400 calls a chunk)."""
    why = _checked(x.device.type)
    if why is not None:
        raise HarnessError(why)
    return _interface()


def _bshd(x: Tensor) -> Tensor:
    """(1, H, S, D) view of token-major storage → (1, S, H, D), FA3's layout (a view, no copy)."""
    return x.transpose(1, 2)


# ---- FP8 quantisation (pure functions; the CPU tests run them on float8 tensors too) -------------
def _cast(x2: Tensor, inv: Tensor, mean: Tensor | None) -> Tensor:
    y = x2.float() if mean is None else x2.float() - mean
    return (y * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8)


@functools.cache
def _compiled_cast():
    # one fused pointwise pass (read bf16, write e4m3); dynamic: the K length grows chunk by chunk
    return torch.compile(_cast, dynamic=True)


def quantize_heads(x: Tensor, smoothed: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """(S, H, D) → e4m3 (S, H, D), its per-head descale (H,) fp32, and — when ``smoothed`` — the
    per-(head, channel) mean over tokens (H, D) fp32 that was subtracted first:
    x ≈ x8 · descale (+ mean).

    The statistics are column reductions of the (S, H·D) matrix (one ``aminmax`` pass, plus the
    mean when smoothed): a head's amax after the shift is max(max − mean, mean − min) over its
    channels, so no shifted copy is ever materialised; the cast is one more pass."""
    n, h, d = x.shape
    x2 = x.reshape(n, h * d)
    lo, hi = torch.aminmax(x2, dim=0)
    lo, hi = lo.float(), hi.float()
    mean = x2.mean(dim=0, dtype=torch.float32) if smoothed else None
    amax = torch.maximum(hi - mean, mean - lo) if smoothed else torch.maximum(hi.abs(), lo.abs())
    scale = amax.view(h, d).amax(-1).clamp_min(MIN_AMAX) / FP8_MAX
    inv = (1.0 / scale).repeat_interleave(d)
    cast = _compiled_cast() if x.device.type == "cuda" else _cast
    x8 = cast(x2, inv, mean).view(n, h, d)
    return x8, scale, None if mean is None else mean.view(h, d)


def prepare_fp8(q: Tensor, k: Tensor, v: Tensor, smoothed: bool):
    """Token-major q, k, v → e4m3 q, k, v, their descales and V's mean (or None). Smoothing
    shifts K (exact: every score of a query moves by the same q·mean) and V (exact: added back
    after attention, rows of P sum to 1); Q is never shifted."""
    q8, qs, _ = quantize_heads(q)
    k8, ks, _ = quantize_heads(k, smoothed)
    v8, vs, vm = quantize_heads(v, smoothed)
    return q8, k8, v8, qs, ks, vs, vm


# ---- dense backends: (1, H, S, D) views in, (1, H, Sq, D) out -------------------------------------
def fa3_bf16(q: Tensor, k: Tensor, v: Tensor, *, out: Tensor | None = None) -> Tensor:
    """``out``: a (1, H, Sq, D) view of token-major storage the kernel writes into (see
    ``attention.OutputBuffers``); returned as the result."""
    fa = _require(q)
    if out is None:
        return fa.flash_attn_func(_bshd(q), _bshd(k), _bshd(v)).transpose(1, 2)
    return _fwd(fa, _bshd(q), _bshd(k), _bshd(v), out=_bshd(out)).transpose(1, 2)


def _fwd(fa, q: Tensor, k: Tensor, v: Tensor, *, out: Tensor | None = None, k_new: Tensor | None = None,
         v_new: Tensor | None = None, seqused_k: Tensor | None = None) -> Tensor:
    """The wheel's forward op on (1, S, H, D) tensors, with ``flash_attn_func``'s defaults. The
    registered op is called directly: the wheel's Python wrapper is a custom op whose checker
    refuses an output that aliases an input, which a given ``out`` always does."""
    q, k, k_new, v_new = (fa.maybe_contiguous(x) for x in (q, k, k_new, v_new))
    v = v.contiguous() if v.stride(-1) != 1 and v.stride(-3) != 1 else v
    result = fa.fa3_fwd_cuda.fwd(
        q, k, v, k_new, v_new, None, out,
        None, None, None, None, seqused_k,  # cu_seqlens q/k/k_new, seqused q/k
        None, None, None, None, None, None, None, None,  # max_seqlen q/k, page table, kv batch, left pad, rotary
        None, None, None,  # q/k/v descales
        q.shape[-1] ** -0.5, False, -1, -1, 0, 0.0, True, None, 1, None, 0)
    return result[0]


def fa3_bf16_append(q: Tensor, k: Tensor, v: Tensor, k_new: Tensor, v_new: Tensor, kept: Tensor, *,
                    out: Tensor | None = None) -> Tensor:
    """Token-major q (Sq, H, D) over the visible span k, v (S, H, D), whose last tokens the kernel
    first fills with k_new, v_new (n, H, D) — FA3's append-KV, fused into the attention kernel;
    ``kept`` (1,) int32 on the device = S − n. → (Sq, H, D), written into ``out`` when given."""
    fa = _require(q)
    o = _fwd(fa, q[None], k[None], v[None], k_new=k_new[None], v_new=v_new[None], seqused_k=kept,
             out=None if out is None else out[None])
    return o[0]


def fa3_fp8(q: Tensor, k: Tensor, v: Tensor, *, smoothed: bool = False) -> Tensor:
    fa = _require(q)
    q8, k8, v8, qs, ks, vs, vm = prepare_fp8(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), smoothed)
    o = fa.flash_attn_func(q8.unsqueeze(0), k8.unsqueeze(0), v8.unsqueeze(0),
                           q_descale=qs[None], k_descale=ks[None], v_descale=vs[None])  # (1, Sq, H, D) bf16
    if vm is not None:
        o = (o.float() + vm).to(q.dtype)  # vm (H, D) broadcasts over (1, Sq, H, D)
    return o.transpose(1, 2)


def fa3_fp8_smooth(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return fa3_fp8(q, k, v, smoothed=True)


def fa3_partial(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """(1, H, S, D) views → output (1, H, Sq, D) and the LSE (1, H, Sq), for the paged merge."""
    fa = _require(q)
    o, lse = fa.flash_attn_func(_bshd(q), _bshd(k), _bshd(v), return_attn_probs=True)
    return o.transpose(1, 2), lse


#: name → dense kernel, registered into ``attention.DENSE`` by that module.
DENSE = {"fa3": fa3_bf16, "fa3-fp8": fa3_fp8, "fa3-fp8-smooth": fa3_fp8_smooth}
#: the kernels above that take ``out=`` and write their result into it
WRITES_INTO = frozenset({"fa3"})
#: name → the same kernel writing the chunk's K/V into the cache itself (``attention.APPEND_KV``)
APPEND_KV = {"fa3": fa3_bf16_append}
