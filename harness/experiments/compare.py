"""``compare``: interleaved A/B of a candidate against a baseline (DESIGN §4 A/B protocol, §5 gates).

Arm A runs the baseline candidates, arm B the baseline plus the candidate(s) under test. Rounds
alternate A B A B …, one serve launch per round per arm, each launch a timing protocol (1 warm-up
+ the measured sessions of ``--sessions``), into ``OUT/round{r}-{A|B}/``. Alternating launches
rather than running all A then all B keeps slow drift of the machine (thermal, neighbours) from
masquerading as a difference between the arms.

Judgement, in this order:

1. **Comparable**: every run complete, same hooks, same steady window, and configs that differ
   only by what the candidate changes (B's config = the candidate's ``configure`` applied to A's);
   anything else is refused with one line.
2. **Numeric gate**: the candidate's declared gate (``exact`` or ``threshold``; the strictest
   kind that covers every candidate under test) on round 0, B against A. A failure stops the
   comparison after round 0: no speed is ever claimed for a wrong answer. A serving-gate
   candidate is judged by its own scenarios; here its gate is recorded as skipped.
3. **Speed**, per boundary (cpu_ready, encoded, delivered) and for TTFC, by ``stats.judge_ab``:
   every launch (round × arm) is one unit, the median of its pooled steady intervals; the ratio
   candidate/baseline and its Welch t interval over launches carry launch-to-launch variance
   (process placement, allocator state). One round is one launch per arm: no verdict. Faster /
   slower when the whole interval is below / above 1, equivalent when it lies within 1 ± margin.
   The baseline's even vs odd rounds give an A/A interval (≥ 4 rounds): a check for drift, not a floor.

With ``--until-resolved`` rounds continue until the verdict at cpu_ready is faster, slower or
equivalent, or ``--max-rounds`` is reached; each look (after round 2, 3, …) takes its interval at
the level an alpha-spending plan gives it (``stats.spending_levels``), so the chance of a false
faster/slower over all looks is about 5 %. An interval too wide to state (the early looks of a long
plan) is a "no verdict" the loop looks past. The rounds a 5 % shift needs at 80 % power are printed
before the first launch (from ``stats.PRIOR_LAUNCH_SD``) and at the first look (from the launches
measured); the minimum detectable effect (80 % power) at the first look, for the whole budget, and
at the end, for the rounds run. ``--reanalyze`` replays a sequential plan through the same ``look``.
Tables (``compare_report``) print the geometric means of the units beside their ratio.

Outputs: ``OUT/compare.json`` (``CompareResult``) and ``OUT/compare.md``.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import time
from pathlib import Path
from typing import Callable, Sequence

import msgspec

from harness.candidates import configure, get, resolve, split_id
from harness.config import HarnessConfig, to_dict, upgrade_recorded
from harness.drivers.config_options import resolve_config
from harness.drivers.rundir import REPO_ROOT
from harness.drivers.runstate import refuse_unfinished
from harness.drivers.serve_run import ServeOptions, serve
from harness.errors import EXIT_FAIL, HarnessError
from harness.experiments.compare_report import gate_line, pct_text, summary_lines, write_outputs
from harness.experiments.serve import protocol_for, serve_options
from harness.hooks import HookSet, parse_hooks
from harness.limits import MAX_JSON_BYTES, read_bounded
from harness.measure import metrics as M
from harness.measure import stats as S
from harness.measure.events import ChunkEvent, SessionStart, read_run
from harness.measure.gates import gate
from harness.measure.setting import run_setting as setting_of_run

SCHEMA = 2
BOUNDARIES: tuple[str, ...] = ("cpu_ready", "encoded", "delivered")
REFERENCE = "cpu_ready"
TTFC_BOUNDARY = "delivered"
DEFAULT_ROUNDS = 3
_ROUND_RE = re.compile(r"^round(\d+)-([AB])$")


# ---- records -------------------------------------------------------------------------------


class RunRef(msgspec.Struct, frozen=True):
    round: int
    arm: str
    dir: str
    candidates: list[str]
    status: str


class GateRecord(msgspec.Struct, frozen=True):
    #: "exact" | "threshold" | "serving"
    kind: str
    #: "pass" | "fail" | "skipped"
    status: str
    verdict: str
    reference_mode: str
    run_a: str | None = None
    run_b: str | None = None
    n_compared: int = 0
    n_failed: int = 0

    @property
    def passed_for_speed(self) -> bool | None:
        """What the speed verdict may assume: a skipped (serving) gate does not block it."""
        return {"pass": True, "fail": False, "skipped": True}.get(self.status)


class Ratio(msgspec.Struct, frozen=True):
    value: float
    #: None when the interval is too wide to state (``stats.WIDEST_FACTOR``)
    low: float | None
    high: float | None
    n_sessions: int
    n_samples: int
    #: launches per arm (baseline, candidate) the interval was taken over; its confidence and df
    launches: tuple[int, int] = (0, 0)
    confidence: float = S.DEFAULT_CONFIDENCE
    df: float | None = None
    #: spread (sd, log scale) of the launch units of A and B: what the budget's MDE is projected from
    sd_log: tuple[float, float] | None = None


class Row(msgspec.Struct, frozen=True):
    metric: str
    boundary: str
    #: geometric means of the units the ratio reads (launch medians; one launch: session medians),
    #: so candidate_ms / baseline_ms is the ratio (schema 2 before this: pooled medians)
    baseline_ms: float | None
    candidate_ms: float | None
    ab: Ratio | None
    aa: Ratio | None
    #: the A/B floor of schema 1; always None since the launch-level interval (schema 2)
    noise_floor: float | None
    #: True/False only when a verdict was allowed (gate passed and ≥ 2 launches per arm)
    significant: bool | None
    verdict: str
    reason: str
    baseline_samples: int
    candidate_samples: int
    #: relative shift this row's data detects with 80 % power at its look's level
    mde: float | None = None
    #: one launch per arm: the within-launch (session-level) interval, descriptive only
    within_launch: Ratio | None = None
    #: a "no verdict" that more rounds can change (one launch, an interval too wide to state)
    pending: bool = False


class CompareResult(msgspec.Struct, frozen=True):
    schema: int
    candidate: list[str]
    baseline: list[str]
    rounds_requested: int
    rounds_run: int
    order: str
    protocol: dict
    runs: list[RunRef]
    gate: GateRecord
    #: how the verdict is taken (``VERDICT_METHOD``)
    method: str
    reference: str
    verdict: str
    reason: str
    rows: list[Row]
    #: the interval's kind, the nominal level of the look it was taken at, the equivalence margin
    interval: dict
    stopped_early: str | None = None
    #: what was compared on: preset, mode, DiT depth, SP/VAE ranks, device, placement (round 0 A)
    setting: dict = msgspec.field(default_factory=dict)
    #: --until-resolved: the plan (max rounds, margin, looks and their levels) and how it ended
    sequential: dict | None = None
    #: the setting line (``measure.setting``) of each arm's first launch, by arm: what compare.md prints
    setting_lines: dict[str, str] = msgspec.field(default_factory=dict)


def run_setting(manifest: dict) -> dict:
    """The few facts a reader of a verdict needs to weigh it, from a run's manifest."""
    cfg = manifest.get("config", {})
    par, model, rt = cfg.get("parallel", {}), cfg.get("model", {}), cfg.get("runtime", {})
    return {"preset": manifest.get("preset"), "mode": manifest.get("mode"), "layers": model.get("num_layers"),
            "sp": par.get("sp"), "vae_ranks": par.get("vae_ranks"), "device": rt.get("device"),
            "placement": manifest.get("placement")}


