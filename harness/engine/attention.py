"""Attention backends behind two small registries, so a candidate can switch them by name.

A forward's pick of the two is one typed record, ``AttentionChoice``.

* dense kernels (``DENSE``): q, k, v of shape (B, H, S, D) → (B, H, Sq, D). "sdpa" lets PyTorch
  pick; "flash", "cudnn", "efficient", "math" pin ``scaled_dot_product_attention`` to one backend
  (also spelled "sdpa-flash" etc.). A candidate may ``register_dense`` FlexAttention or an
  external flash-attn under a new name.
* KV paths (``KV_PATHS``): self-attention of the chunk's queries over a session's paged cache.
  "gather" copies the visible blocks (through the block table) into one contiguous K/V and runs a
  dense kernel — or, when the session's blocks are in the window layout (``kvcache``), hands the
  kernel a view of the pool and copies nothing; "paged" walks the block table in groups of blocks and merges the partial results
  with their log-sum-exp, so no more than one group of K/V is ever materialised (a Triton kernel
  that reads the pool in place can replace it under the same name).
* FlashAttention-3 (``engine.fa3``, when the ``fa3-fwd`` wheel and a Hopper GPU are there): dense
  "fa3" (bf16), "fa3-fp8" and "fa3-fp8-smooth" (e4m3 with per-head descales), and "fa3" as a
  partial of the paged walk; elsewhere they refuse with one line when called.

Token-major tensors (S, H, D) are what the model and the cache hold; the dense kernels get
(1, H, S, D) *views* of them (the BSHD memory layout flash/cuDNN read natively), never copies.

Where an attention result goes (``OutputBuffers``, H1d): by default every call allocates it. The
attention cores run between compiled graphs, so under CUDA graphs each result is a new address
that the next graph must first copy into its own input (cudagraph trees' input copies, ≈ 27 ms of
a 480×832 chunk on an H200). With output buffers each role's result always lands in one persistent
tensor marked as a static address, which the graphs read in place: a kernel that takes ``out=``
(``WRITES_INTO``: FA3 bf16) writes it there, any other result is copied there (the copy moves out
of the graph, it does not go away).

Who writes the chunk's K/V into the cache (H1e): by default the attention core copies them into
the window layout's slot (``kvcache.write``, ≈ 18 ms of copy kernels a 480×832 chunk) and the
kernel then reads them back. A dense kernel with an appending form (``APPEND_KV``: FA3's append-KV)
writes them itself, inside the attention kernel, and the copy goes. Or (H1f) the block's own
compiled code stores them into the pools where it makes them (``dit.store_kv``), and the core is
handed no K/V to write.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness.engine import fa3, fp8_fine, kv_fp8
from harness.errors import HarnessError
from harness.hooks import registries

DenseFn = Callable[[Tensor, Tensor, Tensor], Tensor]


def _sdpa(backend: SDPBackend | None) -> DenseFn:
    if backend is None:
        return F.scaled_dot_product_attention

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)

    return attend


DENSE: dict[str, DenseFn] = {"sdpa": _sdpa(None)}
for _name, _backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                        ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)]:
    DENSE[_name] = DENSE[f"sdpa-{_name}"] = _sdpa(_backend)


#: dense kernels that take ``out=`` (a (1, H, Sq, D) view) and return it, written
WRITES_INTO: set[str] = set()

#: (q (Sq, H, D), k, v (S, H, D) the visible span, k_new, v_new (n, H, D), kept (1,) int32 on the
#: device = S − n, *, out=None (Sq, H, D)) → (Sq, H, D): the kernel writes k_new, v_new into the
#: span's last n tokens and attends over all of it
AppendFn = Callable[..., Tensor]
#: dense kernel name → its appending form (H1e): the chunk's K/V written by the attention kernel
APPEND_KV: dict[str, AppendFn] = {}


def register_dense(name: str, fn: DenseFn, *, writes_into: bool = False) -> None:
    DENSE[name] = fn
    if writes_into:
        WRITES_INTO.add(name)
    else:
        WRITES_INTO.discard(name)


def dense(name: str) -> DenseFn:
    try:
        return DENSE[name]
    except KeyError:
        raise HarnessError(f"unknown attention backend {name!r} (known: {', '.join(sorted(DENSE))})") from None


def _bhsd(x: Tensor) -> Tensor:
    return x.transpose(0, 1).unsqueeze(0)


def _shd(x: Tensor) -> Tensor:
    return x[0].transpose(0, 1)


# ---- self-attention over the paged cache ---------------------------------------------------------
def _blocks(pool: Tensor, ids: Tensor | slice) -> Tensor:
    """The pool's rows ``ids`` as one (tokens, H, D) tensor: a view for a slice (the window
    layout keeps a session's visible blocks contiguous), a gathered copy for a block table."""
    rows = pool[ids] if isinstance(ids, slice) else pool.index_select(0, ids)
    return rows.flatten(0, 1)


