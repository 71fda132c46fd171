"""``replay``: time captured op inputs (``--hooks capture``) on every backend that can run them.

    python -m harness replay RUN_DIR [--ops attention,linear,conv,convert] [--backends a,b] [--repeats N]
    python -m harness replay RUN_DIR --single OP_ID [--backend NAME] [--no-profiler]
    python -m harness replay --synthetic lingbot-480x832 [--sp 1,2] [--kv 4680,14040,28080] --out DIR

For each captured input and each backend: build the call (not timed), run it once (``first_ms``:
compilation included), compare the result with an FP64 reference, then warm up and time repeated
calls — CUDA events on a GPU, ``perf_counter`` on the CPU. A backend that cannot run the input
(no kernel for the device/dtype/shape, missing package, out of memory, an exception) or whose
result fails the check is a *failure* with its reason and no time: it never shows up as fast.

References (float64, on the replay device):
* attention — a sample of query positions × heads (``SAMPLE_QUERIES`` × ``SAMPLE_HEADS``, spread
  evenly, first and last included) against *all* effective keys;
* linear — a sample of rows of the input against the full weight;
* conv — a sample of output channels over the full output;
* convert — the exact reference rule (``engine.convert.to_uint8`` in float32 on the host); a
  single differing byte fails.
Pass: ``allclose(atol=0.03, rtol=0.03)`` and relative L2 ≤ 0.01 (DESIGN §5's threshold gate),
applied to the sampled values.

Backends (``--list-backends`` prints them with what they need): attention — ``sdpa`` (PyTorch
picks), ``sdpa-flash`` / ``sdpa-cudnn`` / ``sdpa-efficient`` / ``sdpa-math`` pinned with
``sdpa_kernel`` (on the CPU "flash" is ATen's flash-for-CPU), ``flex`` (FlexAttention; compiled on
a GPU, eager elsewhere), ``gather`` and ``paged`` (the engine's two KV paths, for inputs that carry
a block table; ``paged-cudnn``/``-flash``/``-efficient`` pin its LSE kernel on a GPU),
``flash-attn`` / ``flash-attn3`` (external packages, when importable); linear — ``aten``,
``aten-tf32`` (fp32 on a GPU), ``compiled`` (opt-in: max-autotune); conv — ``aten``,
``channels-last`` (inputs converted beforehand: kernel time only), ``cudnn-benchmark`` and
``ieee`` (no TF32) on a GPU; convert — ``reference``, ``compiled`` (GPU by default), ``fused``
(H4a's Triton kernel, GPU).
``register_backend`` adds one (tests register deliberately broken ones).

Outputs in ``--out`` (default: the run directory): ``replay.json``, ``replay.md`` (a table per
op kind: median ms and ratio to the row's best, the local winner, and — for attention — the
whole-model result of candidate H1b for that kernel when ``--compare DIR`` holds a
``compare.json`` of ``compare --candidate H1b:<backend>``), and ``replay_<kind>.png`` heat maps of
time / best per shape.

``--synthetic PRESET`` builds the production attention inputs directly (random q/k/v in the
preset's dtype, token-major as the engine holds them, with a block table) instead of reading a
capture: self-attention for SP ∈ ``--sp`` (local heads = heads/SP, all tokens of the chunk) ×
denoise/commit × effective K lengths ``--kv``, and cross-attention over the text. Denoise and
commit passes have the same shapes (only the values differ in a real run), so their rows measure
the same kernels twice — a check on timing noise.

``--single OP_ID`` runs one input on one backend, once after a warm-up, for a kernel profiler:
inside an NVTX range ``replay:<OP_ID>`` and between ``cudaProfilerStart``/``Stop``, so e.g.
``ncu --profile-from-start off --set full -o op python -m harness replay RUN --single ID --backend
sdpa-cudnn --no-profiler`` profiles exactly that call. It prints the kernels launched
(torch.profiler; on the CPU the ATen op tree).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from harness.errors import HarnessError
from harness.limits import MAX_JSON_BYTES, read_bounded

KINDS: tuple[str, ...] = ("attention", "linear", "conv", "convert")
ATOL = RTOL = 0.03
REL_L2 = 0.01
SAMPLE_QUERIES = 64
SAMPLE_HEADS = 8
SAMPLE_ROWS = 128
SAMPLE_CHANNELS = 8
DEFAULT_WARMUP = 3
DEFAULT_REPEATS = 20
SCHEMA = 1
#: Local backend → the H1b argument that puts the same kernel into the whole model.
H1B_ARGS = {"sdpa-flash": "flash", "sdpa-cudnn": "cudnn", "sdpa-efficient": "efficient", "sdpa-math": "math"}
SYNTHETIC_KV = (4680, 14040, 28080)
SYNTHETIC_SP = (1, 2)


class Unsupported(Exception):
    """The backend cannot run this input here (device, dtype, missing block table or package)."""


# ---- cases -----------------------------------------------------------------------------------
@dataclass
class Case:
    op_id: str
    op: str
    kind: str
    phase: str
    role: str | None
    meta: dict
    shapes: dict[str, list[int]]
    dtype: str
    load: Callable[[Any], dict]  # device → tensors
    context: dict = field(default_factory=dict)
    source: str = "capture"

    def label(self) -> str:
        s = self.shapes
        if self.kind == "attention":
            q, k = s["q"], s["k"]
            lay = self.meta.get("layout", {})
            sq, h, d = q
            skv = k[2] if lay.get("k") == "bhsd" else k[0]
            sp = f" sp{self.meta['sp']}" if "sp" in self.meta else ""
            return f"{'self' if self.op == 'self_attention' else 'cross'} {self.phase}{sp} q{sq} k{skv} h{h} d{d} {self.dtype}"
        if self.kind == "linear":
            x, w = s["input"], self.meta["weight_shape"]
            return f"linear {self.phase} {math.prod(x[:-1])}×{x[-1]}→{w[0]} {self.dtype}"
        if self.kind == "conv":
            return f"{self.op} {self.phase} {'×'.join(map(str, s['input']))} k{'×'.join(map(str, s['weight'][2:]))}→{s['weight'][0]}"
        return f"convert {'×'.join(map(str, s['frames']))} {self.dtype}"

    def flops(self) -> int | None:
        s = self.shapes
        if self.kind == "attention":
            lay = self.meta.get("layout", {})
            sq, h, d = s["q"]
            skv = s["k"][2] if lay.get("k") == "bhsd" else s["k"][0]
            return 4 * sq * skv * h * d
        if self.kind == "linear":
            x, w = s["input"], self.meta["weight_shape"]
            return 2 * math.prod(x[:-1]) * x[-1] * w[0]
        if self.kind == "conv":
            out = _conv_out_shape(s["input"], s["weight"], self.meta)
            if out is None:
                return None
            return 2 * math.prod(out) * (s["input"][1] // int(self.meta.get("groups", 1))) * math.prod(s["weight"][2:])
        return None

    def describe(self) -> dict:
        return {"op_id": self.op_id, "op": self.op, "kind": self.kind, "phase": self.phase, "role": self.role,
                "label": self.label(), "shapes": self.shapes, "dtype": self.dtype, "flops": self.flops(),
                "context": self.context, "source": self.source,
                "meta": {k: v for k, v in self.meta.items() if k not in ("layout",)}}


def _conv_out_shape(x: list[int], w: list[int], meta: dict) -> list[int] | None:
    nd = len(w) - 2
    pad = meta.get("padding", 0)
    if isinstance(pad, str):
        if pad == "same":
            return [x[0], w[0], *x[2:]]
        pad = 0
    rep = lambda v: list(v) if isinstance(v, (list, tuple)) else [v] * nd  # noqa: E731
    p, st, dl = rep(pad), rep(meta.get("stride", 1)), rep(meta.get("dilation", 1))
    sp = [(x[2 + i] + 2 * p[i] - dl[i] * (w[2 + i] - 1) - 1) // st[i] + 1 for i in range(nd)]
    return [x[0], w[0], *sp]


def load_cases(run_dir: str | Path, ops: tuple[str, ...] = KINDS) -> list[Case]:
    """The saved entries of ``RUN_DIR/capture/index.jsonl`` (in capture order), of the given kinds."""
    from harness.hooks.capture import read_index

    d = Path(run_dir)
    cap = d if (d / "index.jsonl").exists() else d / "capture"
    if not (cap / "index.jsonl").exists():
        raise HarnessError(f"{run_dir} holds no capture/index.jsonl (serve with --hooks capture first)")
    cases = []
    for rec in read_index(cap):
        if rec.get("status") != "saved" or rec.get("kind") not in ops:
            continue
        path = cap / rec["file"]

        def load(device, path=path, size=rec.get("bytes")):
            from harness.hooks.capture import load_capture

            if size is not None and path.stat().st_size != size:  # read only what the index says was written
                raise HarnessError(f"{path} is {path.stat().st_size} bytes, the capture index says {size}")
            tensors, _ = load_capture(path)
            return {k: t.to(device) for k, t in tensors.items()}

        dtypes = {k: v["dtype"] for k, v in rec["tensors"].items()}
        main = "q" if "q" in dtypes else ("frames" if "frames" in dtypes else "input")
        cases.append(Case(op_id=rec["op_id"], op=rec["op"], kind=rec["kind"], phase=rec["phase"], role=rec.get("role"),
                          meta=rec.get("meta", {}), shapes={k: v["shape"] for k, v in rec["tensors"].items()},
                          dtype=dtypes[main], load=load, context=rec.get("context", {})))
    return cases


def synthetic_cases(preset: str, *, sps: tuple[int, ...] = SYNTHETIC_SP, kv: tuple[int, ...] = SYNTHETIC_KV,
                    phases: tuple[str, ...] = ("denoise", "commit"), cross: bool = True, seed: int = 0) -> list[Case]:
    """Production-shaped attention inputs of a preset (see the module docstring)."""
    from harness.config import load_preset
    from harness.engine.dit_engine import PAGED_STEP_FRAMES

    cfg = load_preset(preset)
    m = cfg.model
    sq, d, bs, text = cfg.tokens_per_chunk, m.head_dim, cfg.block_size, m.text_len
    dtype = cfg.runtime.dtype
    group_blocks = (cfg.tokens_per_frame // bs) * PAGED_STEP_FRAMES
    cases = []
    for sp in sps:
        if m.num_heads % sp:
            raise HarnessError(f"--sp {sp} does not divide {m.num_heads} heads")
        h = m.num_heads // sp
        for pi, phase in enumerate(phases):
            for skv in kv:
                if skv % bs:
                    raise HarnessError(f"K length {skv} is not a whole number of {bs}-token KV blocks")
                meta = {"layout": {"q": "shd", "k": "shd", "v": "shd"}, "block_size": bs, "group_blocks": group_blocks,
                        "sp": sp, "kv_path": "gather"}
                cases.append(_synthetic_case(f"syn-self-sp{sp}-{phase}-k{skv}", "self_attention", phase, meta,
                                             {"q": [sq, h, d], "k": [skv, h, d], "v": [skv, h, d], "block_ids": [skv // bs]},
                                             dtype, seed + 1000 * sp + 100 * pi + skv))
            if cross:  # sequence-local under SP: the rank's tokens, every head (engine/dit.py)
                meta = {"layout": {"q": "shd", "k": "bhsd", "v": "bhsd"}, "sp": sp}
                hh = m.num_heads
                cases.append(_synthetic_case(f"syn-cross-sp{sp}-{phase}", "cross_attention", phase, meta,
                                             {"q": [sq // sp, hh, d], "k": [1, hh, text, d], "v": [1, hh, text, d]},
                                             dtype, seed + 1000 * sp + 100 * pi + 7))
    return cases


def _synthetic_case(op_id: str, op: str, phase: str, meta: dict, shapes: dict, dtype: str, seed: int) -> Case:
    def load(device):
        import torch

        dt = getattr(torch, dtype)
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        out = {k: torch.randn(shp, generator=g, device=device, dtype=torch.float32).to(dt)
               for k, shp in shapes.items() if k != "block_ids"}
        if "block_ids" in shapes:
            out["block_ids"] = torch.arange(shapes["block_ids"][0], device=device, dtype=torch.long)
        return out

    return Case(op_id=op_id, op=op, kind="attention", phase=phase, role=op, meta=meta, shapes=shapes, dtype=dtype,
                load=load, source="synthetic")


# ---- backends --------------------------------------------------------------------------------
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


BACKENDS: dict[str, dict[str, Backend]] = {k: {} for k in KINDS}


def register_backend(kind: str, name: str, make: Callable[[Case, dict, Any], Prepared], *, needs: tuple[str, ...] = (),
                     default: bool | str = True, description: str = "") -> None:
    if kind not in BACKENDS:
        raise ValueError(f"unknown op kind {kind!r} (known: {', '.join(KINDS)})")
    BACKENDS[kind][name] = Backend(name, kind, make, tuple(needs), default, description)


def unregister_backend(kind: str, name: str) -> None:
    BACKENDS[kind].pop(name, None)


def backends_for(kind: str, device, names: list[str] | None = None) -> list[Backend]:
    reg = BACKENDS[kind]
    if names:
        return [reg[n] for n in names if n in reg]
    on_cuda = getattr(device, "type", str(device)) == "cuda"
    return [b for b in reg.values() if b.default is True or (b.default == "cuda" and on_cuda)]


def _half(case: Case) -> bool:
    return case.dtype in ("bfloat16", "float16")


# -- attention --
def _attn_views(case: Case, t: dict) -> dict:
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
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        a = _attn_views(case, t)
        q, k, v = a["q"], a["k"], a["v"]
        ctx = contextlib.nullcontext
        if backend_name is not None:
            be = getattr(SDPBackend, backend_name)
            ctx = lambda: sdpa_kernel(be)  # noqa: E731
        return Prepared(lambda: F.scaled_dot_product_attention(q, k, v), ctx)

    return make


_FLEX: dict[str, Any] = {}


def _flex(case: Case, t: dict, device) -> Prepared:
    import torch

    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError as e:
        raise Unsupported(f"no FlexAttention in torch {torch.__version__}") from e
    a = _attn_views(case, t)
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
    import torch

    if "block_ids" not in t:
        raise Unsupported("no block table in this input (cross-attention, or captured without one)")
    a = _attn_views(case, t)
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
        from harness.engine import attention as A

        if partial is not None:
            if device.type != "cuda":
                raise Unsupported("pins the paged path's CUDA kernel: needs a CUDA device")
            if not _half(case):
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
    from harness.engine import attention as A

    q, kp, vp, ids, gb = _paged_inputs(case, t)
    attend = A.dense("sdpa")
    return Prepared(lambda: A.gather_attention(q, kp, vp, ids, attend=attend, group_blocks=gb).transpose(0, 1).unsqueeze(0))


def _flash_attn(module: str):
    def make(case: Case, t: dict, device) -> Prepared:
        import importlib

        try:
            fa = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001  (a broken install raises more than ImportError)
            raise Unsupported(f"{module} not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
        if device.type != "cuda" or not _half(case):
            raise Unsupported(f"{module} needs CUDA and bf16/fp16 (got {device.type}, {case.dtype})")
        a = _attn_views(case, t)
        q, k, v = (a[n + "_shd"].unsqueeze(0) for n in "qkv")  # (1, S, H, D): its native layout

        def run():
            o = fa.flash_attn_func(q, k, v)
            o = o[0] if isinstance(o, tuple) else o
            return o.transpose(1, 2)

        return Prepared(run)

    return make


# -- linear --
def _linear_operands(case: Case, t: dict, device):
    import torch

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
        import torch
        import torch.nn.functional as F

        if tf32 and (device.type != "cuda" or case.dtype != "float32"):
            raise Unsupported("TF32 applies to float32 GEMMs on a CUDA device")
        x, w, b = _linear_operands(case, t, device)

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
    import torch
    import torch.nn.functional as F

    x, w, b = _linear_operands(case, t, device)
    fn = torch.compile(F.linear, mode="max-autotune-no-cudagraphs" if device.type == "cuda" else None, dynamic=False)
    return Prepared(lambda: fn(x, w, b))


# -- conv --
def _conv_fn(case: Case):
    import torch.nn.functional as F

    return {"conv1d": F.conv1d, "conv2d": F.conv2d, "conv3d": F.conv3d}[case.op]


def _conv_args(case: Case) -> dict:
    m = case.meta
    return {k: (tuple(m[k]) if isinstance(m.get(k), list) else m[k]) for k in ("stride", "padding", "dilation", "groups") if k in m}


def _conv_backend(variant: str):
    def make(case: Case, t: dict, device) -> Prepared:
        import torch

        conv, kw = _conv_fn(case), _conv_args(case)
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

        return Prepared(lambda: conv(x, w, b, **kw), ctx)

    return make


# -- convert --
def _convert_reference(case: Case, t: dict, device) -> Prepared:
    from harness.engine.convert import to_uint8

    x = t["frames"]
    return Prepared(lambda: to_uint8(x))


def _convert_compiled(case: Case, t: dict, device) -> Prepared:
    import torch

    from harness.engine.convert import to_uint8

    x = t["frames"]
    fn = torch.compile(to_uint8, dynamic=False)
    return Prepared(lambda: fn(x))


def _convert_fused(case: Case, t: dict, device) -> Prepared:
    if device.type != "cuda":
        raise Unsupported("the fused Triton conversion (H4a) runs on a CUDA device")
    try:
        from harness.engine.fused_convert import to_uint8 as fused
    except ImportError as e:  # no Triton, or no H4a kernel in this tree
        raise Unsupported(f"fused conversion not importable ({e})") from e
    x = t["frames"]
    return Prepared(lambda: fused(x))


def _register_builtins() -> None:
    reg = register_backend
    reg("attention", "sdpa", _sdpa_backend(None), description="F.scaled_dot_product_attention, PyTorch picks the kernel")
    reg("attention", "sdpa-flash", _sdpa_backend("FLASH_ATTENTION"), description="SDPA pinned to flash (CPU: flash-for-CPU)")
    reg("attention", "sdpa-cudnn", _sdpa_backend("CUDNN_ATTENTION"), needs=("cuda",), description="SDPA pinned to cuDNN")
    reg("attention", "sdpa-efficient", _sdpa_backend("EFFICIENT_ATTENTION"), needs=("cuda",), description="SDPA pinned to mem-efficient")
    reg("attention", "sdpa-math", _sdpa_backend("MATH"), description="SDPA pinned to the math composite")
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


_register_builtins()


# ---- references and checks -----------------------------------------------------------------------
def _spread(n: int, k: int, device):
    import torch

    return torch.linspace(0, n - 1, min(n, k), device=device).round().long().unique()


def reference(case: Case, t: dict, device) -> dict:
    """FP64 reference values at sampled positions, with the index used to pick the same values
    out of a backend's result (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    if case.kind == "attention":
        a = _attn_views(case, t)
        q, k, v = a["q"], a["k"], a["v"]
        hs, qs = _spread(q.shape[1], SAMPLE_HEADS, q.device), _spread(q.shape[2], SAMPLE_QUERIES, q.device)
        qd = q[0].index_select(0, hs).index_select(1, qs).double()
        kd, vd = k[0].index_select(0, hs).double(), v[0].index_select(0, hs).double()
        p = torch.softmax((qd @ kd.transpose(-1, -2)) * q.shape[-1] ** -0.5, dim=-1)
        return {"values": p @ vd, "pick": lambda o: o[0].index_select(0, hs).index_select(1, qs)}
    if case.kind == "linear":
        x, w, b = _linear_operands(case, t, device)
        x2 = x.reshape(-1, x.shape[-1])
        rows = _spread(x2.shape[0], SAMPLE_ROWS, x.device)
        ref = x2.index_select(0, rows).double() @ w.double().t()
        if b is not None:
            ref = ref + b.double()
        return {"values": ref, "pick": lambda o: o.reshape(-1, o.shape[-1]).index_select(0, rows)}
    if case.kind == "conv":
        conv, kw = _conv_fn(case), _conv_args(case)
        x, w, b = t["input"], t["weight"], t.get("bias")
        if int(kw.get("groups", 1)) != 1:
            return {"values": conv(x.double(), w.double(), None if b is None else b.double(), **kw), "pick": lambda o: o}
        oc = _spread(w.shape[0], SAMPLE_CHANNELS, w.device)
        ref = conv(x.double(), w.index_select(0, oc).double(), None if b is None else b.index_select(0, oc).double(), **kw)
        return {"values": ref, "pick": lambda o: o.index_select(1, oc)}
    from harness.engine.convert import to_uint8

    return {"values": to_uint8(t["frames"].detach().to("cpu", torch.float32)), "pick": lambda o: o, "exact": True}