# ---- reading and checking runs -------------------------------------------------------------


class RunMeta(msgspec.Struct, frozen=True):
    round: int
    arm: str
    dir: str
    manifest: dict
    summary: dict

    @property
    def candidates(self) -> list[str]:
        return list(self.manifest.get("candidates", []))

    @property
    def hooks(self) -> list[str]:
        return sorted(self.summary.get("hooks", self.manifest.get("hooks", [])))

    @property
    def window(self) -> M.Window:
        w = self.summary["window"]
        return M.Window(first_chunk=w["first_chunk"], last_chunk=w["last_chunk"], warmup_epochs=w["warmup_epochs"])


def _read_json(path: Path) -> dict:
    try:
        return msgspec.json.decode(read_bounded(path, MAX_JSON_BYTES, "run record"))
    except FileNotFoundError:
        raise HarnessError(f"{path} is missing: not a finished run directory") from None
    except (OSError, msgspec.DecodeError) as e:
        raise HarnessError(f"{path} is unreadable: {e}") from None


def load_meta(run_dir: Path, round_: int, arm: str) -> RunMeta:
    refuse_unfinished(run_dir)  # a summary beside a manifest still saying running is not a finished run
    man = _read_json(run_dir / "manifest.json")
    if isinstance(man.get("config"), dict):  # a manifest from before a config rename reads as today's
        man["config"] = upgrade_recorded(man["config"])
    return RunMeta(round_, arm, os.fspath(run_dir), man, _read_json(run_dir / "summary.json"))


