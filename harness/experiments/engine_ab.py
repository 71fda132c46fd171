"""``ab-engine``: a DiT-engine candidate against the same engine without it, inside one process
per rank.

``compare`` judges a candidate end to end, but relaunches the whole topology for every arm of
every round (at full size about a minute of start-up and warm-up per launch). A candidate
that only changes the DiT engine — a runtime switch the engine reads at each forward
(``kv_path``, ``attention``: H1a, H1b) or an engine patch (H2a) — can be judged without any of
that: one engine, weights initialised once, sessions alternating A B B A A B … with the same
seed for each pair, so every B session has an A twin of identical inputs.

Judgement mirrors ``compare``: the candidate's gate first (exact: byte-identical latents of every
chunk of every pair; threshold: the latent criteria of DESIGN §5), then the ratio of medians B/A
of the steady chunk times (chunks whose K window is saturated) with a 95 % session-bootstrap
interval, against an A/A floor from the A sessions split alternately. Anything that changes the
serving pipeline (VAE, output path, scheduler) is refused: use ``compare``.
"""

from __future__ import annotations

import json
import sys

import msgspec
import torch

from harness import candidates as C
from harness.config import HarnessConfig, override
from harness.engine.groups import RankGroup, run_ranks
from harness.errors import HarnessError
from harness.experiments.bench_engine import dit_engine_for, steady_chunk_index, timed_session
from harness.experiments.compare import gate_kind
from harness.measure import stats as S
from harness.measure.gates import latent_metrics, latent_passes

#: Runtime fields the DiT engine reads at every forward, so a candidate may flip them per session.
ENGINE_SWITCHES = ("kv_path", "attention")


def engine_switches(specs: list[str], cfg: HarnessConfig) -> dict[str, str]:
    """The engine switches the candidates set (``configure``); refuses candidates that change
    anything an engine alone cannot show (VAE, output path, scheduler, other config)."""
    resolved = C.resolve(specs, cfg)
    for c, _ in resolved:
        if c.patch_vae or c.patch_output:
            raise HarnessError(f"candidate {c.id} changes the {'VAE' if c.patch_vae else 'output path'}: use compare")
    after = C.configure(specs, cfg)
    changed = {k for k in msgspec.structs.asdict(cfg.runtime) if getattr(cfg.runtime, k) != getattr(after.runtime, k)}
    others = [s for s in ("model", "video", "cache", "schedule", "vae", "parallel") if getattr(cfg, s) != getattr(after, s)]
    if others or changed - set(ENGINE_SWITCHES):
        what = ", ".join(others + sorted(f"runtime.{k}" for k in changed - set(ENGINE_SWITCHES)))
        raise HarnessError(f"{', '.join(specs)} change{'s' if len(specs) == 1 else ''} {what}, not just the DiT engine: use compare")
    if not changed and not any(c.patch_dit for c, _ in resolved):
        raise HarnessError(f"{', '.join(specs)} change{'s' if len(specs) == 1 else ''} nothing in this config "
                           "(the baseline already has it): both arms would be the same")
    return {k: getattr(after.runtime, k) for k in sorted(changed)}


def arm_order(pairs: int) -> list[str]:
    """A B, B A, A B, …: each pair alternates which arm goes first, so a slow drift of the
    machine weighs on both arms alike."""
    return [arm for p in range(pairs) for arm in (("A", "B") if p % 2 == 0 else ("B", "A"))]