def check(ref: dict, out) -> dict:
    import torch

    got = ref["pick"](out)
    want = ref["values"]
    if tuple(got.shape) != tuple(want.shape):
        return {"passed": False, "reason": f"shape {tuple(got.shape)} != reference {tuple(want.shape)}"}
    if ref.get("exact"):
        got = got.to(want.device)
        bad = int((got != want).sum())
        diff = int((got.int() - want.int()).abs().max()) if got.numel() else 0
        return {"passed": bad == 0, "mismatches": bad, "max_abs": diff, "samples": want.numel(),
                **({} if bad == 0 else {"reason": f"{bad} of {want.numel()} bytes differ from the reference rule (max |Δ| {diff})"})}
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


# ---- running -------------------------------------------------------------------------------------
def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], device, warmup: int, repeats: int) -> list[float]:
    """Milliseconds per call: CUDA events around each call on a GPU, perf_counter on the CPU."""
    import torch

    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cuda":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for s, e in ev:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in ev]
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _is_oom(e: BaseException) -> bool:
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    text = str(e).lower()
    return isinstance(e, (oom, MemoryError)) or "out of memory" in text or "can't allocate memory" in text


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:400]


def classify(e: BaseException) -> tuple[str, str]:
    """(status, reason) of a backend that raised."""
    if isinstance(e, Unsupported):
        return "unsupported", str(e)
    if _is_oom(e):
        return "oom", _first_line(e)
    text = str(e)
    if isinstance(e, (ImportError, NotImplementedError)) or "No viable backend" in text or "No available kernel" in text:
        return "unsupported", _first_line(e)
    return "error", _first_line(e)