def flatten(d: dict, prefix: str = "") -> dict[str, object]:
    """Nested dict → {"runtime.scheduler": …}; lists stay whole (a changed list is one difference)."""
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_diff(a: dict, b: dict) -> list[str]:
    """Dotted paths whose values differ between two config dicts (absent on one side counts)."""
    fa, fb = flatten(a), flatten(b)
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k, _MISSING) != fb.get(k, _MISSING))


_MISSING = object()


def expected_candidate_config(a_config: dict, candidate: Sequence[str]) -> dict:
    """A's config with the candidate's configuration part applied: what B's must be."""
    try:
        cfg = msgspec.convert(a_config, HarnessConfig)
    except msgspec.ValidationError as e:
        raise HarnessError(f"baseline manifest config is not a valid config: {e}") from None
    # through JSON, so tuples compare equal to the lists a manifest holds
    return msgspec.json.decode(msgspec.json.encode(to_dict(configure(tuple(candidate), cfg))))


def candidate_of(a: RunMeta, b: RunMeta) -> list[str]:
    """The specs B runs on top of A's (A's must be a prefix-free subset of B's)."""
    missing = [c for c in a.candidates if c not in b.candidates]
    if missing:
        raise HarnessError(f"run {b.dir} lacks baseline candidate(s) {', '.join(missing)} of {a.dir}")
    extra = [c for c in b.candidates if c not in a.candidates]
    if not extra:
        raise HarnessError(f"runs {a.dir} and {b.dir} apply the same candidates: nothing to compare")
    return extra


def _describe(paths: list[str], a: dict, b: dict, limit: int = 3) -> str:
    fa, fb = flatten(a), flatten(b)
    parts = [f"{p} ({fa.get(p, '—')!r} vs {fb.get(p, '—')!r})" for p in paths[:limit]]
    return ", ".join(parts) + (f" (+{len(paths) - limit} more)" if len(paths) > limit else "")


def check_comparable(runs_a: Sequence[RunMeta], runs_b: Sequence[RunMeta]) -> list[str]:
    """Refuse (HarnessError, one line) anything but a clean A/B; returns the candidate specs under test."""
    if not runs_a or not runs_b:
        raise HarnessError("a comparison needs at least one baseline (A) and one candidate (B) run")
    every = list(runs_a) + list(runs_b)
    for r in every:
        status = r.summary.get("status", r.manifest.get("status"))
        if status != "complete":
            raise HarnessError(f"run {r.dir} did not complete (status {status}); refusing to compare it")
    hooks = {tuple(r.hooks) for r in every}
    if len(hooks) > 1:
        by = sorted({(tuple(r.hooks), r.dir) for r in every})
        first, other = by[0], next(x for x in by if x[0] != by[0][0])
        raise HarnessError(f"runs differ in hooks ({first[1]}: {list(first[0]) or 'none'} vs {other[1]}: "
                           f"{list(other[0]) or 'none'}); hooks change timing, compare runs with the same hooks")
    windows = {(r.window.first_chunk, r.window.last_chunk, r.window.warmup_epochs) for r in every}
    if len(windows) > 1:
        raise HarnessError(f"runs differ in steady window {sorted(windows)}; refusing to pool them")
    a0, b0 = runs_a[0], runs_b[0]
    for arm, runs in (("A", runs_a), ("B", runs_b)):
        ref = runs[0]
        for r in runs[1:]:
            if r.candidates != ref.candidates:
                raise HarnessError(f"arm {arm} runs differ in candidates ({ref.dir}: {ref.candidates} vs {r.dir}: {r.candidates})")
            diff = config_diff(ref.manifest["config"], r.manifest["config"])
            if diff:
                raise HarnessError(f"arm {arm} runs differ in config: {_describe(diff, ref.manifest['config'], r.manifest['config'])}")
    cand = candidate_of(a0, b0)
    want = expected_candidate_config(a0.manifest["config"], cand)
    beyond = config_diff(want, b0.manifest["config"])
    if beyond:
        raise HarnessError(f"config of {b0.dir} differs from {a0.dir} beyond what {', '.join(cand)} changes: "
                           f"{_describe(beyond, want, b0.manifest['config'])}")
    if not config_diff(a0.manifest["config"], want) and not _patches_engine(cand):
        raise HarnessError(f"candidate {', '.join(cand)} changes nothing on this config (already applied by the "
                           f"options?); A and B would be the same run")
    return cand


def _patches_engine(specs: Sequence[str]) -> bool:
    return any(c.patch_dit or c.patch_vae or c.patch_output for c in (get(split_id(s)[0]) for s in specs))


# ---- the gate ------------------------------------------------------------------------------


def gate_kind(kinds: Sequence[str]) -> str:
    """The gate that covers every candidate under test: exact unless one of them allows a
    threshold; "serving" when none of them has a numeric gate."""
    numeric = {k for k in kinds if k != "serving"}
    if not numeric:
        return "serving"
    return "threshold" if "threshold" in numeric else "exact"


