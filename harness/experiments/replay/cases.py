"""The inputs a replay runs: entries of a capture (``--hooks capture``), or production-shaped
attention inputs of a preset (``--synthetic PRESET``).

``--synthetic`` builds the inputs directly (random q/k/v in the preset's dtype, token-major as
the engine holds them, with a block table) instead of reading a capture: self-attention for
SP ∈ ``--sp`` (local heads = heads/SP, all tokens of the chunk) × denoise/commit × effective K
lengths ``--kv``, and cross-attention over the text. Denoise and commit passes have the same
shapes (only the values differ in a real run), so their rows measure the same kernels twice — a
check on timing noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from harness.config import load_preset
from harness.engine.dit_engine import PAGED_STEP_FRAMES
from harness.errors import HarnessError
from harness.experiments.replay.settings import KINDS, SYNTHETIC_KV, SYNTHETIC_SP
from harness.hooks.capture import load_capture, read_index


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

    def _attention_dims(self) -> tuple[int, int, int, int]:
        """(query tokens, key tokens, heads, head dim); K is (1, H, S, D) or token-major."""
        sq, h, d = self.shapes["q"]
        k = self.shapes["k"]
        skv = k[2] if self.meta.get("layout", {}).get("k") == "bhsd" else k[0]
        return sq, skv, h, d

    def label(self) -> str:
        s = self.shapes
        if self.kind == "attention":
            sq, skv, h, d = self._attention_dims()
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
            sq, skv, h, d = self._attention_dims()
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


def _capture_loader(path: Path, size: int | None) -> Callable[[Any], dict]:
    def load(device) -> dict:
        if size is not None and path.stat().st_size != size:  # read only what the index says was written
            raise HarnessError(f"{path} is {path.stat().st_size} bytes, the capture index says {size}")
        tensors, _ = load_capture(path)
        return {k: t.to(device) for k, t in tensors.items()}

    return load


def load_cases(run_dir: str | Path, ops: tuple[str, ...] = KINDS) -> list[Case]:
    """The saved entries of ``RUN_DIR/capture/index.jsonl`` (in capture order), of the given kinds."""
    d = Path(run_dir)
    cap = d if (d / "index.jsonl").exists() else d / "capture"
    if not (cap / "index.jsonl").exists():
        raise HarnessError(f"{run_dir} holds no capture/index.jsonl (serve with --hooks capture first)")
    cases = []
    for rec in read_index(cap):
        if rec.get("status") != "saved" or rec.get("kind") not in ops:
            continue
        dtypes = {k: v["dtype"] for k, v in rec["tensors"].items()}
        main = "q" if "q" in dtypes else ("frames" if "frames" in dtypes else "input")
        cases.append(Case(op_id=rec["op_id"], op=rec["op"], kind=rec["kind"], phase=rec["phase"], role=rec.get("role"),
                          meta=rec.get("meta", {}), shapes={k: v["shape"] for k, v in rec["tensors"].items()},
                          dtype=dtypes[main], load=_capture_loader(cap / rec["file"], rec.get("bytes")),
                          context=rec.get("context", {})))
    return cases


def synthetic_cases(preset: str, *, sps: tuple[int, ...] = SYNTHETIC_SP, kv: tuple[int, ...] = SYNTHETIC_KV,
                    phases: tuple[str, ...] = ("denoise", "commit"), cross: bool = True, seed: int = 0) -> list[Case]:
    """Production-shaped attention inputs of a preset (see the module docstring)."""
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
                cases.append(synthetic_case(f"syn-self-sp{sp}-{phase}-k{skv}", "self_attention", phase, meta,
                                            {"q": [sq, h, d], "k": [skv, h, d], "v": [skv, h, d], "block_ids": [skv // bs]},
                                            dtype, seed + 1000 * sp + 100 * pi + skv))
            if cross:  # sequence-local under SP: the rank's tokens, every head (engine/dit.py)
                meta = {"layout": {"q": "shd", "k": "bhsd", "v": "bhsd"}, "sp": sp}
                hh = m.num_heads
                cases.append(synthetic_case(f"syn-cross-sp{sp}-{phase}", "cross_attention", phase, meta,
                                            {"q": [sq // sp, hh, d], "k": [1, hh, text, d], "v": [1, hh, text, d]},
                                            dtype, seed + 1000 * sp + 100 * pi + 7))
    return cases


def synthetic_case(op_id: str, op: str, phase: str, meta: dict, shapes: dict, dtype: str, seed: int) -> Case:
    """One attention input of the given shapes: seeded normal q/k/v, block ids 0…n-1."""
    def load(device):
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