def _warning_text(caught: list) -> str:
    # SDPA says *why* a pinned kernel refused in UserWarnings ("Flash attention requires …")
    lines = []
    for w in caught:
        for line in str(w.message).splitlines():
            line = line.strip()
            if line and line not in lines and "called without torch.compile" not in line:
                lines.append(line)
    return " | ".join(lines)[:600]


def run_backend(case: Case, backend: Backend, t: dict, ref: dict, device, *, warmup: int, repeats: int) -> dict:
    import torch

    res: dict[str, Any] = {"backend": backend.name, "status": "ok", "reason": None, "median_ms": None}
    caught: list = []
    try:
        if "cuda" in backend.needs and device.type != "cuda":
            raise Unsupported("needs a CUDA device")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prep = backend.make(case, t, device)
            with prep.context(), torch.inference_mode():
                _sync(device)
                t0 = time.perf_counter()
                out = prep.fn()
                _sync(device)
                res["first_ms"] = (time.perf_counter() - t0) * 1e3
                chk = check(ref, out)
                res["check"] = {k: v for k, v in chk.items() if k != "reason"}
                del out
                if not chk["passed"]:
                    res.update(status="numerics", reason=chk.get("reason", "check failed"))
                    return res
                times = time_calls(prep.fn, device, warmup, repeats)
    except Exception as e:  # noqa: BLE001  (every failure is data, not a crash of the replay)
        status, reason = classify(e)
        extra = _warning_text(caught)
        res.update(status=status, reason=reason + (f" [{extra}]" if extra and status != "ok" else ""))
        res.pop("first_ms", None)
        if status == "oom" and device.type == "cuda":
            torch.cuda.empty_cache()
        return res
    times.sort()
    res.update(median_ms=statistics.median(times), min_ms=times[0], p90_ms=times[min(len(times) - 1, int(0.9 * len(times)))],
               repeats=len(times), times_ms=[round(x, 6) for x in times])
    flops = case.flops()
    if flops and res["median_ms"] > 0:
        res["tflops"] = flops / (res["median_ms"] * 1e-3) / 1e12
    return res