def run_gate(a: RunMeta, b: RunMeta, candidate: Sequence[str]) -> GateRecord:
    cands = [get(split_id(s)[0]) for s in candidate]
    kind = gate_kind([c.gate for c in cands])
    mode = a.manifest.get("mode", "?")
    refs = sorted({c.reference for c in cands})
    note = ""
    if "deterministic" in refs and mode != "deterministic":
        note = f" (candidate's reference mode is deterministic; these runs are {mode})"
    if kind == "serving":
        return GateRecord("serving", "skipped", "skipped: a serving-gate candidate is judged by its scenarios, not by outputs",
                          "/".join(refs), a.dir, b.dir)
    g = gate(a.dir, b.dir, kind)
    return GateRecord(kind, "pass" if g.passed else "fail", g.verdict + note, "/".join(refs), a.dir, b.dir, g.n_compared, g.n_failed)


#: Modes whose outputs repeat bit for bit from one launch to the next (DESIGN §5); compiled
#: kernels (autotuning, cuBLAS workspaces) may differ between launches.
REPEATABLE_MODES = ("eager", "deterministic")


def refuse_unrepeatable_exact(candidate: Sequence[str], mode: str) -> None:
    """An exact gate compares two launches byte for byte, which only a repeatable mode can pass;
    refused before any GPU time is spent (a compiled run of H4a failed 80 of 80 files on this)."""
    kind = gate_kind([get(split_id(s)[0]).gate for s in candidate])
    if kind == "exact" and mode not in REPEATABLE_MODES:
        raise HarnessError(f"{', '.join(candidate)} must pass an exact gate, but --mode {mode} is not bit-identical "
                           f"across launches; use --mode deterministic (compiled, repeatable) or eager")


# ---- timing --------------------------------------------------------------------------------

#: per round, per session, the samples (ns) of one figure
Rounds = list[list[list[int]]]


def interval_sessions(events: Sequence[ChunkEvent], sessions: Sequence[SessionStart], boundary: str, window: M.Window) -> list[list[int]]:
    if boundary not in M.boundaries_seen(events):
        return []
    return M.steady_intervals(events, boundary, window, sessions).per_session()


def ttfc_sessions(events: Sequence[ChunkEvent], sessions: Sequence[SessionStart], boundary: str, window: M.Window) -> list[list[int]]:
    """TTFC as one-sample sessions, so the same session bootstrap applies."""
    if not sessions or boundary not in M.boundaries_seen(events):
        return []
    values = M.ttfc(events, sessions, boundary, window).values
    return [[int(values[k])] for k in sorted(values, key=lambda k: (k[1], k[0]))]


def pooled(rounds: Rounds) -> list[list[int]]:
    return [s for r in rounds for s in r if s]


VERDICT_METHOD = ("each launch (round × arm) one unit: the median of its pooled steady intervals; ratio = "
                  "exp(mean log unit B − mean log unit A), Welch t interval over launches (launch-to-launch "
                  "variance included); no verdict with < 2 launches per arm; A/A = baseline even vs odd rounds, a check")


def _ratio(e: S.Interval, n_sessions: int, n_samples: int) -> Ratio:
    return Ratio(e.value, e.low, e.high, n_sessions, n_samples, (e.n_a, e.n_b), e.confidence, e.df, (e.sd_a, e.sd_b))


def compare_metric(metric: str, boundary: str, base: Rounds, cand: Rounds, gate_passed: bool | None,
                   level: float = S.DEFAULT_ALPHA, margin: float = S.DEFAULT_MARGIN) -> Row:
    b, c = pooled(base), pooled(cand)
    nb, nc = sum(map(len, b)), sum(map(len, c))
    if not b or not c:
        side = "baseline" if not b else "candidate"
        return Row(metric, boundary, None, None, None, None, None, None, "no verdict", f"no {side} samples", nb, nc)
    v = S.judge_ab(base, cand, gate_passed=gate_passed, level=level, margin=margin)
    n = len(b) + len(c)
    significant = None if v.verdict == "no verdict" else v.verdict in ("faster", "slower")
    shown = v.ab or v.within_launch  # the columns come from the units the ratio reads
    return Row(
        metric, boundary, _ms(shown.center_a if shown else None), _ms(shown.center_b if shown else None),
        _ratio(v.ab, n, nb + nc) if v.ab else None, _ratio(v.aa, len(b), nb) if v.aa else None, None, significant,
        v.verdict, v.reason, nb, nc, v.mde, _ratio(v.within_launch, n, nb + nc) if v.within_launch else None,
        not v.final,
    )


