"""Several DiT-engine candidates, each A/B'd against one shared baseline inside one engine.

    python -m harness.experiments.ab_arms --preset lingbot-480x832 --device cuda --mode compiled \\
        --arm fa3=H1b:fa3 --arm h6a=H6a --arm h6c=H6c [--rounds 4] [--chunks 7] [--kernels] [--json F]

``ab-engine`` judges one candidate per launch; at full size each launch pays the model's
initialisation and a compilation warm-up per arm, several minutes before the first measured
chunk. Here the engine is built and the baseline compiled once, and every arm (a '+'-joined
candidate list, e.g. ``H6a+H1b:fa3``) is one more engine state: its runtime switches and DiT
patches applied for its sessions and reverted after, exactly as ``ab-engine`` does for its B arm.

Round r runs one session of the baseline (A) and of every arm, all with seed r, in an order
rotated by r (a slow drift of the machine weighs on every arm alike). Each arm is then judged
with ``ab-engine``'s own functions: the threshold/exact gate over every chunk against the same
round's A session, and the ratio of medians of the steady chunks with its interval and the A/A
floor (``engine_ab.judge``). ``--kernels`` adds one chunk to each arm's last session, profiled for
a per-kernel breakdown and left out of the times and the gate.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from harness import candidates as C
from harness.config import HarnessConfig, override
from harness.engine.groups import RankGroup
from harness.errors import HarnessError
from harness.experiments.bench_engine import (count_steady_flops, dit_engine_for, measure_peak_tflops,
                                              steady_chunk_index, timed_session)
from harness.experiments.compare import gate_kind
from harness.experiments.engine_ab import engine_switches, gate_pairs, judge
from harness.measure import stats as S


def parse_arms(texts: list[str]) -> dict[str, list[str]]:
    """``name=ID[+ID…]`` → {name: [ID, …]}; names unique, "A" reserved for the baseline."""
    arms: dict[str, list[str]] = {}
    for t in texts:
        name, sep, spec = t.partition("=")
        name, specs = name.strip(), [s.strip() for s in spec.split("+") if s.strip()]
        if not sep or not name or not specs:
            raise HarnessError(f"--arm {t!r}: expected NAME=ID[+ID…], e.g. fa3=H1b:fa3")
        if name == "A" or name in arms:
            raise HarnessError(f"--arm name {name!r} is {'reserved for the baseline' if name == 'A' else 'given twice'}")
        arms[name] = specs
    if not arms:
        raise HarnessError("give at least one --arm NAME=ID[+ID…]")
    return arms


def round_order(names: list[str], r: int) -> list[str]:
    """The baseline and every arm, rotated by the round index."""
    k = r % len(names)
    return names[k:] + names[:k]


class _Arm:
    """An arm's engine state: switches set and DiT patches applied for its sessions."""

    def __init__(self, eng, cfg: HarnessConfig, specs: list[str]):
        self.eng, self.specs = eng, specs
        self.switches = engine_switches(specs, cfg) if specs else {}
        self.patches = [(c.patch_dit, arg) for c, arg in C.resolve(specs, cfg) if c.patch_dit is not None]

    def __enter__(self):
        self.base = {k: getattr(self.eng, k) for k in self.switches}
        for k, v in self.switches.items():
            setattr(self.eng, k, v)
        self.reverts = [patch(self.eng, arg) for patch, arg in self.patches]
        return self

    def __exit__(self, *exc) -> None:
        for r in reversed(self.reverts):
            r()
        for k, v in self.base.items():
            setattr(self.eng, k, v)


def run(cfg: HarnessConfig, arms: dict[str, list[str]], rounds: int, chunks: int, kernels: bool = False) -> dict:
    """One engine on one device (SP = 1: ``ab-engine`` covers SP > 1, one candidate per launch)."""
    cfg = override(cfg, parallel={"sp": 1})
    steady = steady_chunk_index(cfg)
    if chunks <= steady:
        raise HarnessError(f"--chunks {chunks}: sessions need more than {steady} chunks for a steady chunk")
    for specs in arms.values():  # every arm refused before the engine is built
        engine_switches(specs, cfg)
    eng, device = dit_engine_for(RankGroup.single(), cfg)
    state = {"A": _Arm(eng, cfg, [])} | {n: _Arm(eng, cfg, s) for n, s in arms.items()}
    actions = (["W", "", "D"] * cfg.video.frames_per_chunk)[: cfg.video.frames_per_chunk]
    keep = lambda lat: lambda x: lat.append(x.float().cpu().numpy().tobytes())  # noqa: E731

    def session(name: str, seed: int, n: int, on_latent=None) -> list[float]:
        with state[name]:
            return timed_session(eng, device, actions, prompt="ab-arms", seed=seed, chunks=n, on_latent=on_latent)

    warm = {}
    if cfg.runtime.mode != "eager":  # compilation and CUDA-graph recording of every arm's graphs
        for name in state:
            warm[name] = session(name, 10_000, min(3, chunks))
    times = {n: [] for n in state}
    lats = {n: [] for n in state}
    order, profiles = [], {}
    names = list(state)
    for r in range(rounds):
        for name in round_order(names, r):
            order.append(name)
            lat: list[bytes] = []
            prof = None
            if kernels and r == rounds - 1 and device.type == "cuda":
                from harness.experiments.kernel_profile import ProfileChunk

                prof = ProfileChunk(skip=chunks)
            cb = keep(lat) if prof is None else (lambda x, k=keep(lat), p=prof: (k(x), p(x)))
            t = session(name, r, chunks + (prof is not None), cb)
            if prof is not None:
                profiles[name] = prof.result
            times[name].append(t[:chunks])
            lats[name].append(lat[:chunks])
            # a killed run still leaves every finished session's times in its log
            print(f"round {r} {name}: " + " ".join(f"{x:.1f}" for x in t[:chunks]), flush=True)
    shape = (16, cfg.video.frames_per_chunk, cfg.video.latent_h, cfg.video.latent_w)
    out = {"preset": cfg.name, "mode": cfg.runtime.mode, "layers": cfg.model.num_layers, "rounds": rounds,
           "chunks": chunks, "steady_from_chunk": steady, "order": " ".join(order), "warmup_chunk_ms": warm,
           "compile": eng.compile_stats(), "chunk_ms": times, "kernels": profiles, "arms": {}}
    for name, specs in arms.items():
        kind = gate_kind([c.gate for c, _ in C.resolve(specs, cfg)])
        gate = gate_pairs(kind, lats["A"], lats[name], shape)
        res = {"candidates": specs, "switches": state[name].switches, "gate": gate}
        if gate["passed"]:
            res.update(judge(times["A"], times[name], steady, True))
        else:
            res.update(verdict="no verdict", reason=f"{kind} gate failed: {', '.join(gate['failed'][:3])}")
        out["arms"][name] = res
    return out