def replay_cases(cases: list[Case], *, device, backends: list[str] | None = None, warmup: int = DEFAULT_WARMUP,
                 repeats: int = DEFAULT_REPEATS, log: Callable[[str], None] | None = print) -> list[dict]:
    """One entry per case: its description, the results of every backend, and the local winner."""
    import torch

    out = []
    for i, case in enumerate(cases):
        entry = case.describe()
        bes = backends_for(case.kind, device, backends)
        try:
            t = case.load(device)
            with torch.inference_mode():
                ref = reference(case, t, device)
        except Exception as e:  # noqa: BLE001
            status, reason = classify(e)
            entry["results"] = [{"backend": b.name, "status": status, "reason": f"input/reference: {reason}", "median_ms": None}
                                for b in bes]
            entry["winner"] = None
            out.append(entry)
            continue
        entry["results"] = [run_backend(case, b, t, ref, device, warmup=warmup, repeats=repeats) for b in bes]
        ok = [r for r in entry["results"] if r["status"] == "ok"]
        best = min(ok, key=lambda r: r["median_ms"]) if ok else None
        entry["winner"] = best["backend"] if best else None
        entry["winner_ms"] = best["median_ms"] if best else None
        for r in ok:
            r["ratio"] = r["median_ms"] / best["median_ms"] if best["median_ms"] > 0 else 1.0
        del t, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if log:
            cells = ", ".join(f"{r['backend']} {r['median_ms']:.3f}" if r["status"] == "ok" else f"{r['backend']} ✗{r['status']}"
                              for r in entry["results"])
            log(f"[{i + 1}/{len(cases)}] {case.label()}: {cells}")
        out.append(entry)
    return out