def _ms(ns: float | None) -> float | None:
    return None if ns is None else ns / 1e6


class RunData(msgspec.Struct, frozen=True):
    meta: RunMeta
    events: list[ChunkEvent]
    sessions: list[SessionStart]


def load_data(meta: RunMeta) -> RunData:
    events, sessions = read_run(meta.dir, tolerate_partial_tail=True)
    return RunData(meta, events, sessions)


def metric_rounds(runs: Sequence[RunData], fn: Callable, boundary: str) -> Rounds:
    return [fn(r.events, r.sessions, boundary, r.meta.window) for r in runs]


def timing_rows(runs_a: Sequence[RunData], runs_b: Sequence[RunData], gate_passed: bool | None, **judge) -> list[Row]:
    rows = [
        compare_metric(f"steady interval P50 @ {b}", b, metric_rounds(runs_a, interval_sessions, b),
                       metric_rounds(runs_b, interval_sessions, b), gate_passed, **judge)
        for b in BOUNDARIES
    ]
    rows.append(compare_metric(f"TTFC P50 @ {TTFC_BOUNDARY}", TTFC_BOUNDARY, metric_rounds(runs_a, ttfc_sessions, TTFC_BOUNDARY),
                               metric_rounds(runs_b, ttfc_sessions, TTFC_BOUNDARY), gate_passed, **judge))
    return rows


# ---- analysis of a comparison directory ----------------------------------------------------


def round_dirs(out: Path) -> list[tuple[int, str, Path]]:
    """(round, arm, dir) of every ``round{r}-{A|B}`` directory under ``out``, in run order."""
    found = []
    for p in out.iterdir() if out.is_dir() else ():
        m = _ROUND_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), m.group(2), p))
    return sorted(found, key=lambda t: (t[0], t[1]))


class Plan(msgspec.Struct, frozen=True):
    """How many looks the verdict is taken at: one, after ``max_rounds`` (``--rounds``), or one
    after every round from the second (``--until-resolved``); each look's level follows."""

    max_rounds: int
    sequential: bool = False
    margin: float = S.DEFAULT_MARGIN
    alpha: float = S.DEFAULT_ALPHA

    @property
    def looks(self) -> tuple[int, ...]:
        return S.sequential_looks(self.max_rounds) if self.sequential else (self.max_rounds,)

    def level(self, rounds: int) -> float:
        """Nominal two-sided level of the look after ``rounds`` rounds (α when it is no planned look)."""
        looks = self.looks
        return S.spending_levels(looks, self.alpha)[looks.index(rounds)] if rounds in looks else self.alpha

    def mde_for_budget(self, row: Row, rounds: int) -> float | None:
        """The shift the whole budget (``max_rounds`` launches per arm, the last look's level) detects
        with 80 % power, if the launches keep the spread seen after ``rounds``."""
        if row.ab is None or row.ab.sd_log is None or rounds < S.MIN_LAUNCHES:
            return None
        return S.min_detectable(*row.ab.sd_log, self.max_rounds, self.max_rounds, self.level(self.max_rounds))

    def record(self) -> dict:
        return {"max_rounds": self.max_rounds, "margin": self.margin, "alpha": self.alpha, "looks": list(self.looks),
                "levels": list(S.spending_levels(self.looks, self.alpha))}


def analyze(
    runs_a: Sequence[RunMeta],
    runs_b: Sequence[RunMeta],
    *,
    rounds_requested: int,
    gate_record: GateRecord | None = None,
    stopped_early: str | None = None,
    plan: Plan | None = None,
    sequential: dict | None = None,
) -> CompareResult:
    cand = check_comparable(runs_a, runs_b)
    g = gate_record or run_gate(runs_a[0], runs_b[0], cand)
    plan = plan or Plan(rounds_requested)
    rounds_run = len({r.round for r in runs_b})
    data_a, data_b = [load_data(r) for r in runs_a], [load_data(r) for r in runs_b]
    rows = timing_rows(data_a, data_b, g.passed_for_speed, level=plan.level(rounds_run), margin=plan.margin)
    head = head_row(rows)
    reason = head.reason
    if g.status == "skipped":
        reason += "; gate: " + g.verdict
    a0 = runs_a[0]
    proto = {k: v for k, v in a0.manifest.get("protocol", {}).items() if k != "ab"}  # "ab" names one launch only
    refs = sorted([*runs_a, *runs_b], key=lambda r: (r.round, r.arm))
    return CompareResult(
        schema=SCHEMA,
        candidate=cand,
        baseline=a0.candidates,
        rounds_requested=rounds_requested,
        rounds_run=rounds_run,
        order=" ".join(f"{r.arm}{r.round}" for r in refs),
        protocol=proto,
        runs=[RunRef(r.round, r.arm, r.dir, r.candidates, r.summary.get("status", "?")) for r in refs],
        gate=g,
        method=VERDICT_METHOD,
        reference=REFERENCE,
        verdict=head.verdict,
        reason=reason,
        rows=rows,
        interval={"kind": "launch-level t", "level": plan.level(rounds_run), "margin": plan.margin},
        stopped_early=stopped_early,
        setting=run_setting(a0.manifest),
        sequential=sequential,
        setting_lines={r.arm: setting_of_run(r.dir, r.manifest) for r in (a0, runs_b[0])},
    )


