"""``--hooks capture[=BUDGET]``: save real inputs of the expensive ops for ``harness replay``.

What is saved, one representative per distinct *signature* (op, shapes, dtypes, layouts, phase
kind — denoise / commit / decode / convert — and role), in order of first appearance,
while the byte budget lasts:

* ``self_attention`` — the chunk's q and the **effective** K/V the kernel attends to (the
  visible blocks gathered through the block table, whichever KV path ran), token-major (S, H, D),
  plus the block table, the block size and the paged path's group size, so replay can also run
  the direct paged path;
* ``cross_attention`` — q (token-major) and the session's text K/V as the kernel sees them;
* ``linear`` — the activation input; the weight only when it is small (``WEIGHT_LIMIT``), else
  its shape and dtype (replay draws a random one);
* ``conv1d/2d/3d`` — input, kernel and bias, with stride/padding/dilation/groups;
* ``convert_uint8`` — the float frames handed to the uint8 conversion.

Only per-chunk work is captured (a phase with a ``chunk`` or a ``stage``: the DiT forwards, the
decode, the conversion); session set-up — text K/V, the conditioning image's VAE *encode* — is left out, so
its large convolutions do not use up the budget first.

Budget: a signature whose file would not fit in what is left is recorded as skipped (once) and
later, smaller signatures may still be saved — a greedy fill in first-seen order. Only the
tensor files count towards the budget, not the index.

How the ops are reached without touching the engine: attention through wrappers put around every
entry of the tables the engine lends to ``hooks.registries`` (``attention.DENSE`` and
``attention.KV_PATHS``) while the hook is on (the engine looks the names up at every forward, so
the wrappers are picked up and the originals come back on exit); linears, convolutions and the conversion input through a ``TorchFunctionMode``; the phase
(session, chunk, step, layer, role) through ``context``. The conversion's input is the first
(3, T, H, W) float tensor any torch function sees inside a ``stage="convert"`` scope.

Several processes (SP ranks, VAE ranks) share one ``RUN_DIR/capture/``: every decision is taken
under an exclusive ``flock`` on ``capture/.lock`` after reading the index lines other processes
appended, so signatures are deduplicated and the budget holds across the whole run.

Files: ``capture/<op_id>.safetensors`` (tensors; metadata ``op_id``, ``op``, ``meta`` as JSON)
and ``capture/index.jsonl``, one line per saved or skipped signature.

Capturing copies tensors to the host and hashes them: it perturbs timing and, when combined
with ``dispatch``, adds its own gather/copy ops to the dispatch records. Use it in a separate
run. Under ``torch.compile`` only calls that run eagerly are seen (the attention cores always
are; linears/convs inside compiled blocks are not).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from safetensors import safe_open
from safetensors.torch import load_file, save

from harness.hooks import context, registries
from harness.limits import MAX_JSON_BYTES, read_bounded

#: Linear weights up to this size are saved with the input (the tiny preset's all are; the full
#: model's 5120×5120 bf16 ones, 50 MB each, are not).
WEIGHT_LIMIT = 1 << 20
#: Steps that are the cache-writing pass (DESIGN §2: 0..3 denoise, 4 commit).
COMMIT_STEPS: tuple[Any, ...] = (4, "commit")
KINDS = {"self_attention": "attention", "cross_attention": "attention", "linear": "linear",
         "conv1d": "conv", "conv2d": "conv", "conv3d": "conv", "convert_uint8": "convert"}

_FUNCS: dict[Any, str] = {F.linear: "linear", torch.conv1d: "conv1d", torch.conv2d: "conv2d",
                          torch.conv3d: "conv3d"}
_active: "CaptureRecorder | None" = None


def phase_kind(ph: context.Phase) -> str:
    if ph.step is not None:
        return "commit" if ph.step in COMMIT_STEPS else "denoise"
    return ph.stage or "other"


def _dtype(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _host(t: Tensor) -> Tensor:
    # a fresh, exactly sized, contiguous host copy: a view would drag its whole storage along
    # (q is a slice of the fused QKV output) and the engine reuses its buffers afterwards
    out = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")
    out.copy_(t.detach())
    return out


def sha256(t: Tensor) -> str:
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _nbytes(*ts: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _bhsd_layout(x: Tensor) -> str:
    """How a (1, H, S, D) kernel argument lies in memory: a transposed view of token-major
    (S, H, D) storage ("shd", what the engine hands the kernels) or plain BHSD."""
    if x.dim() == 4 and x.shape[0] == 1 and x.stride(-1) == 1 and x.shape[1] > 1 and x.stride(1) == x.shape[-1] \
            and x.stride(2) == x.shape[1] * x.shape[-1]:
        return "shd"
    return "bhsd"


def _as_saved(x: Tensor, layout: str) -> Tensor:
    return x[0].transpose(0, 1) if layout == "shd" else x


def _ints(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [int(i) for i in v]
    return v if isinstance(v, str) else int(v)


class CaptureRecorder(TorchFunctionMode):
    """Enter on the thread that runs the model; leave to restore the registries. At most one per
    process."""

    def __init__(self, out_dir: str | Path, *, budget: int, process: str = "", weight_limit: int = WEIGHT_LIMIT):
        super().__init__()
        self.dir = Path(out_dir)
        self.budget = int(budget)
        self.process = process
        self.weight_limit = weight_limit
        self.seen: set[str] = set()
        self.used_total = 0  # bytes of saved files, all processes (as of the last index read)
        self.saved: list[str] = []  # op ids this process saved
        self.skipped: list[str] = []
        self.bytes = 0
        self.errors: list[str] = []
        self._offset = 0
        self._lock_fd: int | None = None
        self._restore: list[tuple[dict, str, Callable]] = []
        self._convert_armed = False
        self._last_chunk: dict[str, Any] = {}
        self._busy = False
        self._entered = False

    # ---- switching on and off ------------------------------------------------------------------
    def __enter__(self):
        global _active
        if _active is not None:
            raise RuntimeError("a capture recorder is already active in this process")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        for kind, wrap in (("dense", self._wrap_dense), ("kv_path", self._wrap_kv)):
            registry = registries.ATTENTION.get(kind, {})
            for name, fn in list(registry.items()):
                w = wrap(name, fn)
                registry[name] = w
                self._restore.append((registry, name, fn))
        _active = self
        context.add_listener(self)
        self._entered = True
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb):
        global _active
        if not self._entered:
            return None
        self._entered = False
        try:
            return super().__exit__(exc_type, exc, tb)
        finally:
            context.remove_listener(self)
            for registry, name, fn in self._restore:
                if getattr(registry.get(name), "_capture_of", None) is fn:
                    registry[name] = fn
            self._restore = []
            _active = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def status(self) -> dict[str, Any]:
        return {"dir": self.dir.name, "budget": self.budget, "saved": len(self.saved), "skipped": len(self.skipped),
                "bytes": self.bytes, "run_bytes": self.used_total, "errors": self.errors[:5]}

    # ---- phase listener: arms the conversion capture ------------------------------------------------
    def enter(self, fields: dict[str, Any], phase: context.Phase, parent: context.Phase) -> None:
        if fields.get("stage") == "convert":
            self._convert_armed = True

    def exit(self, fields: dict[str, Any], phase: context.Phase, parent: context.Phase) -> None:
        if "stage" in fields:
            self._convert_armed = False
        if "chunk" in fields and phase.chunk is not None:
            self._last_chunk = {k: v for k, v in (("session", phase.session), ("epoch", phase.epoch), ("chunk", phase.chunk))
                                if v is not None}

    # ---- interception ----------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._busy and not torch.compiler.is_compiling():
            op = _FUNCS.get(func)
            if op is not None:
                self._guarded(self._on_call, op, args, kwargs)
            elif self._convert_armed:
                self._guarded(self._on_convert, args)
        return func(*args, **kwargs)

    def _guarded(self, fn: Callable, *a: Any) -> None:
        # a capture problem must never take the serve down with it; it is reported instead
        self._busy = True
        try:
            fn(*a)
        except Exception as e:  # noqa: BLE001
            if len(self.errors) < 20:
                self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            self._busy = False

    def _wrap_dense(self, name: str, fn: Callable) -> Callable:
        def capture_dense(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> Tensor:
            # self-attention reaches the dense kernel through a KV path, which captured it already
            if not self._busy and context.current().role == "cross_attention":
                self._guarded(self._on_cross, name, q, k, v)
            return fn(q, k, v, **kw)  # out= of a kernel that writes into a buffer (H1d)

        capture_dense._capture_of = fn  # type: ignore[attr-defined]
        capture_dense._capture_name = name  # type: ignore[attr-defined]
        return capture_dense

    def _wrap_kv(self, name: str, fn: Callable) -> Callable:
        def capture_kv(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_ids: Tensor, **kw: Any) -> Tensor:
            if not self._busy:
                self._guarded(self._on_self, name, q, k_pool, v_pool, block_ids, kw.get("attend"), kw.get("group_blocks", 0))
            return fn(q, k_pool, v_pool, block_ids, **kw)

        capture_kv._capture_of = fn  # type: ignore[attr-defined]
        return capture_kv

    # ---- the ops -------------------------------------------------------------------------------------
    def _on_self(self, path: str, q: Tensor, k_pool: Tensor, v_pool: Tensor, block_ids: Tensor | slice, attend,
                 group_blocks: int) -> None:
        if isinstance(block_ids, slice):  # the window layout's contiguous blocks, saved as the table they equal
            block_ids = torch.arange(block_ids.start, block_ids.stop, device=k_pool.device)
        n, bs, h, d = int(block_ids.shape[0]), int(k_pool.shape[1]), int(k_pool.shape[2]), int(k_pool.shape[3])
        skv = n * bs
        sig = ["self_attention", list(q.shape), [skv, h, d], [skv, int(v_pool.shape[2]), int(v_pool.shape[3])],
               _dtype(q), _dtype(k_pool), ["shd", "shd", "shd"], bs]

        def build() -> tuple[dict[str, Tensor], dict[str, Any]]:
            k = k_pool.index_select(0, block_ids).flatten(0, 1)
            v = v_pool.index_select(0, block_ids).flatten(0, 1)
            tensors = {"q": _host(q), "k": _host(k), "v": _host(v), "block_ids": _host(block_ids)}
            meta = {"layout": {"q": "shd", "k": "shd", "v": "shd"}, "block_size": bs, "group_blocks": int(group_blocks),
                    "kv_path": path, "attention": getattr(attend, "_capture_name", None), "pool_blocks": int(k_pool.shape[0])}
            return tensors, meta

        est = _nbytes(q) + 2 * skv * h * d * k_pool.element_size() + _nbytes(block_ids)
        self._consider("self_attention", sig, est, build)

    def _on_cross(self, name: str, q: Tensor, k: Tensor, v: Tensor) -> None:
        lay = [_bhsd_layout(q), _bhsd_layout(k), _bhsd_layout(v)]
        shapes = [list(_as_saved(x, l).shape) for x, l in zip((q, k, v), lay)]
        sig = ["cross_attention", *shapes, _dtype(q), _dtype(k), lay]

        def build():
            tensors = {key: _host(_as_saved(x, l)) for key, x, l in zip("qkv", (q, k, v), lay)}
            return tensors, {"layout": dict(zip("qkv", lay)), "attention": name}

        self._consider("cross_attention", sig, _nbytes(q, k, v), build)

    def _on_call(self, op: str, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("input")
        w = args[1] if len(args) > 1 else kwargs.get("weight")
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        if not isinstance(x, Tensor) or not isinstance(w, Tensor) or x.device.type == "meta":
            return
        if op == "linear":
            keep_w = _nbytes(w, b) <= self.weight_limit
            sig = ["linear", list(x.shape), _dtype(x), list(w.shape), _dtype(w), None if b is None else list(b.shape)]

            def build():
                tensors = {"input": _host(x)}
                if keep_w:
                    tensors["weight"] = _host(w)
                    if b is not None:
                        tensors["bias"] = _host(b)
                meta = {"weight_shape": list(w.shape), "weight_dtype": _dtype(w), "weight_saved": keep_w,
                        "bias_shape": None if b is None else list(b.shape)}
                return tensors, meta

            self._consider("linear", sig, _nbytes(x) + (_nbytes(w, b) if keep_w else 0), build)
            return
        names = ("stride", "padding", "dilation", "groups")
        defaults = (1, 0, 1, 1)
        params = {k: _ints(args[3 + i] if len(args) > 3 + i else kwargs.get(k, defaults[i])) for i, k in enumerate(names)}
        sig = [op, list(x.shape), _dtype(x), list(w.shape), _dtype(w), b is not None, params]

        def build():
            tensors = {"input": _host(x), "weight": _host(w)}
            if b is not None:
                tensors["bias"] = _host(b)
            return tensors, dict(params)

        self._consider(op, sig, _nbytes(x, w, b), build)

    def _on_convert(self, args: tuple) -> None:
        for a in args:
            if isinstance(a, Tensor) and a.dim() == 4 and a.shape[0] == 3 and a.is_floating_point():
                self._convert_armed = False
                sig = ["convert_uint8", list(a.shape), _dtype(a)]
                self._consider("convert_uint8", sig, _nbytes(a), lambda: ({"frames": _host(a)}, {}))
                return

    # ---- deciding and writing ---------------------------------------------------------------------------
    def _consider(self, op: str, sig: list, estimate: int, build: Callable[[], tuple[dict, dict]]) -> None:
        ph = context.current()
        if ph.chunk is None and ph.stage is None:
            return  # session set-up (text K/V, the conditioning image's VAE encode): not per-chunk work
        kind = phase_kind(ph)
        ctx = ph.fields()
        if ph.chunk is None and self._last_chunk:
            # the VAE worker opens its convert scope after leaving the chunk's decode scope
            ctx = {**self._last_chunk, **ctx, "context_from": "previous chunk scope"}
        key = json.dumps([*sig, kind, ph.role], separators=(",", ":"))
        if key in self.seen:
            return
        with self._locked():
            self._read_index()
            if key in self.seen:
                return
            op_id = f"{op}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
            base = {"op_id": op_id, "op": op, "kind": KINDS[op], "phase": kind, "role": ph.role, "signature": key,
                    "process": self.process, "context": ctx, "time_ns": time.time_ns()}
            left = self.budget - self.used_total
            if estimate > left:
                self._append({**base, "status": "skipped", "reason": "budget", "estimate_bytes": estimate,
                              "left_bytes": left, "budget": self.budget})
                self.skipped.append(op_id)
                return
            tensors, meta = build()
            blob = save(tensors, metadata={"op_id": op_id, "op": op, "meta": json.dumps(meta)})
            if len(blob) > left:
                self._append({**base, "status": "skipped", "reason": "budget", "estimate_bytes": len(blob),
                              "left_bytes": left, "budget": self.budget})
                self.skipped.append(op_id)
                return
            name = f"{op_id}.safetensors"
            tmp = self.dir / f".{name}.tmp"
            tmp.write_bytes(blob)
            tmp.replace(self.dir / name)
            desc = {k: {"shape": list(t.shape), "dtype": _dtype(t), "bytes": _nbytes(t), "sha256": sha256(t)}
                    for k, t in tensors.items()}
            self._append({**base, "status": "saved", "file": name, "bytes": len(blob), "tensors": desc, "meta": meta})
            self.saved.append(op_id)
            self.bytes += len(blob)

    def _locked(self):
        fd = self._lock_fd

        class _Lock:
            def __enter__(self_):
                fcntl.flock(fd, fcntl.LOCK_EX)

            def __exit__(self_, *exc):
                fcntl.flock(fd, fcntl.LOCK_UN)

        return _Lock()

    def _read_index(self) -> None:
        """Catch up with the index lines appended since the last read (other processes' too)."""
        path = self.dir / "index.jsonl"
        if not path.exists():
            return
        with open(path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a torn last line (a writer that died mid-line) is left unread
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            self.seen.add(rec.get("signature", ""))
            if rec.get("status") == "saved":
                self.used_total += int(rec.get("bytes", 0))
        self._offset += end

    def _append(self, rec: dict) -> None:
        with open(self.dir / "index.jsonl", "ab") as f:
            f.write(json.dumps(rec, separators=(",", ":")).encode() + b"\n")
        self._read_index()


def read_index(run_dir: str | Path) -> list[dict]:
    """The index records of ``RUN_DIR/capture`` (or of a capture directory itself)."""
    d = Path(run_dir)
    path = d / "index.jsonl" if (d / "index.jsonl").exists() else d / "capture" / "index.jsonl"
    if not path.exists():
        return []
    return [json.loads(l) for l in read_bounded(path, MAX_JSON_BYTES, "capture index").splitlines() if l.strip()]


def load_capture(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Tensors and metadata of one capture file."""
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        md = f.metadata() or {}
    return tensors, json.loads(md.get("meta", "{}"))