# ---- H1b whole-model results ------------------------------------------------------------------------
def load_h1b(compare_dir: str | Path | None) -> dict[str, dict]:
    """H1b argument → whole-model result, from every ``compare.json`` under ``compare_dir``
    whose candidate is H1b (the newest file wins when one argument appears twice)."""
    if not compare_dir:
        return {}
    root = Path(compare_dir)
    files = [root] if root.is_file() else sorted(root.rglob("compare.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise HarnessError(f"--compare {compare_dir}: no compare.json found")
    out: dict[str, dict] = {}
    for path in files:
        try:
            data = json.loads(read_bounded(path, MAX_JSON_BYTES, "compare.json"))
        except (OSError, ValueError):
            continue
        for spec in data.get("candidate", []):
            cid, _, arg = str(spec).partition(":")
            if cid.upper() != "H1B":
                continue
            arg = arg or "cudnn"
            gate = data.get("gate", {})
            ref = data.get("reference", "cpu_ready")
            row = next((r for r in data.get("rows", []) if r.get("boundary") == ref and str(r.get("metric", "")).startswith("steady")), None)
            ab = (row or {}).get("ab") or {}
            out[arg] = {"candidate": spec, "file": str(path), "gate": gate.get("status"), "gate_kind": gate.get("kind"),
                        "verdict": data.get("verdict"), "reason": data.get("reason"), "boundary": ref,
                        "ratio": ab.get("value"), "low": ab.get("low"), "high": ab.get("high"),
                        "baseline_ms": (row or {}).get("baseline_ms"), "candidate_ms": (row or {}).get("candidate_ms")}
    return out


def h1b_text(backend: str | None, h1b: dict[str, dict]) -> str:
    if backend is None:
        return "—"
    arg = H1B_ARGS.get(backend)
    if backend == "sdpa":
        return "the baseline (engine default)"
    if arg is None:
        return f"no H1b arm for {backend}"
    r = h1b.get(arg)
    if r is None:
        return f"H1b:{arg} not compared"
    if r["gate"] == "fail":
        return f"H1b:{arg} gate FAIL"
    if r["ratio"] is None:
        return f"H1b:{arg} gate {r['gate']}, {r['verdict']}"
    return f"H1b:{arg} gate {r['gate']}, ×{r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}] {r['verdict']}"


# ---- reports ----------------------------------------------------------------------------------------
def _cell(r: dict) -> str:
    if r["status"] == "ok":
        return f"{r['median_ms']:.3f} ({r['ratio']:.2f}×)"
    return {"unsupported": "n/a", "numerics": "✗ numerics", "oom": "✗ OOM", "error": "✗ error"}.get(r["status"], "✗")


def render_md(doc: dict) -> str:
    h1b = doc.get("h1b", {})
    lines = [f"# replay: {doc['source']}", "",
             f"- device: {doc['device']} · torch {doc['torch']} · warm-up {doc['warmup']}, repeats {doc['repeats']} "
             f"({'CUDA events' if doc['device_type'] == 'cuda' else 'perf_counter'}), median ms; (n×) = time / best of the row",
             f"- check: FP64 reference, sampled; allclose(atol={ATOL}, rtol={RTOL}) and relative L2 ≤ {REL_L2} "
             "(convert: exact). Failures carry no time.", ""]
    if doc.get("compare_dir"):
        lines.append(f"- whole-model H1b results from `{doc['compare_dir']}`: "
                     + (", ".join(f"{k}: gate {v['gate']}, {v['verdict']}" for k, v in sorted(h1b.items())) or "none found"))
        lines.append("")
    for kind in KINDS:
        entries = [e for e in doc["cases"] if e["kind"] == kind]
        if not entries:
            continue
        names = list(dict.fromkeys(r["backend"] for e in entries for r in e["results"]))
        head = ["shape", "op id", *names, "winner"] + (["H1b (whole model)"] if kind == "attention" else [])
        lines += [f"## {kind}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for e in entries:
            by = {r["backend"]: r for r in e["results"]}
            row = [e["label"], f"`{e['op_id']}`", *[_cell(by[n]) if n in by else "" for n in names],
                   e["winner"] or "none"]
            if kind == "attention":
                row.append(h1b_text(e["winner"], h1b))
            lines.append("| " + " | ".join(row) + " |")
        fails = [(e, r) for e in entries for r in e["results"] if r["status"] != "ok"]
        if fails:
            lines += ["", "<details><summary>failures</summary>", ""]
            for e, r in fails:
                lines.append(f"- `{e['op_id']}` {r['backend']}: **{r['status']}** — {r['reason']}")
            lines += ["", "</details>"]
        lines.append("")
    if h1b:
        lines += ["## H1b: local kernel vs whole model", "", "| H1b arm | local wins | gate | whole-model ratio @ boundary | verdict |",
                  "|---|---:|---|---|---|"]
        att = [e for e in doc["cases"] if e["kind"] == "attention"]
        for local, arg in H1B_ARGS.items():
            r = h1b.get(arg)
            if r is None:
                continue
            wins = sum(1 for e in att if e["winner"] == local)
            ratio = "—" if r["ratio"] is None else f"×{r['ratio']:.3f} [{r['low']:.3f}, {r['high']:.3f}] @ {r['boundary']}"
            lines.append(f"| {r['candidate']} | {wins}/{len(att)} | {r['gate']} ({r['gate_kind']}) | {ratio} | {r['verdict']} |")
        lines.append("")
    return "\n".join(lines)


def write_heatmap(doc: dict, kind: str, path: Path) -> Path | None:
    entries = [e for e in doc["cases"] if e["kind"] == kind]
    if not entries:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(dict.fromkeys(r["backend"] for e in entries for r in e["results"]))
    m = np.full((len(entries), len(names)), np.nan)
    text = [["" for _ in names] for _ in entries]
    short = {"unsupported": "n/a", "numerics": "num", "oom": "OOM", "error": "err"}
    for i, e in enumerate(entries):
        for r in e["results"]:
            j = names.index(r["backend"])
            if r["status"] == "ok":
                m[i, j] = math.log2(max(r["ratio"], 1.0))
                text[i][j] = f"{r['ratio']:.2f}"
            else:
                text[i][j] = short.get(r["status"], "✗")
    fig, ax = plt.subplots(figsize=(2.0 + 0.9 * len(names), 1.5 + 0.32 * len(entries)))
    cmap = plt.get_cmap("viridis_r").with_extremes(bad="#d9d9d9")
    vmax = float(np.nanmax(m)) if np.isfinite(m).any() else 1.0
    im = ax.imshow(np.ma.masked_invalid(m), cmap=cmap, aspect="auto", vmin=0.0, vmax=max(vmax, 1.0))
    for i in range(len(entries)):
        for j in range(len(names)):
            ax.text(j, i, text[i][j], ha="center", va="center", fontsize=7,
                    color="black" if not np.isfinite(m[i, j]) or m[i, j] < 0.6 * max(vmax, 1.0) else "white")
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    ax.set_yticks(range(len(entries)), [e["label"] for e in entries], fontsize=7)
    ax.set_title(f"{kind}: time / fastest backend of the shape ({doc['device']})", fontsize=9)
    fig.colorbar(im, ax=ax, label="log2(time / best)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_doc(entries: list[dict], *, source: str, device, warmup: int, repeats: int, compare_dir: str | None = None) -> dict:
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    return {"schema": SCHEMA, "source": source, "device": name, "device_type": device.type, "torch": torch.__version__,
            "warmup": warmup, "repeats": repeats, "tolerances": {"atol": ATOL, "rtol": RTOL, "rel_l2": REL_L2},
            "compare_dir": compare_dir, "h1b": load_h1b(compare_dir), "cases": entries}


def write_outputs(doc: dict, out: str | Path) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "replay.json", "md": out / "replay.md"}
    paths["json"].write_text(json.dumps(doc, indent=1))
    paths["md"].write_text(render_md(doc))
    for kind in KINDS:
        p = write_heatmap(doc, kind, out / f"replay_{kind}.png")
        if p is not None:
            paths[kind] = p
    return paths


#: ATen ops that only make views or allocate: listing them would bury the ones that compute.
_METADATA_OPS = frozenset({"as_strided", "view", "transpose", "select", "slice", "unsqueeze", "squeeze", "flatten",
                           "empty", "empty_strided", "empty_like", "expand", "reshape", "_reshape_alias", "t", "permute",
                           "detach", "alias", "resolve_conj", "resolve_neg", "lift_fresh", "unflatten", "split", "unbind",
                           "narrow", "view_as", "_unsafe_view"})


# ---- --single ------------------------------------------------------------------------------------
def run_single(case: Case, backend: Backend, device, *, warmup: int = 1, profile: bool = True,
               out=None) -> dict:
    """One call of one backend (after ``warmup`` calls) inside an NVTX range and a
    cudaProfilerStart/Stop pair; returns and prints what it launched."""
    import torch

    out = out or sys.stdout
    t = case.load(device)
    res: dict[str, Any] = {"op_id": case.op_id, "backend": backend.name, "label": case.label()}
    if "cuda" in backend.needs and device.type != "cuda":
        raise HarnessError(f"backend {backend.name!r} needs a CUDA device")
    prep = backend.make(case, t, device)
    cuda = device.type == "cuda"
    with prep.context(), torch.inference_mode():
        for _ in range(warmup):
            prep.fn()
        _sync(device)
        if cuda:
            torch.cuda.nvtx.range_push(f"replay:{case.op_id}")
            torch.cuda.profiler.start()
        try:
            if profile:
                from torch.profiler import ProfilerActivity, profile as tprofile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with tprofile(activities=acts) as prof:
                    t0 = time.perf_counter()
                    prep.fn()
                    _sync(device)
                    res["wall_ms"] = (time.perf_counter() - t0) * 1e3
            else:
                t0 = time.perf_counter()
                prep.fn()
                _sync(device)
                res["wall_ms"] = (time.perf_counter() - t0) * 1e3
        finally:
            if cuda:
                torch.cuda.profiler.stop()
                torch.cuda.nvtx.range_pop()
    print(f"{case.op_id} · {case.label()} · backend {backend.name} · {res['wall_ms']:.3f} ms wall", file=out)
    if not profile:
        return res
    events = list(prof.events())
    if cuda:
        from torch.autograd import DeviceType

        kernels: dict[str, list[float]] = {}
        for e in events:
            if e.device_type == DeviceType.CUDA:
                kt = getattr(e, "device_time", None) or getattr(e, "device_time_total", 0.0) or 0.0
                kernels.setdefault(e.name, []).append(float(kt) / 1e3)
        res["kernels"] = [{"name": k, "count": len(v), "ms": sum(v)} for k, v in kernels.items()]
        print("kernels launched:", file=out)
        for k in res["kernels"]:
            print(f"  {k['count']:>3} × {k['ms']:9.4f} ms  {k['name']}", file=out)
    else:
        def depth(e) -> int:
            d, p = 0, e.cpu_parent
            while p is not None:
                d, p = d + 1, p.cpu_parent
            return d

        ops = [(depth(e), e.name) for e in sorted(events, key=lambda e: e.time_range.start)
               if e.name.startswith("aten::") and e.name[6:] not in _METADATA_OPS]
        res["aten_ops"] = [n for _, n in ops]
        print("ATen ops (CPU: no kernels to list; views and empty allocations left out):", file=out)
        for d, n in ops:
            print(f"  {'  ' * d}{n}", file=out)
    return res


# ---- command line -------------------------------------------------------------------------------------
def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="run directory of a serve with --hooks capture")
    p.add_argument("--synthetic", metavar="PRESET", help="production attention shapes of PRESET (e.g. lingbot-480x832) instead of a capture")
    p.add_argument("--sp", default=",".join(map(str, SYNTHETIC_SP)), help="--synthetic: SP degrees (local heads = heads/SP), default 1,2")
    p.add_argument("--kv", default=",".join(map(str, SYNTHETIC_KV)), help="--synthetic: effective K lengths, default 4680,14040,28080")
    p.add_argument("--ops", action="append", default=[], help=f"op kinds to replay (comma list or repeated; {', '.join(KINDS)})")
    p.add_argument("--backends", default="", help="comma list of backends (default: every default backend of each kind)")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help=f"timed calls per backend (default {DEFAULT_REPEATS})")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help=f"untimed calls before timing (default {DEFAULT_WARMUP})")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--limit", type=int, help="replay only the first N inputs")
    p.add_argument("--compare", metavar="DIR", help="directory holding compare.json of `compare --candidate H1b:<backend>`")
    p.add_argument("--out", help="where replay.json/.md/.png go (default: RUN_DIR)")
    p.add_argument("--single", metavar="OP_ID", help="run one input alone (for ncu/nsys) and print the kernels it launched")
    p.add_argument("--backend", help="--single: which backend (default: sdpa / aten / reference)")
    p.add_argument("--no-profiler", action="store_true", help="--single: skip torch.profiler (when running under ncu)")
    p.add_argument("--list-backends", action="store_true", help="print the backends and exit")


