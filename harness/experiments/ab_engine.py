"""``ab-engine``: a DiT-engine candidate against the same engine without it, inside one process
per rank.

``compare`` judges a candidate end to end, but relaunches the whole topology for every arm of
every round (at full size about a minute of start-up and warm-up per launch). A candidate
that only changes the DiT engine — a runtime switch the engine reads at each forward
(``kv_path``, ``attention``: H1a, H1b) or an engine patch (H2a) — can be judged without any of
that: per launch one engine, weights initialised once, sessions alternating A B B A A B … with
the same seed for each pair, so every B session has an A twin of identical inputs.

**What a launch is here.** Pairs share one process: its placement, allocator state, clocks and —
compiled — the kernels chosen for each arm's path. A difference between the arms that comes from
how this one process happened to settle (an autotuned kernel, a buffer's placement) repeats in
every pair, so pairs are not independent evidence: from one process any number of pairs gives an
interval that is too narrow. ``--launches L`` starts L separate process groups (fresh weights,
fresh compilation), each running ``--pairs`` pairs; a launch is the unit of the verdict, as in
``compare``: per launch the median steady chunk time of each arm, and the one-sample t interval of
the per-launch log ratios B/A (paired: both arms share the launch, so what the launch shifts for
both cancels). One launch: no verdict.

Judgement: the candidate's gate first (exact: byte-identical latents of every chunk of every
pair; threshold: the latent criteria of DESIGN §5), then ``stats.judge_ab``. A candidate that
patches the VAE alone (H3a, H3b) is judged on decode sessions instead (``vae_ab``: the pixel gate,
decode milliseconds). Anything else that changes the serving pipeline (VAE together with the
DiT, output path, scheduler) is refused: use ``compare``.
"""

from __future__ import annotations

import json
import sys

import msgspec
import numpy as np
import torch

from harness import candidates as C
from harness.config import HarnessConfig, override
from harness.drivers.config_options import base_config
from harness.engine.groups import RankGroup, run_ranks
from harness.errors import HarnessError
from harness.experiments.bench_engine import check_steady_chunks, dit_engine_for, timed_session, warmup_chunks
from harness.experiments import vae_ab
from harness.experiments.compare import gate_kind
from harness.limits import check_chunks_option
from harness.measure import stats as S
from harness.measure.gates import latent_metrics, latent_passes

#: Runtime fields the DiT engine reads at every forward, so a candidate may flip them per session.
ENGINE_SWITCHES = ("kv_path", "kv_layout", "attention", "attention_out", "kv_write", "residual", "ffn_residual", "block_inputs",
                   "qk_norm_rope", "ffn_norm", "attn_norm", "inductor_tuning")


class ArmPlan(msgspec.Struct, frozen=True):
    """One arm as the driver resolved it, once: what every rank applies (the ``Chosen`` records,
    in apply order, and the runtime switches) and the gate its latents face."""

    chosen: tuple[C.Chosen, ...]
    switches: dict[str, str]
    gate: str


#: the baseline arm: no candidate, nothing switched (its gate is never consulted)
BASELINE = ArmPlan(chosen=(), switches={}, gate="exact")


def plan_arm(specs: list[str], cfg: HarnessConfig) -> ArmPlan:
    """Resolve an arm's candidates against ``cfg`` (one line for anything refused) into what
    travels to the ranks."""
    return plan_resolved(specs, C.resolve(specs, cfg), cfg)


def plan_resolved(specs: list[str], resolved: list[tuple[C.Candidate, str]], cfg: HarnessConfig) -> ArmPlan:
    """``plan_arm`` for candidates ``candidates.resolve`` already returned (``specs``: their
    spelling, for the refusals)."""
    return ArmPlan(chosen=C.chosen(resolved), switches=engine_switches(specs, resolved, cfg),
                   gate=gate_kind([c.gate for c, _ in resolved]))


