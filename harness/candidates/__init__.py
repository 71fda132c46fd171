"""Optimisation candidates: reversible, switchable patches with a declared numeric gate.

The shape follows torchtitan's model converters: each candidate is one module exposing a
``CANDIDATE`` object; the registry resolves ids (refusing unknown ids, conflicts and unmet
requirements with one-line errors), applies the configuration part in the driver before launch,
and the engine part inside each worker (``EnginePatches``), both in registry order. Every engine
patch returns its revert; the container keeps them and can undo all of them, last first.

An id may carry an argument after a colon, e.g. ``H1b:cudnn``.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

import msgspec

from harness.config import HarnessConfig, override
from harness.errors import HarnessError

Gate = Literal["exact", "threshold", "serving"]

#: id → module under harness.candidates; the order here is the order patches are applied in.
MODULES: dict[str, str] = {
    "H1a": "h1a_kv_gather_off",
    "H1b": "h1b_sdpa_backend",
    "H1c": "h1c_kv_window",
    "H1d": "h1d_static_attention_out",
    "H1e": "h1e_kv_append",
    "H1f": "h1f_kv_in_graph",
    "H1g": "h1g_static_block_inputs",
    "H2a": "h2a_camera_chunk_cache",
    "H2b": "h2b_residual_runtime_dtype",
    "H2c": "h2c_ffn_residual_next",
    "H2d": "h2d_qk_norm_rope_kernel",
    "H2e": "h2e_inductor_tuning",
    "H2f": "h2f_ffn_norm_kernel",
    "H2g": "h2g_attn_norm_kernel",
    "H3a": "h3a_vae_compile",
    "H3b": "h3b_vae_bf16",
    "H3c": "h3c_condition_fp16",
    "H4a": "h4a_fused_output",
    "H4b": "h4b_pinned_d2h",
    "H5a": "h5a_decode_overlap",
    "H5b": "h5b_deferred_commit",
    "H5c": "h5c_early_condition",
    "H6a": "h6a_fp8_linear",
    "H6b": "h6b_fp8_attention",
    "H6c": "h6c_fp8_both",
    "H6d": "h6d_kv_fp8",
    "H6e": "h6e_fp8_ffn_fused",
    "H6f": "h6f_fp8_attention_fine",
}


@dataclass(frozen=True)
class Candidate:
    id: str
    name: str
    description: str
    gate: Gate
    reference: Literal["eager", "deterministic"] = "eager"
    needs: tuple[str, ...] = ()  # "cuda", "triton", "fa3", "fp8"
    conflicts: tuple[str, ...] = ()
    changes: str = "engine"  # "engine", "runtime", "scheduler" — what it touches
    configure: Callable[[HarnessConfig, str], HarnessConfig] | None = None
    patch_dit: Callable[[Any, str], Callable[[], None]] | None = None
    patch_vae: Callable[[Any, str], Callable[[], None]] | None = None
    patch_output: Callable[[Any, str], Callable[[], None]] | None = None
    arg_choices: tuple[str, ...] = ()
    default_arg: str = ""
    #: requirements of particular arguments only (e.g. a kernel that exists only on CUDA)
    arg_needs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    @property
    def touches_reference_dit(self) -> bool:
        """An engine candidate that touches neither the VAE nor the output path works on the
        reference DiT (H1a/H1b switch its attention paths, H2a and H6x patch its modules)."""
        return self.changes == "engine" and self.patch_vae is None and self.patch_output is None


class Chosen(msgspec.Struct, frozen=True):
    """One candidate as ``resolve`` accepted it: its id and its argument (the default filled in).
    What the driver hands every rank, in apply order, so that no rank parses or checks the
    command line's spelling again."""

    id: str
    arg: str = ""

    def __str__(self) -> str:
        return f"{self.id}:{self.arg}" if self.arg else self.id


def chosen(pairs: list[tuple[Candidate, str]]) -> tuple[Chosen, ...]:
    """``resolve``'s (candidate, argument) pairs as the records that travel to the ranks."""
    return tuple(Chosen(c.id, arg) for c, arg in pairs)


