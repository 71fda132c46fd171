"""``verdicts``: every candidate's judgement in one table, from ``compare`` and ``ab-engine`` results.

A candidate is judged by one of two commands — ``compare`` (end to end, a serve launch per arm
per round) or ``ab-engine`` (inside one DiT engine) — and each writes its own JSON. This reads any
number of them and puts the facts a reader weighs side by side: the gate and its outcome, the
statistic and where it was taken, baseline and candidate medians, the ratio with its 95 %
interval, the A/A noise floor, the verdict, and the setting it was measured on (mode, depth,
placement). Nothing is recomputed, but one rule is applied to every result alike
(``stats.one_launch_reason``): a verdict from fewer than 2 launches per arm — an ``ab-engine`` JSON
written before ``--launches``, a one-round ``compare`` — is shown as "no verdict: one launch", with
the recorded verdict beside it; and a result judged by the older session-level interval (launch
variance missing) says so in its interval column.

    python -m harness verdicts runs/compare-H4a runs/ab-engine-H2a.json … [--json F]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import msgspec

from harness.errors import HarnessError
from harness.limits import MAX_JSON_BYTES, read_bounded
from harness.measure.stats import decimals, one_launch_reason


class Verdict(msgspec.Struct, frozen=True):
    candidate: str
    method: str  # "compare" | "ab-engine"
    gate: str  # e.g. "exact pass (70 compared)"
    gate_passed: bool
    statistic: str
    baseline_ms: float | None
    candidate_ms: float | None
    ratio: float | None
    low: float | None
    high: float | None
    noise_floor: float | None
    verdict: str
    setting: str
    source: str
    #: launches per arm the interval was taken over (the fewer of the two arms)
    launches: int = 0
    #: "launch-level t" (schema 2) or "session bootstrap" (older results: launch variance not in it)
    interval: str = "launch-level t"
    #: shift detectable with 80 % power, where the command recorded it
    mde: float | None = None


def apply_launch_rule(v: Verdict) -> Verdict:
    """The same launch rule as every command: fewer than 2 launches per arm is no verdict."""
    if v.verdict.startswith("no verdict") or one_launch_reason(v.launches, v.launches) is None:
        return v
    return msgspec.structs.replace(v, verdict=f"no verdict: one launch (recorded: {v.verdict})")


def _fmt_setting(mode, layers, extra: Iterable[str]) -> str:
    head = [x for x in (mode, f"{layers} layers" if layers is not None else None) if x]
    return ", ".join([*head, *[e for e in extra if e]])


def vae_placement(placement: dict | None) -> str:
    """Whether the VAE ranks share the DiT ranks' GPUs — what decides H5a's outcome."""
    if not placement:
        return ""
    dit = {v for k, v in placement.items() if k.startswith("dit") and str(v).startswith("cuda")}
    vae = {v for k, v in placement.items() if k.startswith("vae") and str(v).startswith("cuda")}
    if not dit or not vae:
        return ""
    return "VAE shares the DiT's GPU" if dit & vae else "VAE on its own GPU"


def from_compare(d: dict, source: str) -> Verdict:
    """``compare.json``: the row at the reference boundary is the verdict's row."""
    ref = d["reference"]
    row = next((r for r in d["rows"] if r["boundary"] == ref and r["metric"].startswith("steady")), None)
    if row is None:
        raise HarnessError(f"{source}: compare result has no steady row at {ref}")
    g, st, proto = d["gate"], d.get("setting") or {}, d.get("protocol") or {}
    measured = (proto.get("sessions") or 0) - (proto.get("warmup_sessions") or 0)
    n = d["rounds_run"]
    sched = [f"SP={st['sp']}" if st.get("sp") else "", vae_placement(st.get("placement")),
             f"{n} round{'s' if n != 1 else ''} × {measured} measured sessions per launch"]
    ab = row.get("ab") or {}
    launches = min(ab["launches"]) if ab.get("launches") else n
    return apply_launch_rule(Verdict(
        candidate="+".join(d["candidate"]), method="compare",
        gate=f"{g['kind']} {g['status']}" + (f" ({g['n_compared']} compared)" if g.get("n_compared") else ""),
        gate_passed=g["status"] != "fail", statistic=row["metric"],
        baseline_ms=row.get("baseline_ms"), candidate_ms=row.get("candidate_ms"),
        ratio=ab.get("value"), low=ab.get("low"), high=ab.get("high"), noise_floor=row.get("noise_floor"),
        verdict=d["verdict"], setting=_fmt_setting(st.get("mode"), st.get("layers"), sched), source=source,
        launches=launches, interval=_interval_kind(d.get("schema", 1)), mde=row.get("mde")))


def _interval_kind(schema: int) -> str:
    return "launch-level t" if schema >= 2 else "session bootstrap"


