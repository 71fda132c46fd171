"""Several DiT-engine candidates, each A/B'd against one shared baseline inside one engine.

    python -m harness ab-arms --preset lingbot-480x832 --device cuda --mode compiled \\
        --arm fa3=H1b:fa3 --arm h6a=H6a --arm h6c=H6c [--rounds 4] [--launches N] [--chunks 7] [--kernels] [--json F]

``ab-engine`` judges one candidate per launch; at full size each launch pays the model's
initialisation and a compilation warm-up per arm, several minutes before the first measured
chunk. Here the engine is built and the baseline compiled once, and every arm (a '+'-joined
candidate list, e.g. ``H6a+H1b:fa3``) is one more engine state: its runtime switches and DiT
patches applied for its sessions and reverted after, by the same ``ab_engine.EngineArm`` that
``ab-engine`` uses for its arms.

Round r runs one session of the baseline (A) and of every arm, all with seed r, in an order
rotated by r (a slow drift of the machine weighs on every arm alike). Each arm is then judged
with ``ab-engine``'s own functions: the threshold/exact gate over every chunk against the same
round's A session, then the ratio of medians of the steady chunks (``ab_engine.judge_gated``).
By default a run is one launch, so the ratio's interval is the within-launch one and the verdict
reads "no verdict: one launch" (a screen). ``--launches N`` runs N fresh processes, each building
the engine and every arm, and judges each arm over the launches like ``ab-engine --launches N``:
several candidates get verdicts for one baseline's compilation per launch. ``--kernels`` adds one
chunk to each arm's last session (of the last launch), profiled for a per-kernel breakdown and left
out of the times and the gate. ``--versus fused/best`` also times one arm against another (both
already gated against the baseline), paired per round like B against A: the question "is H6e faster
than H6a" answered inside one launch's engine and over the launches, not read off two intervals
that each carry the baseline's noise.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch

from harness import candidates as C
from harness.config import HarnessConfig, override
from harness.drivers.config_options import base_config
from harness.engine.attention import check_backend
from harness.engine.groups import RankGroup, run_ranks
from harness.errors import HarnessError
from harness.experiments.bench_engine import (
    check_steady_chunks,
    count_steady_flops,
    dit_engine_for,
    measure_peak_tflops,
    timed_session,
    warmup_chunks,
    write_result,
)
from harness.experiments.ab_engine import (BASELINE, ArmPlan, EngineArm, judge, judge_gated, latent_bytes, plan_arm,
                                           ratio_columns, session_actions)
from harness.experiments.kernel_profile import ProfileChunk
from harness.measure import stats as S
from harness.measure.kernels import render
from harness.measure.production import mfu


def parse_arms(texts: list[str]) -> dict[str, list[str]]:
    """``name=ID[+ID…]`` → {name: [ID, …]}; names unique, "A" reserved for the baseline."""
    arms: dict[str, list[str]] = {}
    for t in texts:
        name, sep, spec = t.partition("=")
        name, specs = name.strip(), C.split_joined(spec)
        if not sep or not name or not specs:
            raise HarnessError(f"--arm {t!r}: expected NAME=ID[+ID…], e.g. fa3=H1b:fa3")
        if name == "A" or name in arms:
            raise HarnessError(f"--arm name {name!r} is {'reserved for the baseline' if name == 'A' else 'given twice'}")
        arms[name] = specs
    if not arms:
        raise HarnessError("give at least one --arm NAME=ID[+ID…]")
    return arms


def parse_versus(texts: list[str], arms: dict[str, list[str]]) -> list[tuple[str, str]]:
    """``B/A`` → (B, A): arm B timed against arm A (either may be the baseline "A"); both named, distinct."""
    pairs = []
    for t in texts:
        b, sep, a = (x.strip() for x in t.partition("/"))
        if not sep or not a or not b or a == b:
            raise HarnessError(f"--versus {t!r}: expected ARM/ARM, two different arm names, e.g. fused/best")
        for n in (b, a):
            if n != "A" and n not in arms:
                raise HarnessError(f"--versus {t!r}: no arm named {n!r} (arms: A, {', '.join(arms)})")
        pairs.append((b, a))
    return pairs


def judge_versus(runs: list[dict], b: str, a: str, steady: int, arms: dict[str, dict]) -> dict:
    """Arm b's steady chunks against arm a's, paired by round within each launch (``ab_engine.judge``).
    A pair where either arm failed its gate against the baseline gets no verdict."""
    failed = [n for n in (b, a) if n != "A" and not arms[n]["gate"]["passed"]]
    if failed:
        return {"verdict": "no verdict", "reason": f"{', '.join(failed)} failed its gate against the baseline"}
    return judge([{"A": r["times"][a], "B": r["times"][b]} for r in runs], steady, True)


def round_order(names: list[str], r: int) -> list[str]:
    """The baseline and every arm, rotated by the round index."""
    k = r % len(names)
    return names[k:] + names[:k]


def run(cfg: HarnessConfig, arms: dict[str, list[str]], rounds: int, chunks: int, kernels: bool = False,
        launches: int = 1, on_launch: Callable[[dict], None] | None = None,
        versus: list[tuple[str, str]] = ()) -> dict:
    """One engine on one device (SP = 1: ``ab-engine`` covers SP > 1, one candidate per launch).
    ``launches`` = 1 runs in this process; more start one fresh process per launch (new weights,
    new compilation, new allocator), and every arm is judged over the launches. ``on_launch`` gets
    the chunk times of the launches done so far after each one, so that a run stopped in a later
    launch (a step limit, a crash) still leaves what it measured."""
    cfg = override(cfg, parallel={"sp": 1})
    steady = check_steady_chunks(chunks, cfg)
    plans = {n: plan_arm(s, cfg) for n, s in arms.items()}  # every arm resolved (or refused) before the engine is built
    backend = "nccl" if cfg.runtime.device == "cuda" else "gloo"
    setting = {"preset": cfg.name, "mode": cfg.runtime.mode, "sp": 1, "layers": cfg.model.num_layers, "rounds": rounds,
               "launches": launches, "chunks": chunks}
    runs: list[dict] = []
    for i in range(launches):
        if launches == 1:
            runs.append(_launch(RankGroup.single(), cfg, plans, rounds, chunks, kernels))
        else:
            runs.append(run_ranks(_launch, 1, cfg, plans, rounds, chunks, kernels and i == launches - 1,
                                  backend=backend, timeout_s=3600)[0])
        if on_launch is not None:  # judged over the launches so far: a run stopped in launch 3 keeps 2 launches' verdicts
            on_launch({**setting, "launches_done": len(runs), "chunk_ms_by_launch": [r["times"] for r in runs],
                       **judge_arms(runs, arms, plans, versus, steady, cfg), "complete": False})
    names = ["A", *arms]
    out = {**setting, "steady_from_chunk": steady, "order": " ".join(runs[0]["order"]),
           "warmup_chunk_ms": runs[-1]["warm"], "compile": runs[-1]["compile"],
           "chunk_ms": {n: [s for r in runs for s in r["times"][n]] for n in names},
           "chunk_ms_by_launch": [r["times"] for r in runs], "kernels": runs[-1]["profiles"]}
    return {**out, **judge_arms(runs, arms, plans, versus, steady, cfg)}


def judge_arms(runs: list[dict], arms: dict[str, list[str]], plans: dict[str, ArmPlan],
               versus: list[tuple[str, str]], steady: int, cfg: HarnessConfig) -> dict:
    """Every arm gated and judged against the baseline, then every ``--versus`` pair, over ``runs``."""
    shape = (16, cfg.video.frames_per_chunk, cfg.video.latent_h, cfg.video.latent_w)
    judged = {name: {"candidates": specs, "switches": plans[name].switches,
                     **_judge_arm(plans[name], runs, name, steady, shape)} for name, specs in arms.items()}
    return {"arms": judged, "versus": {f"{b}/{a}": judge_versus(runs, b, a, steady, judged) for b, a in versus}}


def _launch(group: RankGroup, cfg: HarnessConfig, plans: dict[str, ArmPlan], rounds: int, chunks: int,
            kernels: bool) -> dict:
    """One launch: the engine built once, every arm warmed (compiled modes), then ``rounds`` rounds
    of one session per arm; the times, latents and (``kernels``) profiles of each arm."""
    eng, device = dit_engine_for(group, cfg)
    state = {"A": EngineArm(eng, BASELINE)} | {n: EngineArm(eng, p) for n, p in plans.items()}
    actions = session_actions(cfg)

    def session(name: str, seed: int, n: int, on_latent=None) -> list[float]:
        with state[name]:
            return timed_session(eng, device, actions, prompt="ab-arms", seed=seed, chunks=n, on_latent=on_latent)

    warm = {}
    if cfg.runtime.mode != "eager":  # compilation and CUDA-graph recording of every arm's graphs
        for name in state:
            warm[name] = session(name, 10_000, warmup_chunks(chunks))
            # at full size the warm-ups are most of a launch: a run killed in them says how far it got
            print(f"warm-up {name}: " + " ".join(f"{x:.1f}" for x in warm[name]), flush=True)
    times, lats, profiles, order = {n: [] for n in state}, {n: [] for n in state}, {}, []
    for r in range(rounds):
        for name in round_order(list(state), r):
            order.append(name)
            lat: list[bytes] = []
            prof = _profiler(chunks) if kernels and r == rounds - 1 and device.type == "cuda" else None

            def on_latent(x, lat=lat, prof=prof) -> None:
                lat.append(latent_bytes(x))
                if prof is not None:
                    prof(x)

            t = session(name, r, chunks + (prof is not None), on_latent)
            if prof is not None:
                profiles[name] = prof.result
            times[name].append(t[:chunks])
            lats[name].append(lat[:chunks])
            # a killed run still leaves every finished session's times in its log
            print(f"round {r} {name}: " + " ".join(f"{x:.1f}" for x in t[:chunks]), flush=True)
    return {"times": times, "latents": lats, "profiles": profiles, "order": order, "warm": warm,
            "compile": eng.compile_stats()}


def _profiler(chunks: int):
    """A per-kernel profile of one extra chunk past the timed ones (dropped from times and gate)."""
    return ProfileChunk(skip=chunks)


def _judge_arm(plan: ArmPlan, runs: list[dict], name: str, steady: int, shape) -> dict:
    """``ab-engine``'s judgement of one arm against the baseline: its gate over every chunk of every
    launch, then (passed) the ratio over the launches (one launch: judged, but never a verdict)."""
    kind = plan.gate
    lat_a = [s for r in runs for s in r["latents"]["A"]]
    lat_b = [s for r in runs for s in r["latents"][name]]
    return judge_gated(kind, lat_a, lat_b, shape, [{"A": r["times"]["A"], "B": r["times"][name]} for r in runs], steady)


def add_rates(out: dict, cfg: HarnessConfig, device: torch.device, peak: float | None = None) -> None:
    """bf16-equivalent TFLOP/s and MFU of each arm's steady P50 (gate passed or not) (the baseline's FLOP count: an
    FP8 arm does the same arithmetic in cheaper units, so its rate may pass the bf16 peak), against ``peak``
    TFLOP/s, or the bf16 GEMM peak measured now on a GPU (``peak_source`` says which)."""
    flops = count_steady_flops(cfg)["dit_flops"]
    out["peak_source"] = "given" if peak else "measured" if device.type == "cuda" else None
    peak = peak or (measure_peak_tflops(device, torch.bfloat16) if device.type == "cuda" else None)
    out["dit_flops"], out["peak_bf16_tflops"] = flops, peak
    st = out["steady_from_chunk"]
    rows = {n: S.nearest_rank([x for s in t for x in s[st:]], 50) for n, t in out["chunk_ms"].items()}
    out["rates"] = {n: {"steady_ms": ms, "tflops_bf16_equiv": flops / (ms / 1e3) / 1e12,
                        "mfu_bf16": mfu(flops, ms, peak, 1) if peak else None}
                    for n, ms in rows.items() if ms}


def _print(out: dict) -> None:
    print(f"ab-arms on {out['preset']} ({out['mode']}, SP=1, {out['layers']} layers), {out['launches']} "
          f"launch{'es' if out['launches'] > 1 else ''} × {out['rounds']} rounds × "
          f"{out['chunks']} chunks, order {out['order']}")
    for name, a in out["arms"].items():
        g = a["gate"]
        line = f"  {name} ({'+'.join(a['candidates'])}): gate {g['kind']} {'pass' if g['passed'] else 'FAIL'}"
        line += f", worst rel-L2 {g['worst_rel_l2']:.4g}" if "worst_rel_l2" in g else ""
        # one launch: the interval is the within-launch one, shown for screening, never a verdict
        if r := a.get("ratio") or a.get("within_launch"):
            line += f"; {ratio_columns(a, r)}" + ("" if a.get("ratio") else " within one launch")
        print(line + f"; {a['verdict']}")
    for pair, v in out.get("versus", {}).items():
        r = v.get("ratio") or v.get("within_launch")
        cols = f"{ratio_columns(v, r)}" + ("" if v.get("ratio") else " within one launch") + "; " if r else ""
        print(f"  {pair}: {cols}{v['verdict']}" + ("" if r else f" — {v['reason']}"))
    peak = f" ({out['peak_bf16_tflops']:.1f} TFLOP/s, {out['peak_source']})" if out.get("peak_bf16_tflops") else ""
    for name, r in out.get("rates", {}).items():
        mfu = f", {r['mfu_bf16']:.1%} of bf16 peak{peak}" if r["mfu_bf16"] else ""
        print(f"  {name}: steady {r['steady_ms']:.1f} ms, {r['tflops_bf16_equiv']:.1f} bf16-equivalent TFLOP/s{mfu}")
    if out.get("kernels"):
        for name, b in out["kernels"].items():
            print(f"  {name}: {render(b)}")


def main(args) -> int:
    """``python -m harness ab-arms``: every option checked, every arm resolved, before the engine is built."""
    arms = parse_arms(args.arm)
    versus = parse_versus(args.versus, arms)
    if args.rounds < 1 or (args.chunks is not None and args.chunks < 1):
        raise HarnessError("--rounds and --chunks must be ≥ 1")
    if args.launches < 1:
        raise HarnessError("--launches must be ≥ 1")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise HarnessError(f"--peak-tflops must be positive, got {args.peak_tflops}")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise HarnessError(f"--json {args.json}: its folder does not exist")
    base = base_config(args)
    if any(s.partition("=")[0].strip() == "parallel.sp" for s in args.set) and base.parallel.sp != 1:
        raise HarnessError("ab-arms runs one engine on one device (SP = 1): use ab-engine --sp N for SP > 1")
    cfg = override(base, parallel={"sp": 1}, runtime={"device": args.device, "mode": args.mode})
    if cfg.runtime.device == "cuda" and not torch.cuda.is_available():
        raise HarnessError("--device cuda but no CUDA device is visible")
    check_backend(cfg.runtime.attention, cfg.runtime.device)  # the baseline's, e.g. one set with --set
    partial = (lambda rec: write_result(args.json, rec)) if args.json else None
    out = run(cfg, arms, args.rounds, args.chunks or cfg.video.chunks_per_session, args.kernels, args.launches, partial,
              versus)
    if args.json:  # the judged arms are on disk before the rates' FLOP count and peak can fail
        write_result(args.json, {**out, "complete": False})
    add_rates(out, cfg, torch.device("cuda:0" if cfg.runtime.device == "cuda" else "cpu"), args.peak_tflops)
    _print(out)
    if args.json:
        write_result(args.json, {**out, "complete": True})
    sys.stdout.flush()
    return 0 if all(a["gate"]["passed"] for a in out["arms"].values()) else 1
