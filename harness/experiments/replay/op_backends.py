"""The backend registry and the built-in families: what can run a captured input, and how.

Attention — ``sdpa`` (PyTorch picks), ``sdpa-flash`` / ``sdpa-cudnn`` / ``sdpa-efficient`` /
``sdpa-math`` pinned with ``sdpa_kernel`` (on the CPU "flash" is ATen's flash-for-CPU), ``flex``
(FlexAttention; compiled on a GPU, eager elsewhere), ``gather`` and ``paged`` (the engine's two KV
paths, for inputs that carry a block table; ``paged-cudnn``/``-flash``/``-efficient`` pin its LSE
kernel on a GPU), ``flash-attn`` / ``flash-attn3`` (external packages, when importable); linear —
``aten``, ``aten-tf32`` (fp32 on a GPU), ``compiled`` (opt-in: max-autotune); conv — ``aten``,
``channels-last`` (inputs converted beforehand: kernel time only), ``cudnn-benchmark`` and
``ieee`` (no TF32) on a GPU; convert — ``reference``, ``compiled`` (GPU by default), ``fused``
(H4a's Triton kernel, GPU). The FlashAttention-3 rows and FP8 emulations register from
``op_backends_fa3``. ``register_backend`` adds one (tests register deliberately broken ones).

A backend's ``make`` builds the call (not timed) or raises ``Unsupported`` with the reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness.engine import attention as A
from harness.engine.convert import to_uint8
from harness.experiments.replay.cases import Case
from harness.experiments.replay.settings import KINDS

try:  # FlexAttention is missing from older torch builds: its rows then say so
    from torch.nn.attention.flex_attention import flex_attention
except ImportError:
    flex_attention = None


class Unsupported(Exception):
    """The backend cannot run this input here (device, dtype, missing block table or package)."""


@dataclass
class Prepared:
    fn: Callable[[], Any]
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


@dataclass(frozen=True)
class Backend:
    name: str
    kind: str
    make: Callable[[Case, dict, Any], Prepared]
    needs: tuple[str, ...] = ()  # "cuda"
    #: in the default set: True, False (only when named), or "cuda" (default on a GPU only)
    default: bool | str = True
    description: str = ""
    #: the H1b argument that puts the same kernel into the whole model, if there is one
    h1b: str | None = None
    #: its error is judged by a candidate's gate on the whole model (FP8 attention), not by the op
    #: check: failing the op check it is still timed (and never the winner)
    model_gated: bool = False


BACKENDS: dict[str, dict[str, Backend]] = {k: {} for k in KINDS}


def register_backend(kind: str, name: str, make: Callable[[Case, dict, Any], Prepared], *, needs: tuple[str, ...] = (),
                     default: bool | str = True, description: str = "", h1b: str | None = None,
                     model_gated: bool = False) -> None:
    if kind not in BACKENDS:
        raise ValueError(f"unknown op kind {kind!r} (known: {', '.join(KINDS)})")
    BACKENDS[kind][name] = Backend(name, kind, make, tuple(needs), default, description, h1b, model_gated)


def unregister_backend(kind: str, name: str) -> None:
    BACKENDS[kind].pop(name, None)


def backends_for(kind: str, device, names: list[str] | None = None) -> list[Backend]:
    reg = BACKENDS[kind]
    if names:
        return [reg[n] for n in names if n in reg]
    on_cuda = getattr(device, "type", str(device)) == "cuda"
    return [b for b in reg.values() if b.default is True or (b.default == "cuda" and on_cuda)]


def h1b_arms() -> dict[str, str]:
    """Local attention backend → its H1b argument, in registration order."""
    return {b.name: b.h1b for b in BACKENDS["attention"].values() if b.h1b is not None}


def is_half(case: Case) -> bool:
    return case.dtype in ("bfloat16", "float16")


# -- attention --
def attn_views(case: Case, t: dict) -> dict:
    """q/k/v as the kernels see them — (1, H, S, D), views of token-major storage where the engine
    has that — and token-major (S, H, D) views for the paths that take them."""
    lay = case.meta.get("layout", {})
    out = {}
    for n in "qkv":
        x = t[n]
        if lay.get(n) == "bhsd":
            out[n], out[n + "_shd"] = x, x[0].transpose(0, 1)
        else:
            out[n], out[n + "_shd"] = x.transpose(0, 1).unsqueeze(0), x
    return out


def _sdpa_backend(backend_name: str | None):
    def make(case: Case, t: dict, device) -> Prepared:
        a = attn_views(case, t)
        q, k, v = a["q"], a["k"], a["v"]
        ctx = contextlib.nullcontext
        if backend_name is not None:
            be = getattr(SDPBackend, backend_name)
            ctx = lambda: sdpa_kernel(be)  # noqa: E731
        return Prepared(lambda: F.scaled_dot_product_attention(q, k, v), ctx)

    return make


_FLEX: dict[str, Any] = {}


def _flex(case: Case, t: dict, device) -> Prepared:
    if flex_attention is None:
        raise Unsupported(f"no FlexAttention in torch {torch.__version__}")
    a = attn_views(case, t)
    q, k, v = a["q"], a["k"], a["v"]
    if device.type == "cuda":
        # one compiled function for all shapes: after the first shape change dynamo recompiles it
        # with dynamic sizes once, instead of once per K length
        fn = _FLEX.setdefault("cuda", torch.compile(flex_attention))
        return Prepared(lambda: fn(q, k, v))

    def eager():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "called without torch.compile": that is the point here
            return flex_attention(q, k, v)

    return Prepared(eager)


def _paged_inputs(case: Case, t: dict):
    """The K/V pools and block table the engine's KV paths take, rebuilt from the effective K/V:
    the captured block ids index a pool just large enough to hold them."""
    if "block_ids" not in t:
        raise Unsupported("no block table in this input (cross-attention, or captured without one)")
    a = attn_views(case, t)
    bs = int(case.meta["block_size"])
    ids = t["block_ids"]
    n_pool = int(ids.max()) + 1 if ids.numel() else 0
    pools = []
    for n in "kv":
        x = a[n + "_shd"]
        pool = torch.zeros((n_pool, bs, *x.shape[1:]), dtype=x.dtype, device=x.device)
        pool.index_copy_(0, ids, x.reshape(-1, bs, *x.shape[1:]))
        pools.append(pool)
    return a["q_shd"], pools[0], pools[1], ids, int(case.meta.get("group_blocks") or ids.numel())


def _paged_backend(partial: str | None):
    def make(case: Case, t: dict, device) -> Prepared:
        if partial is not None:
            if device.type != "cuda":
                raise Unsupported("pins the paged path's CUDA kernel: needs a CUDA device")
            if not is_half(case):
                raise Unsupported(f"the paged path runs float32 through 'efficient' only (input is {case.dtype})")
        q, kp, vp, ids, gb = _paged_inputs(case, t)

        @contextlib.contextmanager
        def pinned():
            old = A.PAGED_PARTIAL_CUDA
            if partial is not None:
                A.PAGED_PARTIAL_CUDA = partial
            try:
                yield
            finally:
                A.PAGED_PARTIAL_CUDA = old

        return Prepared(lambda: A.paged_attention(q, kp, vp, ids, attend=None, group_blocks=gb).transpose(0, 1).unsqueeze(0),
                        pinned)

    return make


def _gather(case: Case, t: dict, device) -> Prepared:
    q, kp, vp, ids, gb = _paged_inputs(case, t)
    attend = A.dense("sdpa")
    return Prepared(lambda: A.gather_attention(q, kp, vp, ids, attend=attend, group_blocks=gb).transpose(0, 1).unsqueeze(0))


def _flash_attn(module: str):
    def make(case: Case, t: dict, device) -> Prepared:
        try:  # an optional external package, looked up when a row asks for it
            fa = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001  (a broken install raises more than ImportError)
            raise Unsupported(f"{module} not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
        if device.type != "cuda" or not is_half(case):
            raise Unsupported(f"{module} needs CUDA and bf16/fp16 (got {device.type}, {case.dtype})")
        a = attn_views(case, t)
        q, k, v = (a[n + "_shd"].unsqueeze(0) for n in "qkv")  # (1, S, H, D): its native layout

        def run():
            o = fa.flash_attn_func(q, k, v)
            o = o[0] if isinstance(o, tuple) else o
            return o.transpose(1, 2)

        return Prepared(run)

    return make


# -- linear --
def linear_operands(case: Case, t: dict, device):
    """(input, weight, bias); a weight too large to capture is drawn once per input, seeded by its id."""
    x = t["input"]
    if "weight" in t:
        return x, t["weight"], t.get("bias")
    # not captured (too large): a seeded random weight of the captured shape and dtype
    meta = case.meta
    dt = getattr(torch, meta["weight_dtype"])
    key = f"{case.op_id}:w"
    if key not in t:
        g = torch.Generator(device=device)
        g.manual_seed(int(hashlib.sha1(case.op_id.encode()).hexdigest()[:8], 16))
        n, k = meta["weight_shape"]
        t[key] = (torch.randn((n, k), generator=g, device=device) * k ** -0.5).to(dt)
        t[key + "b"] = None if meta.get("bias_shape") is None else (torch.randn(meta["bias_shape"], generator=g, device=device) * 0.1).to(dt)
    return x, t[key], t[key + "b"]


def _linear_aten(tf32: bool):
    def make(case: Case, t: dict, device) -> Prepared:
        if tf32 and (device.type != "cuda" or case.dtype != "float32"):
            raise Unsupported("TF32 applies to float32 GEMMs on a CUDA device")
        x, w, b = linear_operands(case, t, device)

        @contextlib.contextmanager
        def flags():
            old = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = tf32
            try:
                yield
            finally:
                torch.backends.cuda.matmul.allow_tf32 = old

        return Prepared(lambda: F.linear(x, w, b), flags if device.type == "cuda" else contextlib.nullcontext)

    return make


def _linear_compiled(case: Case, t: dict, device) -> Prepared:
    x, w, b = linear_operands(case, t, device)
    fn = torch.compile(F.linear, mode="max-autotune-no-cudagraphs" if device.type == "cuda" else None, dynamic=False)
    return Prepared(lambda: fn(x, w, b))


# -- conv --
def conv_fn(case: Case):
    return {"conv1d": F.conv1d, "conv2d": F.conv2d, "conv3d": F.conv3d}[case.op]


def conv_args(case: Case) -> dict:
    m = case.meta
    return {k: (tuple(m[k]) if isinstance(m.get(k), list) else m[k]) for k in ("stride", "padding", "dilation", "groups") if k in m}


def _cudnn_flags(variant: str):
    """A context that sets cudnn.benchmark on (``cudnn-benchmark``) or TF32 off (``ieee``)."""
    @contextlib.contextmanager
    def ctx():
        cd = torch.backends.cudnn
        old = cd.benchmark, cd.allow_tf32
        if variant == "cudnn-benchmark":
            cd.benchmark = True
        else:
            cd.allow_tf32 = False
        try:
            yield
        finally:
            cd.benchmark, cd.allow_tf32 = old

    return ctx


def _conv_backend(variant: str):
    def make(case: Case, t: dict, device) -> Prepared:
        conv, kw = conv_fn(case), conv_args(case)
        x, w, b = t["input"], t["weight"], t.get("bias")
        ctx: Callable = contextlib.nullcontext
        if variant == "channels-last":
            fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
            if fmt is None:
                raise Unsupported(f"no channels-last format for {x.dim()}-D inputs")
            x, w = x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)
        elif variant in ("cudnn-benchmark", "ieee"):
            if device.type != "cuda":
                raise Unsupported(f"{variant} is a cuDNN setting: needs a CUDA device")
            if variant == "ieee" and case.dtype != "float32":
                raise Unsupported("TF32 is off-able for float32 convolutions only")
            ctx = _cudnn_flags(variant)
        return Prepared(lambda: conv(x, w, b, **kw), ctx)

    return make


# -- convert --
def _convert_reference(case: Case, t: dict, device) -> Prepared:
    x = t["frames"]
    return Prepared(lambda: to_uint8(x))


def _convert_compiled(case: Case, t: dict, device) -> Prepared:
    x = t["frames"]
    fn = torch.compile(to_uint8, dynamic=False)
    return Prepared(lambda: fn(x))


def _convert_fused(case: Case, t: dict, device) -> Prepared:
    if device.type != "cuda":
        raise Unsupported("the fused Triton conversion (H4a) runs on a CUDA device")
    try:  # optional: needs Triton, and the H4a kernel in this tree
        from harness.engine.fused_convert import to_uint8 as fused
    except ImportError as e:
        raise Unsupported(f"fused conversion not importable ({e})") from e
    x = t["frames"]
    return Prepared(lambda: fused(x))


def register_builtins() -> None:
    """The attention, linear, conv and convert families above (registering again replaces them)."""
    reg = register_backend
    reg("attention", "sdpa", _sdpa_backend(None), description="F.scaled_dot_product_attention, PyTorch picks the kernel")
    reg("attention", "sdpa-flash", _sdpa_backend("FLASH_ATTENTION"), description="SDPA pinned to flash (CPU: flash-for-CPU)",
        h1b="flash")
    reg("attention", "sdpa-cudnn", _sdpa_backend("CUDNN_ATTENTION"), needs=("cuda",), description="SDPA pinned to cuDNN",
        h1b="cudnn")
    reg("attention", "sdpa-efficient", _sdpa_backend("EFFICIENT_ATTENTION"), needs=("cuda",), description="SDPA pinned to mem-efficient",
        h1b="efficient")
    reg("attention", "sdpa-math", _sdpa_backend("MATH"), description="SDPA pinned to the math composite", h1b="math")
    reg("attention", "flex", _flex, description="FlexAttention (torch.compile on CUDA, eager elsewhere)")
    reg("attention", "gather", _gather, description="engine KV path: gather the blocks, then SDPA")
    reg("attention", "paged", _paged_backend(None), description="engine KV path: walk the block table, merge by LSE")
    for p in ("cudnn", "flash", "efficient"):
        reg("attention", f"paged-{p}", _paged_backend(p), needs=("cuda",), default="cuda",
            description=f"engine paged path with its CUDA LSE kernel pinned to {p}")
    reg("attention", "flash-attn", _flash_attn("flash_attn"), needs=("cuda",), description="external flash-attn (FA2) package")
    reg("attention", "flash-attn3", _flash_attn("flash_attn_interface"), needs=("cuda",), default="cuda",
        description="external FlashAttention-3 (Hopper) package")
    reg("linear", "aten", _linear_aten(False), description="F.linear (cuBLAS / CPU BLAS), TF32 off")
    reg("linear", "aten-tf32", _linear_aten(True), needs=("cuda",), default="cuda", description="F.linear with TF32 (float32 only)")
    reg("linear", "compiled", _linear_compiled, default=False, description="torch.compile max-autotune GEMM (slow to build)")
    reg("conv", "aten", _conv_backend("aten"), description="F.convNd with the process defaults (cuDNN: TF32 on)")
    reg("conv", "channels-last", _conv_backend("channels-last"), description="channels-last input and kernel (conversion not timed)")
    reg("conv", "cudnn-benchmark", _conv_backend("cudnn-benchmark"), needs=("cuda",), default="cuda",
        description="cudnn.benchmark = True (autotuned algorithm)")
    reg("conv", "ieee", _conv_backend("ieee"), needs=("cuda",), default="cuda", description="cuDNN with TF32 off (float32)")
    reg("convert", "reference", _convert_reference, description="engine.convert.to_uint8")
    reg("convert", "compiled", _convert_compiled, default="cuda", description="torch.compile(to_uint8)")
    reg("convert", "fused", _convert_fused, needs=("cuda",), default="cuda", description="H4a's one-kernel Triton conversion")