def from_ab_engine(d: dict, source: str) -> Verdict:
    g, r = d["gate"], d.get("ratio") or d.get("within_launch") or {}
    extra = f", worst rel-L2 {g['worst_rel_l2']:.3g}" if "worst_rel_l2" in g else ""
    return apply_launch_rule(Verdict(
        candidate="+".join(d["candidate"]), method="ab-engine",
        gate=f"{g['kind']} {'pass' if g['passed'] else 'fail'} ({g['compared']} chunks{extra})",
        gate_passed=bool(g["passed"]), statistic=f"steady DiT chunk P50 (chunks ≥ {d['steady_from_chunk']})",
        baseline_ms=d.get("baseline_ms"), candidate_ms=d.get("candidate_ms"),
        ratio=r.get("value"), low=r.get("low"), high=r.get("high"), noise_floor=d.get("noise_floor"),
        verdict=d["verdict"],
        setting=_fmt_setting(d.get("mode"), d.get("layers"), [f"SP={d.get('sp')}", f"{d.get('launches', 1)} launch(es) × "
                             f"{d['pairs']} pairs × {d['chunks']} chunks"]),
        source=source, launches=d.get("launches", 1),
        interval=_interval_kind(2 if "launches" in d else 1) if d.get("ratio") else "within one launch", mde=d.get("mde")))


def _read_json(f: Path):
    try:
        return json.loads(read_bounded(f, MAX_JSON_BYTES, "result file"))
    except (OSError, ValueError) as e:
        raise HarnessError(f"{f}: not readable JSON ({type(e).__name__})") from None


def load(path: str | Path) -> Verdict:
    """A compare directory (its ``compare.json``), a ``compare.json`` or an ``ab-engine --json`` file."""
    p = Path(path)
    f = p / "compare.json" if p.is_dir() else p
    if not f.is_file():
        raise HarnessError(f"{path}: no such file (expected a compare directory, compare.json or ab-engine JSON)")
    d = _read_json(f)
    try:
        if isinstance(d, dict) and {"rows", "gate", "reference"} <= d.keys():
            first = f.parent / "round0-A" / "manifest.json"
            if not d.get("setting") and first.is_file():  # written before compare recorded its setting
                # only for these old files: compare imports torch, which reading JSON never needs
                from harness.experiments.compare import run_setting

                d = {**d, "setting": run_setting(_read_json(first))}
            return from_compare(d, str(f))
        if isinstance(d, dict) and {"pairs", "gate", "steady_from_chunk"} <= d.keys():
            return from_ab_engine(d, str(f))
    except (KeyError, TypeError, AttributeError) as e:
        raise HarnessError(f"{f}: incomplete result ({type(e).__name__}: {e})") from None
    raise HarnessError(f"{f}: neither a compare result nor an ab-engine result")


def _num(x: float | None, fmt: str, unit: str = "") -> str:
    return "—" if x is None else format(x, fmt) + unit


def table(verdicts: list[Verdict]) -> str:
    lines = ["| candidate | method | gate | statistic | baseline | candidate | ratio | interval | launches | A/A floor (older) "
             "| MDE (80 %) | verdict | setting |",
             "|---|---|---|---|---:|---:|---:|---|---:|---|---:|---|---|"]
    for v in verdicts:
        stated = v.low is not None and v.high is not None
        d = decimals(v.high - v.low) if stated else 4  # rounded to the interval's width, as compare prints it
        d_ms = decimals(v.baseline_ms * (v.high - v.low) / v.ratio, most=1) if stated and v.baseline_ms and v.ratio else 1
        interval = f"[{v.low:.{d}f}, {v.high:.{d}f}] ({v.interval})" if stated else \
            ("no verdict: too wide to state" if v.ratio is not None else "—")
        floor = "—" if v.noise_floor is None else f"±{v.noise_floor:.4f}"
        mde = "—" if v.mde is None else f"{100 * v.mde:.2g} %"
        lines.append(f"| {v.candidate} | {v.method} | {v.gate} | {v.statistic} | {_num(v.baseline_ms, f'.{d_ms}f', ' ms')} | "
                     f"{_num(v.candidate_ms, f'.{d_ms}f', ' ms')} | {_num(v.ratio, f'.{d}f')} | {interval} | {v.launches} | "
                     f"{floor} | {mde} | **{v.verdict}** | {v.setting} |")
    lines.append("")
    lines.append("baseline, candidate: geometric means of the launch medians the ratio reads (one launch: of its session "
                 "medians; results written before that: pooled medians), so ratio = candidate / baseline.")
    return "\n".join(lines)


def main(args) -> int:
    vs = [load(p) for p in args.results]
    print(table(vs))
    if args.json:
        try:
            Path(args.json).write_bytes(msgspec.json.encode(vs))
        except OSError as e:
            raise HarnessError(f"{args.json}: cannot write ({e.strerror})") from None
    return 0