def head_row(rows: Sequence[Row]) -> Row:
    return next(r for r in rows if r.boundary == REFERENCE and r.metric.startswith("steady"))


def reanalyze(out: Path, plan: Plan | None = None, log: Callable[[str], None] = lambda line: None) -> CompareResult:
    """Judge the round directories already under ``out`` (no serving). A sequential plan — the one
    ``compare.json`` records, else ``plan`` (``--until-resolved``) — is replayed look by look, as
    the loop took them: the result is that of the look the loop stops at."""
    dirs = round_dirs(out)
    if not dirs:
        raise HarnessError(f"{out} holds no round{{r}}-A / round{{r}}-B run directories")
    metas = [load_meta(p, r, arm) for r, arm, p in dirs]
    runs_a = [m for m in metas if m.arm == "A"]
    runs_b = [m for m in metas if m.arm == "B"]
    rounds = len({m.round for m in metas})
    seq = None
    if (out / "compare.json").is_file():  # judge at the level of the look the comparison stopped at
        seq = _read_json(out / "compare.json").get("sequential")
    if seq:
        recorded = Plan(seq["max_rounds"], True, seq["margin"], seq.get("alpha", S.DEFAULT_ALPHA))
        if plan is not None and plan != recorded:
            raise HarnessError(f"{out} records a sequential plan of {recorded.max_rounds} rounds (margin {recorded.margin:g}); "
                               f"reanalyze it without --until-resolved/--max-rounds/--margin, or with the same ones")
        plan = recorded
    if plan is None or not plan.sequential:
        return analyze(runs_a, runs_b, rounds_requested=rounds)
    if rounds > plan.max_rounds:
        raise HarnessError(f"{out} holds {rounds} rounds, more than the plan's {plan.max_rounds}")
    gate_rec = run_gate(runs_a[0], runs_b[0], check_comparable(runs_a, runs_b))
    seq, ends = plan.record(), rounds
    if gate_rec.status != "fail":
        ends = next((n for n in plan.looks if n <= rounds
                     and look(first_rounds(runs_a, n), first_rounds(runs_b, n), plan, gate_rec, seq, log)), rounds)
    stopped = None
    if ends < rounds:
        stopped = f"rounds {ends}–{rounds - 1} on disk are past the look the loop stops at"
    return finish_sequential(first_rounds(runs_a, ends), first_rounds(runs_b, ends), plan, gate_rec, stopped, seq)


def first_rounds(runs: Sequence[RunMeta], n: int) -> list[RunMeta]:
    return [r for r in runs if r.round < n]


def finish_sequential(runs_a: Sequence[RunMeta], runs_b: Sequence[RunMeta], plan: Plan, gate_rec: GateRecord | None,
                      stopped: str | None, seq: dict) -> CompareResult:
    """The result of a sequential comparison whose looks ``seq`` has recorded, over the rounds it ran."""
    n = len({r.round for r in runs_b})
    if "outcome" in seq and n < plan.max_rounds:
        head = f"resolved after {n} rounds: {seq['outcome'].split(' after ')[0]}"
        stopped = head + (f" ({stopped})" if stopped else "")
    elif "outcome" not in seq and n == plan.max_rounds:
        seq["outcome"] = f"unresolved at the maximum of {plan.max_rounds} rounds"
    elif "outcome" not in seq and gate_rec is not None and gate_rec.status != "fail":
        seq["outcome"] = f"unresolved after {n} of {plan.max_rounds} rounds"  # a replay of a comparison cut short
    res = analyze(runs_a, runs_b, rounds_requested=plan.max_rounds, gate_record=gate_rec, stopped_early=stopped,
                  plan=plan, sequential=seq)
    seq.setdefault("outcome", res.verdict)
    seq["mde_after"] = head_row(res.rows).mde
    seq["rounds"] = res.rounds_run
    return res