def _device(name: str | None):
    import torch

    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise HarnessError("--device cuda: no CUDA device available")
    return torch.device(name)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        v = tuple(int(x) for x in _csv(text))
    except ValueError:
        raise HarnessError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not v or min(v) < 1:
        raise HarnessError(f"{flag}: expected positive integers, got {text!r}")
    return v


SINGLE_DEFAULT = {"attention": "sdpa", "linear": "aten", "conv": "aten", "convert": "reference"}


def main(args: argparse.Namespace) -> int:
    if args.list_backends:
        for kind in KINDS:
            print(f"{kind}:")
            for b in BACKENDS[kind].values():
                dflt = {True: "default", False: "on request", "cuda": "default on CUDA"}[b.default]
                print(f"  {b.name:<16} {dflt:<16} {'needs ' + ','.join(b.needs) if b.needs else '':<11} {b.description}")
        return 0
    ops = tuple(o for spec in (args.ops or [",".join(KINDS)]) for o in _csv(spec))
    bad = [o for o in ops if o not in KINDS]
    if bad:
        raise HarnessError(f"--ops: unknown op kind {bad[0]!r} (known: {', '.join(KINDS)})")
    names = _csv(args.backends)
    known = {n for reg in BACKENDS.values() for n in reg}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise HarnessError(f"--backends: unknown backend {unknown[0]!r} (known: {', '.join(sorted(known))})")
    if args.repeats < 1 or args.warmup < 0:
        raise HarnessError("--repeats must be ≥ 1 and --warmup ≥ 0")
    if args.synthetic:
        cases = synthetic_cases(args.synthetic, sps=_ints(args.sp, "--sp"), kv=_ints(args.kv, "--kv"))
        cases = [c for c in cases if c.kind in ops]
        source = f"synthetic {args.synthetic}"
        default_out = Path("runs") / f"replay-{args.synthetic}-{time.strftime('%Y%m%d-%H%M%S')}"
    elif args.run_dir:
        cases = load_cases(args.run_dir, ops)
        source = str(args.run_dir)
        default_out = Path(args.run_dir)
    else:
        raise HarnessError("replay needs RUN_DIR or --synthetic PRESET")
    if args.limit:
        cases = cases[: args.limit]
    device = _device(args.device)

    if args.single:
        case = next((c for c in cases if c.op_id == args.single), None)
        if case is None:
            raise HarnessError(f"--single: no input {args.single!r} (have: {', '.join(c.op_id for c in cases[:8])}"
                               f"{', …' if len(cases) > 8 else ''})")
        bname = args.backend or SINGLE_DEFAULT[case.kind]
        backend = BACKENDS[case.kind].get(bname)
        if backend is None:
            raise HarnessError(f"--backend {bname!r} is not a {case.kind} backend (known: {', '.join(BACKENDS[case.kind])})")
        try:
            run_single(case, backend, device, warmup=max(1, args.warmup if args.warmup is not None else 1),
                       profile=not args.no_profiler)
        except HarnessError:
            raise
        except Exception as e:  # noqa: BLE001
            status, reason = classify(e)
            print(f"{case.op_id} on {bname}: {status} — {reason}", file=sys.stderr)
            return 1
        return 0

    if not cases:
        raise HarnessError(f"nothing to replay in {source} for --ops {','.join(ops)}")
    entries = replay_cases(cases, device=device, backends=names or None, warmup=args.warmup, repeats=args.repeats)
    doc = build_doc(entries, source=source, device=device, warmup=args.warmup, repeats=args.repeats, compare_dir=args.compare)
    paths = write_outputs(doc, args.out or default_out)
    for kind in KINDS:
        es = [e for e in entries if e["kind"] == kind]
        if es:
            wins: dict[str, int] = {}
            for e in es:
                wins[e["winner"] or "none"] = wins.get(e["winner"] or "none", 0) + 1
            print(f"{kind}: {len(es)} inputs; local winners: " + ", ".join(f"{k} {v}" for k, v in sorted(wins.items(), key=lambda kv: -kv[1])))
    print(f"replay: {paths['md']}")
    return 0


# FlashAttention-3 rows and FP8 emulations live in their own module (it imports from this one).
import harness.experiments.replay_fa3  # noqa: E402,F401
