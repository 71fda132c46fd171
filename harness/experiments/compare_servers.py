"""``compare-servers``: two servers of vLLM-Omni's realtime video API as the arms of an A/B.

Arm A is ``--connect``, arm B ``--connect-b``: two servers, or one server's two configurations
launched side by side. Rounds alternate A B A B …; each launch is one ``client --api vllm-omni``
run (its warm-up session and measured sessions, the same workload and seeds on both arms) written
to ``OUT/round{r}-{A|B}``, so every launch is an ordinary client run directory (``report``,
``gate``). The verdict is ``compare``'s (``experiments.compare.compare_metric``: each launch one
unit, the median of its steady intervals at ``delivered``, the ratio B/A with a launch-level
interval, no verdict under two launches per arm), plus TTFC at ``delivered``. The numeric gate is
the pixel gate between the first round's two runs: a speed verdict is given only when it passes
(two servers that make different videos are not the same work); ``--no-gate`` says the arms are
known to differ in output (e.g. a lossy and a lossless encoder) and judges speed alone, saying so.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import msgspec

from harness.drivers.rundir import write_json
from harness.drivers.runstate import claim_out
from harness.errors import EXIT_FAIL, HarnessError
from harness.experiments.compare import (compare_metric, interval_sessions, load_data, load_meta, metric_rounds,
                                         round_dirs, ttfc_sessions)
from harness.measure.gates import gate
from harness.serving import omni_protocol as O
from harness.serving.client import session_url
from harness.serving.omni_client import REFERENCE, measure, workload


def run_rounds(out: Path, w, url_a: str, url_b: str, rounds: int) -> None:
    for r in range(rounds):
        for arm, url in (("A", url_a), ("B", url_b)):
            run_dir, recs, summary = measure(dataclasses.replace(w, url=url), str(out / f"round{r}-{arm}"))
            if summary.get("status") != "complete":
                raise HarnessError(f"round {r} arm {arm} ({url}) failed: {summary.get('error')}; see {run_dir}")


def analyze(out: Path, use_gate: bool = True) -> dict:
    """The verdict over the round directories under ``out``."""
    metas = [load_meta(p, r, arm) for r, arm, p in round_dirs(out)]
    runs = {arm: [load_data(m) for m in metas if m.arm == arm] for arm in "AB"}
    if not runs["A"] or not runs["B"]:
        raise HarnessError(f"{out} holds no round{{r}}-A and round{{r}}-B client runs")
    g = gate(runs["A"][0].meta.dir, runs["B"][0].meta.dir, "threshold")
    gate_passed = g.passed if use_gate else True
    rows = [compare_metric(f"steady interval P50 @ {REFERENCE}", REFERENCE, metric_rounds(runs["A"], interval_sessions, REFERENCE),
                           metric_rounds(runs["B"], interval_sessions, REFERENCE), gate_passed),
            compare_metric(f"TTFC P50 @ {REFERENCE}", REFERENCE, metric_rounds(runs["A"], ttfc_sessions, REFERENCE),
                           metric_rounds(runs["B"], ttfc_sessions, REFERENCE), gate_passed)]
    return {"arms": {arm: [r.meta.manifest.get("client", {}).get("url") for r in runs[arm]][:1] for arm in "AB"},
            "rounds": len({m.round for m in metas}), "reference": REFERENCE,
            "gate": {"kind": "threshold (pixels)", "passed": g.passed, "verdict": g.verdict, "used": use_gate},
            "verdict": rows[0].verdict, "reason": rows[0].reason, "rows": [msgspec.to_builtins(r) for r in rows]}


def lines(res: dict) -> list[str]:
    out = [f"A: {res['arms']['A'][0]}", f"B: {res['arms']['B'][0]}", f"rounds: {res['rounds']}",
           f"gate (pixels, round 0 A vs B): {res['gate']['verdict']}" + ("" if res["gate"]["used"] else " — not used (--no-gate)")]
    for r in res["rows"]:
        ratio = r["ab"]
        ci = f"{ratio['value']:.3f} [{ratio['low']:.3f}, {ratio['high']:.3f}]" if ratio else "—"
        a, b = ("—" if v is None else f"{v:.1f}" for v in (r["baseline_ms"], r["candidate_ms"]))
        out.append(f"{r['metric']}: A {a} ms, B {b} ms, B/A {ci}: {r['verdict']} ({r['reason']})")
    return out


def main(args) -> int:
    if args.rounds < 1:
        raise HarnessError(f"--rounds must be ≥ 1, got {args.rounds}")
    url_a, url_b = session_url(args.connect, O.PATH), session_url(args.connect_b, O.PATH)
    w = workload(args, url_a)
    if not args.out:
        raise HarnessError("--out DIR is required: every launch is a run directory under it")
    out = Path(args.out)
    claim_out(out, overwrite=False)
    out.mkdir(parents=True, exist_ok=True)
    run_rounds(out, w, url_a, url_b, args.rounds)
    res = analyze(out, use_gate=not args.no_gate)
    write_json(out / "compare.json", res)
    for line in lines(res):
        print(line)
    if not res["gate"]["passed"] and not args.no_gate:
        print("error: the arms' pixels differ beyond the threshold gate; no speed verdict (--no-gate to judge speed alone)",
              file=sys.stderr)
        return EXIT_FAIL
    return 0