def split_id(spec: str) -> tuple[str, str]:
    cid, _, arg = spec.partition(":")
    return cid.strip(), arg.strip()


_ID_SHAPE = re.compile(r"^H\d+[a-z]$")


def split_joined(text: str) -> list[str]:
    """``"H6a:ffn+o+H1b:fa3"`` → ``["H6a:ffn+o", "H1b:fa3"]``: a '+'-joined candidate list, where a
    '+' starts a new candidate only before a known id (arguments such as ``ffn+o`` hold '+' too)."""
    specs: list[str] = []
    for piece in (p.strip() for p in text.split("+")):
        if not piece:
            continue
        # a piece shaped like an id starts a candidate, known or not (an unknown one is refused by name)
        if specs and not _ID_SHAPE.match(split_id(piece)[0]):
            specs[-1] += "+" + piece
        else:
            specs.append(piece)
    return specs


def get(cid: str) -> Candidate:
    if cid not in MODULES:
        raise HarnessError(f"unknown candidate {cid!r} (known: {', '.join(MODULES)})")
    return importlib.import_module(f"harness.candidates.{MODULES[cid]}").CANDIDATE


def all_candidates() -> list[Candidate]:
    return [get(c) for c in MODULES]


def _available(need: str, device: str) -> bool:
    if need == "cuda":
        return device == "cuda"
    if need == "triton":
        try:
            import triton  # noqa: F401  — optional (CUDA extra): only whether it imports matters
        except ImportError:
            return False
        return device == "cuda"
    if need == "fa3":  # the fa3-fwd wheel and a Hopper GPU
        from harness.engine.fa3 import unavailable_reason  # torch: see below

        return device == "cuda" and unavailable_reason(device) is None
    if need == "fp8":  # e4m3 GEMMs: CPU, or a GPU of compute capability ≥ 8.9
        if device != "cuda":
            return True
        # Imported here, not at the top: the command line imports this registry (drivers.config_options)
        # to build its parser, and torch would cost every --help about 1.5 s.
        import torch

        return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    return True


def resolve(specs: tuple[str, ...] | list[str], cfg: HarnessConfig) -> list[tuple[Candidate, str]]:
    """Validate a candidate list against a config; returns (candidate, argument) in apply order."""
    chosen: dict[str, tuple[Candidate, str]] = {}
    for spec in specs:
        cid, arg = split_id(spec)
        c = get(cid)
        if cid in chosen:
            raise HarnessError(f"candidate {cid} given twice")
        arg = arg or c.default_arg
        if c.arg_choices and arg not in c.arg_choices:
            raise HarnessError(f"candidate {cid} takes one of {', '.join(c.arg_choices)}, got {arg!r}")
        if not c.arg_choices and arg:
            raise HarnessError(f"candidate {cid} takes no argument, got {arg!r}")
        for need in c.needs + c.arg_needs.get(arg, ()):
            if not _available(need, cfg.runtime.device):
                what = f"{cid}:{arg}" if arg in c.arg_needs else cid
                raise HarnessError(f"candidate {what} ({c.name}) needs {need}; this run is on {cfg.runtime.device}")
        if cfg.engine.backend != "reference" and c.touches_reference_dit:
            raise HarnessError(f"candidate {cid} ({c.name}) patches the reference DiT engine; it does not apply to "
                               f"--engine {cfg.engine.backend}")
        chosen[cid] = (c, arg)
    for cid, (c, _) in chosen.items():
        for other in c.conflicts:
            if other in chosen:
                raise HarnessError(f"candidates {cid} and {other} conflict and cannot be combined")
    return in_apply_order(list(chosen.values()))


def in_apply_order(pairs: list[tuple[Candidate, str]]) -> list[tuple[Candidate, str]]:
    """(candidate, argument) pairs in registry order (``MODULES``): the one order patches go in."""
    order = {cid: i for i, cid in enumerate(MODULES)}
    return sorted(pairs, key=lambda p: order[p[0].id])