def engine_switches(specs: list[str], resolved: list[tuple[C.Candidate, str]], cfg: HarnessConfig) -> dict[str, str]:
    """The engine switches the candidates set (their ``configure``); refuses candidates that
    change anything an engine alone cannot show (VAE, output path, scheduler, other config)."""
    for c, _ in resolved:
        if c.patch_vae or c.patch_output:
            raise HarnessError(f"candidate {c.id} changes the {'VAE' if c.patch_vae else 'output path'}: use compare")
    after = C.configure_resolved(resolved, cfg)
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


def session_actions(cfg: HarnessConfig) -> list[str]:
    """The actions of every frame of an A/B session's chunks (walk, idle, turn, …): the same for
    every arm, so arms differ only in what the candidates change."""
    return (["W", "", "D"] * cfg.video.frames_per_chunk)[: cfg.video.frames_per_chunk]


def latent_bytes(x: torch.Tensor) -> bytes:
    """A chunk's latent as raw float32 bytes, the form ``gate_pairs`` reads back."""
    return x.float().cpu().numpy().tobytes()


class EngineArm:
    """One arm's engine state, entered for each of its sessions: the candidates' runtime switches
    set and their DiT patches applied (``candidates.EnginePatches``: registry order), then all put
    back on leaving — every revert runs, also when a session or a revert fails, so the next arm
    never runs on a half-patched engine. The baseline is an arm with no candidates."""

    def __init__(self, eng, plan: ArmPlan):
        self.eng, self.switches = eng, plan.switches
        self.patches = C.EnginePatches(plan.chosen)  # empty between sessions: every revert has run
        self.base: dict = {}

    def __enter__(self) -> EngineArm:
        self.base = {k: getattr(self.eng, k) for k in self.switches}
        try:
            for k, v in self.switches.items():
                setattr(self.eng, k, v)
            self.patches.apply(dit=self.eng)  # takes back what it applied if a patch fails
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.patches.revert()
        finally:
            self._restore()

    def _restore(self) -> None:
        for k, v in self.base.items():
            setattr(self.eng, k, v)