def add_rates(out: dict, cfg: HarnessConfig, device: torch.device) -> None:
    """bf16-equivalent TFLOP/s and MFU of each arm's steady P50 (gate passed or not) (the baseline's FLOP count: an
    FP8 arm does the same arithmetic in cheaper units, so its rate may pass the bf16 peak)."""
    flops = count_steady_flops(cfg)["dit_flops"]
    peak = measure_peak_tflops(device, torch.bfloat16) if device.type == "cuda" else None
    out["dit_flops"], out["peak_bf16_tflops"] = flops, peak
    st = out["steady_from_chunk"]
    rows = {n: S.nearest_rank([x for s in t for x in s[st:]], 50) for n, t in out["chunk_ms"].items()}
    out["rates"] = {n: {"steady_ms": ms, "tflops_bf16_equiv": flops / (ms / 1e3) / 1e12,
                        "mfu_bf16": flops / (ms / 1e3) / 1e12 / peak if peak else None}
                    for n, ms in rows.items() if ms}


def _print(out: dict) -> None:
    print(f"ab-arms on {out['preset']} ({out['mode']}, {out['layers']} layers), {out['rounds']} rounds × "
          f"{out['chunks']} chunks, order {out['order']}")
    for name, a in out["arms"].items():
        g = a["gate"]
        line = f"  {name} ({'+'.join(a['candidates'])}): gate {g['kind']} {'pass' if g['passed'] else 'FAIL'}"
        line += f", worst rel-L2 {g['worst_rel_l2']:.4g}" if "worst_rel_l2" in g else ""
        if "ratio" in a:
            r = a["ratio"]
            line += (f"; {a['baseline_ms']:.1f} → {a['candidate_ms']:.1f} ms, ratio {r['value']:.4f} "
                     f"[{r['low']:.4f}, {r['high']:.4f}]")
        print(line + f"; {a['verdict']}")
    for name, r in out.get("rates", {}).items():
        mfu = f", {r['mfu_bf16']:.1%} of bf16 peak" if r["mfu_bf16"] else ""
        print(f"  {name}: steady {r['steady_ms']:.1f} ms, {r['tflops_bf16_equiv']:.1f} bf16-equivalent TFLOP/s{mfu}")
    if out.get("kernels"):
        from harness.measure.kernels import render

        for name, b in out["kernels"].items():
            print(f"  {name}: {render(b)}")


def main(argv: list[str] | None = None) -> int:
    from harness.cli import add_set_option, base_config

    p = argparse.ArgumentParser(prog="python -m harness.experiments.ab_arms", description=__doc__.splitlines()[0])
    p.add_argument("--arm", action="append", default=[], metavar="NAME=ID[+ID…]")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--config")
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--mode", choices=["eager", "compiled", "deterministic"])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--chunks", type=int)
    p.add_argument("--kernels", action="store_true")
    add_set_option(p)
    p.add_argument("--json")
    args = p.parse_args(argv)
    try:
        arms = parse_arms(args.arm)
        if args.rounds < 1 or (args.chunks is not None and args.chunks < 1):
            raise HarnessError("--rounds and --chunks must be ≥ 1")
        cfg = override(base_config(args), parallel={"sp": 1}, runtime={"device": args.device, "mode": args.mode})
        if cfg.runtime.device == "cuda" and not torch.cuda.is_available():
            raise HarnessError("--device cuda but no CUDA device is visible")
        out = run(cfg, arms, args.rounds, args.chunks or cfg.video.chunks_per_session, args.kernels)
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    add_rates(out, cfg, torch.device("cuda:0" if cfg.runtime.device == "cuda" else "cpu"))
    _print(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    sys.stdout.flush()
    return 0 if all(a["gate"]["passed"] for a in out["arms"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