def _sub(ids: Tensor | slice, start: int, n: int) -> Tensor | slice:
    if isinstance(ids, slice):
        return slice(ids.start + start, min(ids.start + start + n, ids.stop))
    return ids[start : start + n]


def _count(ids: Tensor | slice) -> int:
    return ids.stop - ids.start if isinstance(ids, slice) else ids.shape[0]


def gather_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_ids: Tensor | slice, *, attend: DenseFn,
                     group_blocks: int) -> Tensor:
    """q (Sq, H, D); pools (num_blocks, block_size, H, D); block_ids (n,) or a slice of the pool
    → (Sq, H, D). With a slice nothing is copied: the kernel reads the pool in place."""
    k, v = _blocks(k_pool, block_ids), _blocks(v_pool, block_ids)
    return _shd(attend(_bhsd(q), _bhsd(k), _bhsd(v)))


def _lse(lse: Tensor, q: Tensor) -> Tensor:
    # kernels pad or add a trailing unit dim to the LSE; keep (B, H, Sq)
    return lse.reshape(q.shape[0], q.shape[1], -1)[..., : q.shape[2]]


def _partial_math(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = s.logsumexp(-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v.float()), lse


def _partial_cpu(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    return o, _lse(lse, q)


def _partial_flash(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
    return o, _lse(lse, q)


def _partial_cudnn(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
    return o, _lse(lse, q)


def _partial_efficient(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[:2]
    return o, _lse(lse, q)


#: Kernels that return the attention output *and* its log-sum-exp, which the paged merge needs.
PARTIALS = {"math": _partial_math, "cpu": _partial_cpu, "flash": _partial_flash, "cudnn": _partial_cudnn,
            "efficient": _partial_efficient}


def _partial(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Attention of q over one group of K/V and the LSE (1, H, Sq) of its scores."""
    if q.device.type == "cuda":
        half = q.dtype in (torch.float16, torch.bfloat16)
        return (PARTIALS[PAGED_PARTIAL_CUDA] if half else _partial_efficient)(q, k, v)
    if q.device.type == "cpu":
        return _partial_cpu(q, k, v)
    return _partial_math(q, k, v)


#: Which LSE-returning kernel the paged path uses for bf16/fp16 on CUDA (fp32 has only "efficient").
#: Measured on an H200 at 480×832 (Q 4680, K 28080, 40 heads, 6-frame steps): cuDNN 5.6 ms,
#: flash 8.8 ms, efficient 16.7 ms, against 4.7 ms for gather + cuDNN.
PAGED_PARTIAL_CUDA = "cudnn"


def paged_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_ids: Tensor, *, attend: DenseFn,
                    group_blocks: int) -> Tensor:
    """Same contract as ``gather_attention``; the dense backend is not used (partials need the LSE)."""
    qb = _bhsd(q)
    out = lse = None
    for g in range(0, _count(block_ids), group_blocks):
        ids = _sub(block_ids, g, group_blocks)
        k, v = _blocks(k_pool, ids), _blocks(v_pool, ids)
        o_g, lse_g = _partial(qb, _bhsd(k), _bhsd(v))
        o_g, lse_g = o_g.float(), lse_g.float()
        if out is None:
            out, lse = o_g, lse_g
            continue
        new = torch.logaddexp(lse, lse_g)
        out = out * torch.exp(lse - new)[..., None] + o_g * torch.exp(lse_g - new)[..., None]
        lse = new
    return _shd(out.to(q.dtype))


KvPathFn = Callable[..., Tensor]
KV_PATHS: dict[str, KvPathFn] = {"gather": gather_attention, "paged": paged_attention}


def kv_path(name: str) -> KvPathFn:
    try:
        return KV_PATHS[name]
    except KeyError:
        raise HarnessError(f"unknown KV path {name!r} (known: {', '.join(sorted(KV_PATHS))})") from None


@dataclass(frozen=True)
class AttentionChoice:
    """The kernels a DiT forward runs: a KV path (``KV_PATHS``) for self-attention over the cache
    and a dense kernel (``DENSE``). The model holds one; a runtime switch (the engine's
    ``kv_path``/``attention``, H6b's per-step hook) installs another whole. Checked against the
    registries when made, so an unknown name fails where it is chosen, not in a forward. The
    functions are looked up at every forward, not kept: a hook's wrapper put into a table
    (``hooks.registries``) must be what runs while it is on."""

    kv_path: str = "gather"
    dense: str = "sdpa"

    def __post_init__(self) -> None:
        kv_path(self.kv_path)
        dense(self.dense)

    def kernels(self) -> tuple[KvPathFn, DenseFn]:
        return kv_path(self.kv_path), dense(self.dense)

    @property
    def writes_into(self) -> bool:
        """Whether the dense kernel takes ``out=`` (``WRITES_INTO``)."""
        return self.dense in WRITES_INTO

    def appender(self, kv_fn: KvPathFn) -> AppendFn | None:
        """The dense kernel's appending form (``APPEND_KV``) where this choice can use one: on the
        gather path, and not while a hook wraps the KV paths (it must see the chunk's K/V go in)."""
        if self.kv_path != "gather" or getattr(kv_fn, "_capture_of", None) is not None:
            return None
        return APPEND_KV.get(self.dense)


class OutputSlot(NamedTuple):
    """A role's persistent result: ``rows`` (S, H, D), what kernels write, and ``flat``, its
    (S, H·D) view marked as a static address, what the compiled code after the core reads. Handing
    on the flat view keeps the graphs that read a buffer apart from those that read fresh (S, H, D)
    results (dynamo's guards see the rank), so both can live in one process, each compiled with the
    inputs it gets."""

    rows: Tensor
    flat: Tensor


class OutputBuffers:
    """One persistent result per (attention role, shape, dtype, device), see the module docstring.
    A role's slot holds one result at a time: the compiled code after the attention core consumes
    it before that role runs again, in stream order."""

    def __init__(self) -> None:
        self._slots: dict[tuple, OutputSlot] = {}

    def take(self, role: str, like: Tensor) -> OutputSlot:
        """The role's slot for results shaped like ``like`` (S, H, D)."""
        key = (role, tuple(like.shape), like.dtype, like.device)
        slot = self._slots.get(key)
        if slot is None:
            from torch._dynamo import mark_static_address  # dynamo only where buffers are used

            rows = torch.empty(like.shape, dtype=like.dtype, device=like.device)
            flat = rows.view(rows.shape[0], -1)
            mark_static_address(flat)
            slot = self._slots[key] = OutputSlot(rows, flat)
        return slot

    def __len__(self) -> int:
        return len(self._slots)


def writing_into(attend: DenseFn, slot: OutputSlot) -> DenseFn:
    """``attend`` (a ``WRITES_INTO`` kernel) with its result written into the slot."""
    fn = functools.partial(attend, out=_bhsd(slot.rows))
    name = getattr(attend, "_capture_name", None)  # what the capture hook records the kernel as
    if name is not None:
        fn._capture_name = name  # type: ignore[attr-defined]
    return fn


def settle(result: Tensor, slot: OutputSlot) -> Tensor:
    """The slot holding ``result`` (S, H, D), as its flat view: left as it is when the kernel wrote
    there, copied in otherwise."""
    if result.data_ptr() != slot.rows.data_ptr():
        slot.rows.copy_(result)
    return slot.flat


def cross_attention(q: Tensor, k: Tensor, v: Tensor, *, attend: DenseFn) -> Tensor:
    """q (Sq, H, D) over cached text K/V already in (1, H, L, D) layout → (Sq, H, D)."""
    return _shd(attend(_bhsd(q), k, v))


def _fp8_kernel(mode: str) -> DenseFn:
    """The Triton kernel of ``mode`` as a dense backend (``engine/fused_fp8_attention``, imported
    at the first call: only a GPU run has Triton): (1, H, S, D) views → (1, H, Sq, D), written into
    ``out`` (a (1, H, Sq, D) view) when given."""
    qk_block, pv = fp8_fine.MODES[mode]

    def attend(q: Tensor, k: Tensor, v: Tensor, *, out: Tensor | None = None) -> Tensor:
        from harness.engine.fused_fp8_attention import attention as fused  # Triton: imported only on a GPU

        return fused(q[0], k[0], v[0], qk_block=qk_block, pv=pv, out=None if out is None else out[0])[None]

    return attend


def _register_fa3() -> None:
    for name, fn in fa3.DENSE.items():
        register_dense(name, fn, writes_into=name in fa3.WRITES_INTO)
    APPEND_KV.update(fa3.APPEND_KV)
    PARTIALS["fa3"] = fa3.fa3_partial
    # FA3's FP8 numerics emulated on any device (the CPU stand-in of fa3-fp8 and of H6d)
    DENSE["fp8-emulated"] = kv_fp8.fp8_emulated_dense
    # H6f's finer FP8 (P·V only, per-block Q/K scales), emulated on any device
    for mode in fp8_fine.MODES:
        DENSE[fp8_fine.backend_name(mode)] = fp8_fine.dense(mode)
        register_dense(fp8_fine.kernel_name(mode), _fp8_kernel(mode), writes_into=True)  # its Triton kernel: CUDA only


_register_fa3()
# The hooks' capture wraps these tables' entries while it is on (engine → hooks, never back).
registries.lend_attention("dense", DENSE)
registries.lend_attention("kv_path", KV_PATHS)


def check_backend(name: str, device: str) -> None:
    """Refuse, in one line, a dense backend that does not exist or — FA3 without its wheel or a
    Hopper GPU — cannot run on ``device``: for commands to call before any engine is built (the
    kernels themselves only refuse at their first call, inside a rank)."""
    dense(name)
    why = unavailable_reason(name, device)
    if why is not None:
        raise HarnessError(f"runtime.attention={name}: {why}")


#: dense backends that are Triton kernels of the project's own (H6f's FP8 attention)
TRITON_DENSE = frozenset(fp8_fine.kernel_name(m) for m in fp8_fine.MODES)


def gpu_only(name: str) -> bool:
    """A dense backend only a GPU runs (FA3's, the project's Triton kernels): the meta-device FLOP
    count goes through SDPA's path instead."""
    return name in fa3.DENSE or name in TRITON_DENSE


def unavailable_reason(name: str, device) -> str | None:
    """Why the dense backend ``name`` cannot run on ``device``: FA3 without its wheel or a Hopper
    GPU, one of ``TRITON_DENSE`` off CUDA or without Triton (None: it can, or it runs anywhere)."""
    if name in fa3.DENSE:
        return fa3.unavailable_reason(device)
    if name not in TRITON_DENSE:
        return None
    if torch.device(device).type != "cuda":
        return f"the Triton kernel {name} runs on CUDA only, not on {torch.device(device).type}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return f"the Triton kernel {name} needs the triton package"
    return None
