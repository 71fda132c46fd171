"""A TorchDispatchMode that records every ATen call with its shapes and nominal FLOPs.

    rec = DispatchRecorder("dispatch.jsonl")        # or DispatchRecorder() for summary only
    with rec:
        engine.run_chunk(...)
    rec.summary()                                   # totals per category, op and phase
    rec.close()

Works on CPU, CUDA and the **meta** device: the op runs as it would anyway (on meta that is shape
inference only), then the record is built from shapes, so the full-size model's FLOPs can be
counted on a laptop (``bench-engine --flops-only``).

What reaches ``__torch_dispatch__`` for ``F.scaled_dot_product_attention`` (torch 2.13):
on CPU (and CUDA) one fused op, e.g. ``_scaled_dot_product_flash_attention_for_cpu``, counted by
its formula. On the meta device SDPA picks the math backend, which is a composite: the mode sees
``bmm → _safe_softmax → bmm`` (plus ``_to_copy`` casts for bf16) and never the SDPA op. To count
attention once and as attention on both, a small TorchFunctionMode marks the dynamic extent of
every SDPA call; a matmul inside it is categorised as attention (``flops.categorize``). Its two
bmm are 2·Sq·Skv·D + 2·Sq·Skv·Dv per batch·head, exactly the fused formula, so totals agree
across devices. A paged attention written as bmm blocks is handled the same way through the
``role`` of ``context.phase``.

One recorder per thread: dispatch modes live on the entering thread's mode stack. Use it in eager
mode; under ``torch.compile`` the mode would see the compiled graph's ops, not the model's.
"""

from __future__ import annotations

import io
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import msgspec
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from harness.hooks import context
from harness.hooks.flops import CATEGORIES, OPS, PEAKS, categorize, mfu  # noqa: F401  (re-exported)

#: Phase fields the running aggregate keeps. ``layer`` is left out by default: per-layer keys
#: multiply the aggregate by the layer count for little gain in a long run; pass it to see layers.
DEFAULT_GROUP_BY: tuple[str, ...] = ("session", "epoch", "chunk", "stage", "step", "role")

_SDPA = F.scaled_dot_product_attention


class _SdpaExtent(TorchFunctionMode):
    """Marks when the dispatch mode is inside an ``F.scaled_dot_product_attention`` call."""

    def __init__(self, recorder: "DispatchRecorder"):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _SDPA:
            return func(*args, **kwargs)
        self.recorder._sdpa_depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.recorder._sdpa_depth -= 1