def look(runs_a: Sequence[RunMeta], runs_b: Sequence[RunMeta], plan: Plan, gate_rec: GateRecord, seq: dict,
         log: Callable[[str], None]) -> bool:
    """One look of the sequential plan, logged; True when the loop stops at it: at faster, slower
    or equivalent, or at a "no verdict" that no further round can change (no samples)."""
    n = len(runs_b)
    head = head_row(analyze(runs_a, runs_b, rounds_requested=plan.max_rounds, gate_record=gate_rec, plan=plan).rows)
    log(f"look after {n} rounds: {head.verdict} at level {plan.level(n):.3g} — {head.reason}")
    if n == plan.looks[0]:
        seq["mde_before"] = plan.mde_for_budget(head, n)
        log(f"minimum detectable effect (80 % power) with all {plan.max_rounds} rounds, from the spread so far: "
            f"{pct_text(seq['mde_before'])}")
        if head.ab is not None and head.ab.sd_log is not None:
            log(needed_line(plan, *head.ab.sd_log, "on the launch spread measured in these rounds"))
    if head.verdict in DECISIVE or (head.verdict == "no verdict" and not head.pending):
        seq["outcome"] = f"{head.verdict} after {n} rounds"
        return True
    return False


def needed_line(plan: Plan, sd_a: float, sd_b: float, source: str) -> str:
    """The rounds a TARGET_SHIFT needs at 80 % power, against the budget: said before a comparison
    starts (from the prior) and again at the first look (from the launches measured)."""
    n = S.rounds_needed(sd_a, sd_b, sequential=plan.sequential, budget=plan.max_rounds)
    shift, budget = f"{100 * S.TARGET_SHIFT:g} %", plan.max_rounds
    spread = f"launch spread {100 * sd_a:.2g} % (A), {100 * sd_b:.2g} % (B) {source}"
    if n is None:
        return f"a {shift} shift needs more than 64 rounds at 80 % power at {spread}: beyond the budget of {budget} rounds"
    fits = "within" if n <= budget else "beyond"
    return f"a {shift} shift needs {n} rounds at 80 % power at {spread}: {fits} the budget of {budget} rounds"


# ---- rendering -----------------------------------------------------------------------------


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


# ---- running -------------------------------------------------------------------------------


def default_out(candidate: Sequence[str]) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    tag = "+".join(s.replace(":", "-") for s in candidate)
    return REPO_ROOT / "runs" / f"{stamp}-compare-{tag}-{os.getpid()}"


DECISIVE = ("faster", "slower", "equivalent")


def check_plan(rounds: int | None, until_resolved: bool, max_rounds: int | None, margin: float) -> Plan:
    """The plan of looks, refused in one line when it cannot work; ``None`` takes the default. A
    fixed comparison takes ``--rounds``, a sequential one ``--max-rounds``: given the other's
    option, it would be silently ignored, so it is refused."""
    if not 0 < margin < 1:
        raise HarnessError(f"--margin must be in (0, 1) (0.02 = ±2 %), got {margin}")
    if until_resolved:
        if rounds is not None:
            raise HarnessError("--rounds and --until-resolved exclude each other: a sequential comparison's budget is --max-rounds")
        max_rounds = S.DEFAULT_MAX_ROUNDS if max_rounds is None else max_rounds
        if max_rounds < S.MIN_LAUNCHES:
            raise HarnessError(f"--max-rounds must be ≥ {S.MIN_LAUNCHES} (a verdict needs {S.MIN_LAUNCHES} launches per arm), got {max_rounds}")
        return Plan(max_rounds, True, margin)
    if max_rounds is not None:
        raise HarnessError("--max-rounds is the budget of --until-resolved; a fixed comparison takes --rounds")
    rounds = DEFAULT_ROUNDS if rounds is None else rounds
    if rounds < 1:
        raise HarnessError(f"--rounds must be ≥ 1, got {rounds}")
    return Plan(rounds, False, margin)


def budget_line(plan: Plan) -> str:
    """What a sequential comparison may cost and how strict its looks are, said before it starts."""
    lv = S.spending_levels(plan.looks, plan.alpha)
    return (f"until resolved: at most {plan.max_rounds} rounds ({2 * plan.max_rounds} launches); looks after rounds "
            f"{plan.looks[0]}–{plan.looks[-1]} at nominal levels {lv[0]:.2g} … {lv[-1]:.3g} (overall false faster/slower "
            f"≈ {plan.alpha:g}: the boundaries are a normal statistic's, applied to t intervals); stops at faster, slower or equivalent (within 1 ± {plan.margin:g})")