def _rank(group: RankGroup, cfg: HarnessConfig, specs: list[str], switches: dict[str, str], pairs: int,
          chunks: int) -> dict:
    eng, device = dit_engine_for(group, cfg)
    base = {k: getattr(eng, k) for k in switches}
    patches = [(c.patch_dit, arg) for c, arg in C.resolve(specs, cfg) if c.patch_dit is not None]
    actions = (["W", "", "D"] * cfg.video.frames_per_chunk)[: cfg.video.frames_per_chunk]

    def session(arm: str, seed: int, n: int) -> tuple[list[float], list[bytes]]:
        reverts = []
        if arm == "B":
            for k, v in switches.items():
                setattr(eng, k, v)
            reverts = [patch(eng, arg) for patch, arg in patches]
        try:
            lat: list[bytes] = []
            keep = (lambda x: lat.append(x.float().cpu().numpy().tobytes())) if group.rank == 0 else None
            times = timed_session(eng, device, actions, prompt="ab-engine", seed=seed, chunks=n, on_latent=keep)
            return times, lat
        finally:
            for r in reverts:
                r()
            for k, v in base.items():
                setattr(eng, k, v)

    if cfg.runtime.mode != "eager":  # compilation and CUDA-graph recording, for both arms' paths
        for arm in ("A", "B"):
            session(arm, 10_000, min(3, chunks))
    out = {"A": [], "B": [], "latents": {"A": [], "B": []}, "order": arm_order(pairs)}
    for i, arm in enumerate(out["order"]):
        times, lat = session(arm, seed=i // 2, n=chunks)
        out[arm].append(times)
        out["latents"][arm].append(lat)
    return out


def gate_pairs(kind: str, a: list[list[bytes]], b: list[list[bytes]], shape: tuple[int, ...]) -> dict:
    """The candidate's gate over every chunk of every pair (latents as raw float32 bytes)."""
    import numpy as np

    failed, worst = [], 0.0
    for p, (sa, sb) in enumerate(zip(a, b)):
        for c, (xa, xb) in enumerate(zip(sa, sb)):
            if kind == "exact":
                ok = xa == xb
            else:
                m = latent_metrics(np.frombuffer(xa, np.float32).reshape(shape), np.frombuffer(xb, np.float32).reshape(shape))
                worst = max(worst, m.get("rel_l2", float("inf")))
                ok = not latent_passes(m)
            if not ok:
                failed.append(f"pair {p} chunk {c}")
    n = sum(len(s) for s in a)
    return {"kind": kind, "passed": not failed and n > 0, "compared": n, "failed": failed[:10],
            **({"worst_rel_l2": worst} if kind == "threshold" else {})}


def judge(a: list[list[float]], b: list[list[float]], steady: int, gate_passed: bool, seed: int = 0) -> dict:
    """Ratio of medians B/A of the steady chunk times, 95 % interval, A/A floor, verdict."""
    sa, sb = [t[steady:] for t in a], [t[steady:] for t in b]
    if not all(sa) or not all(sb):
        raise HarnessError(f"sessions need more than {steady} chunks for a steady (window-saturated) chunk")
    ab = S.ratio_of_medians(sa, sb, seed=seed)
    # A sessions by position: the first-run A of each pair vs the second-run one, so any order
    # effect lands in the floor (conservative)
    h1, h2 = S.split_alternating(sa)
    aa = S.ratio_of_medians(h1, h2, seed=seed) if min(len(h1), len(h2)) >= S.MIN_SESSIONS_PER_HALF else None
    v = S.ab_verdict(ab, aa, gate_passed)
    if aa is None and v.verdict in ("faster", "slower"):
        v = msgspec.structs.replace(v, verdict="no resolvable difference",
                                    reason=f"{v.reason.replace(' (no A/A noise floor)', '')}; no A/A noise floor: "
                                           f"needs ≥ {2 * S.MIN_SESSIONS_PER_HALF} pairs")
    return {"baseline_ms": S.nearest_rank([x for s in sa for x in s], 50),  # the statistic the ratio uses
            "candidate_ms": S.nearest_rank([x for s in sb for x in s], 50),
            "ratio": msgspec.to_builtins(ab), "aa": msgspec.to_builtins(aa) if aa else None,
            "noise_floor": v.noise_floor, "verdict": v.verdict, "reason": v.reason}


def run(cfg: HarnessConfig, specs: list[str], pairs: int, chunks: int) -> dict:
    switches = engine_switches(specs, cfg)  # refuses before anything starts
    steady = steady_chunk_index(cfg)
    if chunks <= steady:
        raise HarnessError(f"--chunks {chunks}: sessions need more than {steady} chunks for a steady (window-saturated) chunk")
    kind = gate_kind([c.gate for c, _ in C.resolve(specs, cfg)])
    backend = "nccl" if cfg.runtime.device == "cuda" else "gloo"
    res = run_ranks(_rank, cfg.parallel.sp, cfg, specs, switches, pairs, chunks, backend=backend, timeout_s=3600)[0]
    shape = (16, cfg.video.frames_per_chunk, cfg.video.latent_h, cfg.video.latent_w)
    gate = gate_pairs(kind, res["latents"]["A"], res["latents"]["B"], shape)
    out = {"candidate": specs, "preset": cfg.name, "mode": cfg.runtime.mode, "sp": cfg.parallel.sp,
           "layers": cfg.model.num_layers, "pairs": pairs, "chunks": chunks, "order": " ".join(res["order"]),
           "steady_from_chunk": steady, "gate": gate, "chunk_ms": {"A": res["A"], "B": res["B"]}}
    if gate["passed"]:
        out.update(judge(res["A"], res["B"], steady, True))
    else:
        out.update(verdict="no verdict", reason=f"{kind} gate failed: {', '.join(gate['failed'][:3])}")
    return out


def main(args) -> int:
    from harness.cli import base_config

    cfg = override(base_config(args), parallel={"sp": args.sp}, runtime={"device": args.device, "mode": args.mode})
    if args.pairs < 1 or (args.chunks is not None and args.chunks < 1):
        raise HarnessError("--pairs and --chunks must be ≥ 1")
    from harness.limits import check_chunks_option

    check_chunks_option(args.chunks, cfg.video.frames_per_chunk)  # up front, not in a rank minutes later
    if not args.candidate:
        raise HarnessError("ab-engine needs --candidate ID")
    if cfg.runtime.device == "cuda" and not torch.cuda.is_available():
        raise HarnessError("--device cuda but no CUDA device is visible")
    res = run(cfg, list(args.candidate), args.pairs, args.chunks or cfg.video.chunks_per_session)
    g = res["gate"]
    print(f"ab-engine {'+'.join(res['candidate'])} on {res['preset']} ({res['mode']}, SP={res['sp']}, {res['layers']} layers), "
          f"{res['pairs']} pairs × {res['chunks']} chunks, order {res['order']}")
    print(f"  gate ({g['kind']}): {'pass' if g['passed'] else 'FAIL'} over {g['compared']} chunk pairs"
          + (f", worst rel-L2 {g['worst_rel_l2']:.3g}" if "worst_rel_l2" in g else ""))
    if "ratio" in res:
        r = res["ratio"]
        print(f"  steady chunk P50 {res['baseline_ms']:.1f} → {res['candidate_ms']:.1f} ms, ratio {r['value']:.4f} "
              f"[{r['low']:.4f}, {r['high']:.4f}]")
    print(f"  verdict: {res['verdict']} — {res['reason']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    sys.stdout.flush()
    return 0 if g["passed"] else 1