def _rank(group: RankGroup, cfg: HarnessConfig, plan: ArmPlan, pairs: int, chunks: int) -> dict:
    eng, device = dit_engine_for(group, cfg)
    arms = {"A": EngineArm(eng, BASELINE), "B": EngineArm(eng, plan)}
    actions = session_actions(cfg)

    def session(arm: str, seed: int, n: int) -> tuple[list[float], list[bytes]]:
        with arms[arm]:
            lat: list[bytes] = []
            keep = (lambda x: lat.append(latent_bytes(x))) if group.rank == 0 else None
            times = timed_session(eng, device, actions, prompt="ab-engine", seed=seed, chunks=n, on_latent=keep)
            return times, lat

    if cfg.runtime.mode != "eager":  # compilation and CUDA-graph recording, for both arms' paths
        for arm in ("A", "B"):
            session(arm, 10_000, warmup_chunks(chunks))
    out = {"A": [], "B": [], "latents": {"A": [], "B": []}, "order": arm_order(pairs)}
    for i, arm in enumerate(out["order"]):
        times, lat = session(arm, seed=i // 2, n=chunks)
        out[arm].append(times)
        out["latents"][arm].append(lat)
    return out


def gate_pairs(kind: str, a: list[list[bytes]], b: list[list[bytes]], shape: tuple[int, ...]) -> dict:
    """The candidate's gate over every chunk of every pair (latents as raw float32 bytes)."""
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


DEFAULT_LAUNCHES = 3


def ratio_columns(res: dict, r: dict) -> str:
    """``A → B ms, ratio 0.97 [0.95, 0.99]`` from a recorded judgement: columns and ratio from the
    same units, rounded to the interval's width (``stats.ratio_text``)."""
    iv = msgspec.convert(r, S.Interval)
    d = S.decimals(res["baseline_ms"] * (iv.high - iv.low) / iv.value if iv.low is not None else res["baseline_ms"], most=1)
    return f"{res['baseline_ms']:.{d}f} → {res['candidate_ms']:.{d}f} ms, ratio {S.ratio_text(iv)}"


def judge(launches: list[dict], steady: int, gate_passed: bool) -> dict:
    """Per launch the steady chunk times of each arm (chunks whose K window is saturated) →
    medians, the paired launch-level interval of B/A, the verdict (``stats.judge_ab``)."""
    arms = {arm: [[t[steady:] for t in l[arm]] for l in launches] for arm in ("A", "B")}
    if not all(s for arm in arms.values() for l in arm for s in l):
        raise HarnessError(f"sessions need more than {steady} chunks for a steady (window-saturated) chunk")
    v = S.judge_ab(arms["A"], arms["B"], gate_passed=gate_passed, paired=True)
    shown = v.ab or v.within_launch  # the columns are the units the ratio reads: candidate_ms / baseline_ms = ratio
    if shown is None:  # no interval at all (one session an arm): the medians of the chunk times, said as such
        flat = {arm: [x for l in arms[arm] for s in l for x in s] for arm in arms}
        base, cand = S.nearest_rank(flat["A"], 50), S.nearest_rank(flat["B"], 50)
    else:
        base, cand = shown.center_a, shown.center_b
    return {"baseline_ms": base, "candidate_ms": cand,
            "launches": len(launches), "ratio": msgspec.to_builtins(v.ab) if v.ab else None,
            "within_launch": msgspec.to_builtins(v.within_launch) if v.within_launch else None,
            "aa": msgspec.to_builtins(v.aa) if v.aa else None, "noise_floor": None, "mde": v.mde,
            "verdict": v.verdict, "reason": v.reason}


def run(cfg: HarnessConfig, specs: list[str], pairs: int, chunks: int, launches: int = DEFAULT_LAUNCHES) -> dict:
    resolved = C.resolve(specs, cfg)  # the one resolution: the ranks get its records
    if vae_ab.vae_only(resolved):
        return run_vae(cfg, specs, resolved, pairs, chunks, launches)
    plan = plan_resolved(specs, resolved, cfg)  # refuses before anything starts
    steady = check_steady_chunks(chunks, cfg)
    kind = plan.gate
    backend = "nccl" if cfg.runtime.device == "cuda" else "gloo"
    # every launch a fresh process group: new weights, new compilation, new allocator
    res = [run_ranks(_rank, cfg.parallel.sp, cfg, plan, pairs, chunks, backend=backend, timeout_s=3600)[0]
           for _ in range(launches)]
    shape = (16, cfg.video.frames_per_chunk, cfg.video.latent_h, cfg.video.latent_w)
    out = {"candidate": specs, "preset": cfg.name, "mode": cfg.runtime.mode, "sp": cfg.parallel.sp,
           "layers": cfg.model.num_layers, "pairs": pairs, "chunks": chunks, "order": " ".join(res[0]["order"]),
           "steady_from_chunk": steady, "chunk_ms": [{"A": r["A"], "B": r["B"]} for r in res]}
    out.update(judge_gated(kind, [s for r in res for s in r["latents"]["A"]], [s for r in res for s in r["latents"]["B"]],
                           shape, res, steady))
    return out


def run_vae(cfg: HarnessConfig, specs: list[str], resolved: list[tuple[C.Candidate, str]], pairs: int, chunks: int,
            launches: int) -> dict:
    """A VAE candidate's A/B (``vae_ab``): decode sessions instead of DiT sessions, the pixel gate
    instead of the latent one, the same launch-level judgement."""
    if chunks <= vae_ab.STEADY:
        raise HarnessError(f"--chunks {chunks}: a decode session needs more than {vae_ab.STEADY} chunk for a steady chunk")
    kind = gate_kind([c.gate for c, _ in resolved])
    res = vae_ab.run_launches(cfg, C.chosen(resolved), arm_order(pairs), chunks, launches)
    out = {"candidate": specs, "stage": "vae", "preset": cfg.name, "mode": cfg.runtime.mode,
           "sp": cfg.parallel.vae_ranks, "layers": cfg.model.num_layers, "pairs": pairs, "chunks": chunks,
           "order": " ".join(res[0]["order"]), "steady_from_chunk": vae_ab.STEADY,
           "chunk_ms": [{"A": r["A"], "B": r["B"]} for r in res]}
    gate = vae_ab.gate_frames(kind, [s for r in res for s in r["frames"]["A"]], [s for r in res for s in r["frames"]["B"]])
    if not gate["passed"]:
        out.update(gate=gate, launches=len(res), verdict="no verdict",
                   reason=f"{kind} pixel gate failed: {', '.join(gate['failed'][:3])}")
        return out
    return {**out, "gate": gate, **judge(res, vae_ab.STEADY, True)}


def judge_gated(kind: str, lat_a, lat_b, shape, launches: list[dict], steady: int) -> dict:
    """The candidate's gate over every chunk pair, then (passed) ``judge`` of the timings: a
    candidate that fails its gate is never reported faster or slower."""
    gate = gate_pairs(kind, lat_a, lat_b, shape)
    if not gate["passed"]:
        return {"gate": gate, "launches": len(launches), "verdict": "no verdict",
                "reason": f"{kind} gate failed: {', '.join(gate['failed'][:3])}"}
    return {"gate": gate, **judge(launches, steady, True)}


def main(args) -> int:
    cfg = override(base_config(args), parallel={"sp": args.sp}, runtime={"device": args.device, "mode": args.mode})
    if args.pairs < 1 or args.launches < 1 or (args.chunks is not None and args.chunks < 1):
        raise HarnessError("--pairs, --launches and --chunks must be ≥ 1")

    check_chunks_option(args.chunks, cfg.video.frames_per_chunk)  # up front, not in a rank minutes later
    if not args.candidate:
        raise HarnessError("ab-engine needs --candidate ID")
    if cfg.runtime.device == "cuda" and not torch.cuda.is_available():
        raise HarnessError("--device cuda but no CUDA device is visible")
    res = run(cfg, list(args.candidate), args.pairs, args.chunks or cfg.video.chunks_per_session, args.launches)
    g = res["gate"]
    print(f"ab-engine {'+'.join(res['candidate'])} on {res['preset']} ({res['mode']}, {'VAE ranks' if res.get('stage') == 'vae' else 'SP'}={res['sp']}, {res['layers']} layers), "
          f"{res['launches']} launches × {res['pairs']} pairs × {res['chunks']} chunks, order {res['order']}")
    print(f"  gate ({g['kind']}): {'pass' if g['passed'] else 'FAIL'} over {g['compared']} chunk pairs"
          + (f", worst rel-L2 {g['worst_rel_l2']:.3g}" if "worst_rel_l2" in g else "")
          + (f", pixels: worst RMSE {g['worst_rmse']:.3g} (PSNR {g['min_psnr_db'] or float('inf'):.1f} dB), "
             f"worst max|Δ| {g['worst_max_abs']:.3g}" if "worst_rmse" in g else ""))
    r = res.get("ratio") or res.get("within_launch")
    if r:
        what = "paired over launches" if res.get("ratio") else "within one launch, no verdict"
        print(f"  steady chunk (geometric mean of the {'launch' if res.get('ratio') else 'session'} medians) "
              f"{ratio_columns(res, r)} ({what})"
              + (f"; minimum detectable effect (80 % power) {100 * res['mde']:.2g} %" if res.get("mde") else ""))
    print(f"  verdict: {res['verdict']} — {res['reason']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    sys.stdout.flush()
    return 0 if g["passed"] else 1
