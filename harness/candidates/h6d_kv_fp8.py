"""H6d: an FP8 (e4m3) KV cache, quantised once when written, read by FP8 attention.

H6b's ``fa3-fp8`` re-quantises the whole visible K/V in every forward of every layer, which costs
about what FlashAttention-3's FP8 forward saves. H6d stores K (after norm and RoPE) and V in the
cache as e4m3 the moment they are written (``engine/kv_fp8.py``): a forward quantises only its
queries and the chunk's own K/V (1/6 of the window at 480×832), the pool holds half the bytes
(so H1c's eviction moves and the paged layout's gather move half as much), and the kernel reads
the pool through one descale per (layer, KV head) of the session — set from the first chunk's
per-head amax with ×4 headroom, frozen at its first commit, saturating beyond (why one per head,
and the alternatives: ``kv_fp8``'s docstring). Cross-attention stays bf16 (``fa3``'s bf16 forward
on the GPU): its K is 512 text tokens, ≈ 2 % of the self-attention's work at 480×832, and under SP
its queries are the rank's own tokens, so a per-head Q scale there would depend on the SP split —
measured on the tiny preset, FP8 cross-attention made SP=2 differ from SP=1 by rel-L2 0.008, as
much as FP8 itself moved the latent (0.011). Without it SP 2 and 4 are bit-identical to SP 1.

``H6d:fa3`` (default) runs FA3's FP8 kernel (CUDA, Hopper, the ``fa3-fwd`` wheel);
``H6d:emulated`` runs the same e4m3 grid and scales through the CPU emulation (dequantise, fp32
scores, P rounded to e4m3) — for testing the numerics anywhere, not for speed. Works with the
paged and window (H1c) layouts, through eviction and cancel, on any SP size; applied between
sessions (it swaps the engine's cache, refused while a session is open).

Gate: threshold (DESIGN §5). Random weights: attention is near-uniform, harder on FP8 than a
trained model's — the verdict is indicative; re-run with the checkpoint (``--dit-weights PATH``; ``--set engine.dit_weights=PATH`` for ``ab-engine``).
"""

import weakref

from harness.candidates import Candidate, set_runtime
from harness.engine.kv_fp8 import Fp8KVCache
from harness.errors import HarnessError

#: argument → (FP8 KV kernel, the dense backend for cross-attention; None: the run's own)
KERNELS = {"fa3": ("fa3", "fa3"), "emulated": ("emulated", None)}


#: The candidate's own state, not an attribute of the engine: per engine, kernel → its e4m3
#: cache, allocated at the first patch and reused by later ones; a weak key, so it goes with the engine.
POOLS: "weakref.WeakKeyDictionary[object, dict[str, Fp8KVCache]]" = weakref.WeakKeyDictionary()


def _configure(cfg, arg: str):
    cross = KERNELS[arg][1]
    return cfg if cross is None else set_runtime(cfg, attention=cross)


def _patch(engine, arg: str):
    if engine.cache.stats()["sessions"]:
        raise HarnessError("H6d swaps the engine's KV cache: apply it with no session open")
    kernel, _ = KERNELS[arg]
    caches = POOLS.setdefault(engine, {})  # allocated once per engine and kernel
    if kernel not in caches:
        caches[kernel] = Fp8KVCache.from_config(engine.cfg, sp=engine.group.size, device=engine.device, kernel=kernel)
    original = engine.cache
    engine.cache = caches[kernel]

    def revert() -> None:
        engine.cache = original

    return revert


CANDIDATE = Candidate(
    id="H6d",
    name="kv_fp8",
    description="FP8 e4m3 KV cache quantised once on write (per-session, per-head scales), read by FP8 attention",
    gate="threshold",
    conflicts=("H1a", "H1b", "H6b", "H6c"),
    changes="engine",
    arg_choices=tuple(KERNELS),
    default_arg="fa3",
    arg_needs={"fa3": ("cuda", "fa3")},
    configure=_configure,
    patch_dit=_patch,
)