def _launch_round(cfg, out: Path, r: int, specs_by_arm, hooks, progress, proto, log) -> dict[str, RunMeta]:
    metas = {}
    for arm, specs in specs_by_arm:
        d = out / f"round{r}-{arm}"
        opts = serve_options(proto, ServeOptions(out=str(d), candidates=specs, hooks=hooks, progress=progress))
        opts.protocol["ab"] = {"round": r, "arm": arm, "compare_dir": os.fspath(out)}
        res = serve(cfg, opts)
        head = res.summary.get("headline", {})
        log(f"round {r} {arm} ({', '.join(specs) or 'baseline'}): {d}  P50 @ {head.get('boundary')} "
            f"{_f(head.get('p50_ms'))} ms (n={head.get('n')})")
        metas[arm] = load_meta(d, r, arm)
    return metas


def run_compare(
    cfg,
    baseline: Sequence[str],
    candidate: Sequence[str],
    *,
    rounds: int | None = None,
    out: Path,
    hooks: HookSet = HookSet(),
    progress: bool = False,
    log: Callable[[str], None] = print,
    until_resolved: bool = False,
    max_rounds: int | None = None,
    margin: float = S.DEFAULT_MARGIN,
) -> CompareResult:
    plan = check_plan(rounds, until_resolved, max_rounds, margin)
    if not candidate:
        raise HarnessError("compare needs --candidate ID (the candidate under test)")
    both = [s for s in candidate if s in baseline]
    if both:
        raise HarnessError(f"{', '.join(both)} is both the candidate and in the baseline")
    a_specs, b_specs = tuple(baseline), tuple(baseline) + tuple(candidate)
    resolve(b_specs, cfg)  # unknown ids, conflicts, unmet needs: refused before anything launches
    refuse_unrepeatable_exact(candidate, cfg.runtime.mode)
    if configure(a_specs, cfg) == configure(b_specs, cfg) and not _patches_engine(candidate):
        raise HarnessError(f"candidate {', '.join(candidate)} changes nothing on this config (already set by the "
                           f"options?); A and B would be the same run")
    if round_dirs(out) or (out / "compare.json").exists():
        raise HarnessError(f"{out} already holds a comparison; choose another --out (or --reanalyze it)")
    out.mkdir(parents=True, exist_ok=True)
    proto = protocol_for("timing", cfg)
    metas: dict[str, list[RunMeta]] = {"A": [], "B": []}
    gate_rec, stopped, seq = None, None, plan.record() if until_resolved else None
    if seq is not None:
        log(budget_line(plan))
    log(needed_line(plan, S.PRIOR_LAUNCH_SD, S.PRIOR_LAUNCH_SD, "(the prior, before any launch is measured)"))
    for r in range(plan.max_rounds):
        t0 = time.monotonic()
        for arm, m in _launch_round(cfg, out, r, (("A", a_specs), ("B", b_specs)), hooks, progress, proto, log).items():
            metas[arm].append(m)
        if r == 0:
            took = time.monotonic() - t0
            log(f"the first round took {took:.0f} s: {plan.max_rounds} rounds take about {plan.max_rounds * took / 60:.0f} min at most")
            cand = check_comparable(metas["A"], metas["B"])  # refuse before spending more rounds
            gate_rec = run_gate(metas["A"][0], metas["B"][0], cand)
            log(gate_line(gate_rec))
            if gate_rec.status == "fail":
                stopped = "numeric gate failed on round 0: no speed is claimed, remaining rounds skipped"
                break
        if seq is not None and r + 1 in plan.looks and look(metas["A"], metas["B"], plan, gate_rec, seq, log):
            break
    if seq is None:
        return analyze(metas["A"], metas["B"], rounds_requested=plan.max_rounds, gate_record=gate_rec,
                       stopped_early=stopped, plan=plan)
    return finish_sequential(metas["A"], metas["B"], plan, gate_rec, stopped, seq)


def main(args) -> int:
    if args.reanalyze:
        if not args.out:
            raise HarnessError("--reanalyze needs --out DIR (the comparison directory)")
        out = Path(args.out)
        plan = check_plan(args.rounds, True, args.max_rounds, args.margin) if args.until_resolved else None
        res = reanalyze(out, plan, log=print)
    else:
        check_plan(args.rounds, args.until_resolved, args.max_rounds, args.margin)  # before any config is built
        cfg = resolve_config(args)
        out = Path(args.out) if args.out else default_out(args.candidate or ["none"])
        res = run_compare(cfg, args.baseline, args.candidate, rounds=args.rounds, out=out,
                          hooks=parse_hooks(args.hooks), progress=not args.no_progress,
                          until_resolved=args.until_resolved, max_rounds=args.max_rounds, margin=args.margin)
    j, md = write_outputs(out, res)
    for line in summary_lines(res, with_gate=bool(args.reanalyze)):  # a live comparison printed it after round 0
        print(line)
    print(f"wrote {j} and {md}")
    return EXIT_FAIL if res.gate.status == "fail" else 0