def _tensors(args: Iterable[Any]) -> list[torch.Tensor]:
    """Tensor arguments in order, one level into lists (cat, index, foreach ops)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _stride(t: torch.Tensor) -> list[int] | None:
    try:
        return list(t.stride())
    except (RuntimeError, NotImplementedError):  # sparse / nested layouts have none
        return None


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


class DispatchRecorder(TorchDispatchMode):
    """Records ATen calls; ``path=None`` keeps the aggregates only (no per-call work beyond the
    FLOP formula), for long runs.

    Each line of the JSONL file: ``seq, op, shapes, dtypes, strides, out`` (output shapes),
    ``flops, cat``, the phase fields that are set, and ``sdpa: true`` inside an SDPA call.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        group_by: Iterable[str] = DEFAULT_GROUP_BY,
        flush_bytes: int = 1 << 20,
        process: str = "",
    ):
        super().__init__()
        self.group_by = tuple(group_by)
        bad = set(self.group_by) - set(context.FIELDS)
        if bad:
            raise ValueError(f"unknown phase fields {sorted(bad)} (known: {', '.join(context.FIELDS)})")
        self.path = Path(path) if path is not None else None
        self.process = process
        self._file: io.BufferedWriter | None = None
        self._buf = bytearray()
        self._flush_bytes = flush_bytes
        self._encoder = msgspec.json.Encoder()
        self._ops: dict[Any, tuple[str, str, Any]] = {}  # func → (display name, kind, formula)
        self._agg: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])  # (phase key…, cat) → [flops, calls]
        self._by_op: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self._sdpa_depth = 0
        self.formula_errors: dict[str, str] = {}  # op → first error; its calls count 0 FLOPs
        self._fmode: _SdpaExtent | None = None
        self._entered = False
        self.calls = 0
        #: time spent recording (FLOP formulas, aggregation, JSON), outside the ops themselves
        self.record_ns = 0
        self.closed = False

    # ---- mode plumbing ---------------------------------------------------------------------
    def __enter__(self):
        if self.closed:
            raise RuntimeError("DispatchRecorder is closed")
        if self.path is not None and self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab")
        context.acquire()
        self._fmode = _SdpaExtent(self)
        self._fmode.__enter__()
        self._entered = True
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb):
        try:
            return super().__exit__(exc_type, exc, tb)
        finally:
            if self._fmode is not None:
                self._fmode.__exit__(exc_type, exc, tb)
                self._fmode = None
            context.release()
            self._entered = False
            self.flush()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        t = time.perf_counter_ns()
        self._record(func, args, kwargs, out)
        self.record_ns += time.perf_counter_ns() - t
        return out

    # ---- recording ---------------------------------------------------------------------------
    def _op(self, func) -> tuple[str, str, Any]:
        entry = self._ops.get(func)
        if entry is None:
            schema_name = func._schema.name if hasattr(func, "_schema") else str(func)
            kind, formula = OPS.get(schema_name, (None, None))
            entry = (str(func), kind, formula)
            self._ops[func] = entry
        return entry

    def _record(self, func, args, kwargs, out) -> None:
        name, kind, formula = self._op(func)
        flops = 0
        if formula is not None:
            try:
                flops = formula(args, kwargs)
            except (ValueError, IndexError, TypeError) as e:  # an unforeseen signature must not kill the run
                self.formula_errors.setdefault(name, f"{type(e).__name__}: {e}")
        ph = context.current()
        in_sdpa = self._sdpa_depth > 0
        cat = categorize(kind, role=ph.role, stage=ph.stage, in_sdpa=in_sdpa)
        key = tuple(getattr(ph, f) for f in self.group_by) + (cat,)
        a = self._agg[key]
        a[0] += flops
        a[1] += 1
        o = self._by_op[name]
        o[0] += flops
        o[1] += 1
        self.calls += 1
        if self._file is None:
            return
        ins = _tensors(args) + _tensors(kwargs.values())
        rec: dict[str, Any] = {
            "seq": self.calls - 1,
            "op": name,
            "shapes": [list(t.shape) for t in ins],
            "dtypes": [_dtype(t) for t in ins],
            "strides": [_stride(t) for t in ins],
            "out": [list(t.shape) for t in _tensors(out if isinstance(out, (list, tuple)) else (out,))],
            "flops": flops,
            "cat": cat,
        }
        rec.update(ph.fields())
        if in_sdpa:
            rec["sdpa"] = True
        self._buf += self._encoder.encode(rec)
        self._buf += b"\n"
        if len(self._buf) >= self._flush_bytes:
            self.flush()

    def flush(self) -> None:
        if self._file is not None and self._buf:
            self._file.write(self._buf)
            self._file.flush()
            self._buf.clear()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
        self.closed = True

    # ---- results -------------------------------------------------------------------------------
    @property
    def total_flops(self) -> int:
        return sum(v[0] for v in self._agg.values())

    def flops_by_category(self) -> dict[str, int]:
        out = {c: 0 for c in CATEGORIES}
        for key, (flops, _) in self._agg.items():
            out[key[-1]] += flops
        return out

    def flops_by(self, *fields: str) -> dict[tuple, dict[str, int]]:
        """FLOPs per category for each value of the given phase fields (a subset of group_by),
        e.g. ``flops_by("chunk")[(3,)]["self_attention"]``."""
        missing = [f for f in fields if f not in self.group_by]
        if missing:
            raise ValueError(f"fields {missing} were not kept (group_by={self.group_by})")
        idx = [self.group_by.index(f) for f in fields]
        out: dict[tuple, dict[str, int]] = {}
        for key, (flops, _) in self._agg.items():
            k = tuple(key[i] for i in idx)
            d = out.setdefault(k, {})
            d[key[-1]] = d.get(key[-1], 0) + flops
        return out

    def summary(self, group_by: Iterable[str] | None = None) -> dict[str, Any]:
        """JSON-ready totals: by category, by op (ops with FLOPs, and call counts of all) and
        rows per phase key × category (``group_by`` re-aggregates to fewer fields)."""
        fields = tuple(group_by) if group_by is not None else self.group_by
        rows: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
        idx = [self.group_by.index(f) for f in fields]
        for key, (flops, calls) in self._agg.items():
            r = rows[tuple(key[i] for i in idx) + (key[-1],)]
            r[0] += flops
            r[1] += calls
        phase_rows = []
        for key in sorted(rows, key=lambda k: tuple((v is None, str(type(v)), v if v is not None else 0) for v in k)):
            flops, calls = rows[key]
            row = {f: v for f, v in zip(fields, key[:-1]) if v is not None}
            row.update(category=key[-1], flops=flops, calls=calls)
            phase_rows.append(row)
        return {
            "process": self.process,
            "calls": self.calls,
            "total_flops": self.total_flops,
            "by_category": self.flops_by_category(),
            "by_op": {k: {"flops": v[0], "calls": v[1]} for k, v in sorted(self._by_op.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))},
            "group_by": list(fields),
            "formula_errors": dict(self.formula_errors),
            "phases": phase_rows,
        }


def count_flops(fn, *args, **kwargs) -> tuple[Any, DispatchRecorder]:
    """Run ``fn`` once under a summary-only recorder; return (its result, the recorder)."""
    rec = DispatchRecorder()
    with rec:
        result = fn(*args, **kwargs)
    rec.close()
    return result, rec


def merge_process_files(paths: Iterable[tuple[str, str | Path]], dest: str | Path) -> int:
    """Concatenate per-process ``dispatch.<proc>.jsonl`` files into one ``dispatch.jsonl``,
    tagging each line with ``proc``; returns the number of lines written."""
    decoder, encoder = msgspec.json.Decoder(), msgspec.json.Encoder()
    n = 0
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "wb") as out:
        for proc, path in paths:
            with open(path, "rb") as f:
                for line in f:
                    if not line.strip():
                        continue
                    rec = decoder.decode(line)
                    rec["proc"] = proc
                    out.write(encoder.encode(rec) + b"\n")
                    n += 1
    tmp.replace(dest)
    return n