def configure(specs, cfg: HarnessConfig) -> HarnessConfig:
    """Apply the configuration part of every candidate (driver side, before launch)."""
    return configure_resolved(resolve(specs, cfg), cfg)


def configure_resolved(pairs: list[tuple[Candidate, str]], cfg: HarnessConfig) -> HarnessConfig:
    """``configure`` for pairs ``resolve`` already returned (in its order)."""
    for c, arg in pairs:
        if c.configure is not None:
            cfg = c.configure(cfg, arg)
    return cfg


class EnginePatches:
    """The engine patches of a candidate list inside one worker (torchtitan's model-converter
    container): applied in registry order (``MODULES``) whatever order the user gave, every revert
    kept, ``revert()`` undoes them all in reverse order.

    A patch that raises takes back the patches applied before it, so a worker is never left
    half-patched; a patch that returns no revert is a broken candidate and is refused.

    ``specs``: ``Chosen`` records (what a rank gets from the driver, already resolved) or, in a
    process that holds the engine itself (bench-engine, ab-engine, the GPU checks), id strings."""

    def __init__(self, specs: Iterable[str | Chosen]):
        pairs = []
        for spec in specs:
            if isinstance(spec, Chosen):
                pairs.append((get(spec.id), spec.arg))
                continue
            cid, arg = split_id(spec)
            c = get(cid)
            pairs.append((c, arg or c.default_arg))
        self.chosen: list[tuple[Candidate, str]] = in_apply_order(pairs)
        #: (candidate id, revert), in the order the patches were applied
        self.reverts: list[tuple[str, Callable[[], None]]] = []

    def apply(self, *, dit: Any = None, vae: Any = None, output: Any = None) -> list[str]:
        """Patch the given targets; returns the candidate id of every patch applied, in order."""
        try:
            for c, arg in self.chosen:
                for target, patch in ((dit, c.patch_dit), (vae, c.patch_vae), (output, c.patch_output)):
                    if target is not None and patch is not None:
                        revert = patch(target, arg)
                        if not callable(revert):
                            raise TypeError(f"candidate {c.id}: its patch returned {revert!r}, not a revert function")
                        self.reverts.append((c.id, revert))
        except BaseException:
            self.revert()
            raise
        return [cid for cid, _ in self.reverts]

    def revert(self) -> None:
        """Undo every applied patch, last first (each revert runs even when an earlier one fails;
        the first failure is raised after all have run)."""
        first: BaseException | None = None
        while self.reverts:
            _, revert = self.reverts.pop()
            try:
                revert()
            except BaseException as e:  # noqa: BLE001 — re-raised below, after the other reverts
                first = first or e
        if first is not None:
            raise first


def set_runtime(cfg: HarnessConfig, **fields) -> HarnessConfig:
    return override(cfg, runtime=fields)


def table() -> list[dict[str, str]]:
    """One row per registered candidate, in apply order (``python -m harness candidates``)."""
    rows = []
    for c in all_candidates():
        args = f" (arg: {'|'.join(c.arg_choices)}, default {c.default_arg})" if c.arg_choices else ""
        needs = [",".join(c.needs)] if c.needs else []
        needs += [f"{a}:{','.join(n)}" for a, n in c.arg_needs.items()]
        rows.append({"id": c.id, "name": c.name, "gate": c.gate, "reference": c.reference,
                     "needs": " ".join(needs) or "-", "conflicts": ",".join(c.conflicts) or "-",
                     "changes": c.changes, "description": c.description + args})
    return rows


def print_table(args=None) -> int:
    rows = table()
    cols = ("id", "name", "gate", "needs", "conflicts", "changes")
    width = {k: max(len(k), *(len(r[k]) for r in rows)) for k in cols}
    print("  ".join(k.ljust(width[k]) for k in cols) + "  description")
    for r in rows:
        print("  ".join(r[k].ljust(width[k]) for k in cols) + "  " + r["description"])
    return 0
