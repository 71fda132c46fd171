"""``report``: ``report.md`` with the summary tables and PNG plots of one or more run directories.

Plots (matplotlib, Agg backend: headless, no display needed):

- ``intervals.png`` / ``intervals_cdf.png``: steady delivery intervals per boundary, runs overlaid
  (a histogram; a strip of every sample when there are fewer than ``STRIP_BELOW``, where a
  histogram says nothing).
- ``stages_per_chunk.png``: per chunk index, the nearest-rank P50 of every stage of
  ``measure.stages`` over the measured sessions, stacked — a stack of medians, not any one chunk's
  latency — with the chunk's P50 delivery interval at the reference boundary marked (under Case E
  the stack exceeds it: stages of different chunks overlap); one panel per run.
- ``timeline.png``: one measured session as a Gantt chart, one lane per process that timed what
  it shows (the driver, DiT rank 0 and VAE rank 0 — the other ranks of a group run in lockstep and
  record nothing — the encoder, the client); one panel per run.
- ``ttfc.png``: TTFC per boundary (nearest-rank P50 — the report's table — with min–max
  whiskers over sessions), runs grouped.
- ``slowest_intervals.png`` (long-tail runs): the slowest steady intervals, each broken down by
  stage, beside the median chunk.

Every plot is titled with its runs' setting lines (``measure.setting``). Every plot and table
computes its figures with the same functions (``summary.dist`` over ``metrics``), labels them
from ``measure.figures``, and each plot function returns the values it drew (``Plotted``) so that
what is drawn can be tested without reading pixels.

``report.md`` reads top to bottom: the headline of each run under its setting line, the plots,
the tables, then the definitions of the figures the report printed (and no others).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import matplotlib
import matplotlib.pyplot as plt
import msgspec
import numpy as np
from matplotlib.ticker import MaxNLocator

from harness.errors import HarnessError
from harness.limits import MAX_JSON_BYTES, read_bounded
from harness.measure import figures as F
from harness.measure import metrics as M
from harness.measure import production as P
from harness.measure import stats as S
from harness.measure import tails as T
from harness.measure.events import BOUNDARIES, ChunkEvent, SessionStart, read_run
from harness.measure.headline import HEADLINE_COLUMNS  # report.md's headline table is the console's
from harness.measure.stages import INTERVALS, STAGE_NAMES, STAGES
from harness.measure.setting import flag_lines, run_setting
from harness.measure.telemetry_figures import TELEMETRY_FIGURES, telemetry_line
from harness.measure.summary import FLAG_STALLED, FLAG_THROTTLED, RULE_SCHEMA, SUMMARY_FILE, build_summary, dist, upgrade_summary

PLOT_BOUNDARIES: tuple[str, ...] = ("cpu_ready", "encoded", "delivered")
#: Gantt lanes: the process that spends (and times) each segment. Only rank 0 of a DiT or VAE group
#: records boundaries; the other ranks run the same forward/decode in lockstep (every layer has a
#: collective) and time nothing, so they get no lane of their own: rank 0's lane names the group.
DRIVER_STAGES = ("dit_queue", "latent_ipc", "decode_wait", "decode_queue")
DIT_STAGES, VAE_STAGES = ("dit",), ("decode", "convert", "d2h")
PLOTS: tuple[str, ...] = ("intervals.png", "intervals_cdf.png", "stages_per_chunk.png", "timeline.png", "ttfc.png")
SLOWEST_PLOT = "slowest_intervals.png"
#: fewer steady samples than this in every run of a panel: a strip of the samples, not a histogram
STRIP_BELOW = 40
#: the boundary whose interval the stage plot marks (the summary's reference)
STAGE_REFERENCE = "cpu_ready"
DPI = 100


class RunView(msgspec.Struct, frozen=True):
    label: str
    dir: str
    events: list[ChunkEvent]
    sessions: list[SessionStart]
    summary: dict
    window: M.Window
    manifest: dict = {}
    #: ``measure.setting.setting_line`` of the run
    setting: str = ""


class Bar(msgspec.Struct, frozen=True):
    lane: str
    stage: str
    chunk: int
    start_ms: float
    dur_ms: float


class Plotted(msgspec.Struct, frozen=True):
    """A written plot and the values drawn in it (per run label), for tests and readers."""

    path: Path
    values: dict


# ---- loading -------------------------------------------------------------------------------


def run_label(manifest: dict, run_dir: str) -> str:
    """"case-d", "case-e +H5a", "case-d websocket" …; the directory name when there is no manifest."""
    if not manifest:
        return Path(run_dir).name
    cands = manifest.get("candidates") or []
    served = " websocket" if (manifest.get("protocol") or {}).get("name") == "websocket" else ""
    return manifest.get("scheduler", "?") + (f" +{'+'.join(cands)}" if cands else "") + served


def window_of(summary: dict) -> M.Window:
    w = summary.get("window")
    if not w:
        return M.DEFAULT_WINDOW
    return M.Window(first_chunk=w["first_chunk"], last_chunk=w["last_chunk"], warmup_epochs=w["warmup_epochs"])


def load_view(run_dir: str | Path) -> RunView:
    d = Path(run_dir)
    if not (d / "events.jsonl").is_file():
        raise FileNotFoundError(f"{d} has no events.jsonl: not a run directory")
    events, sessions = read_run(d, tolerate_partial_tail=True)
    manifest = json.loads(read_bounded(d / "manifest.json", MAX_JSON_BYTES, "manifest")) if (d / "manifest.json").is_file() else {}
    if (d / SUMMARY_FILE).is_file():
        summary = upgrade_summary(json.loads(read_bounded(d / SUMMARY_FILE, MAX_JSON_BYTES, "summary")))
        if summary.get("schema", 0) < RULE_SCHEMA:  # figures of an older rule (e.g. fps_median): recomputed from events
            figures = build_summary(events, sessions, window=window_of(summary))
            summary = {**summary, **msgspec.to_builtins(figures), "flags": _kept_flags(summary, figures.flags)}
    else:
        chunks = manifest.get("config", {}).get("video", {}).get("chunks_per_session")
        window = M.window_for(chunks) if chunks else M.DEFAULT_WINDOW
        summary = msgspec.to_builtins(build_summary(events, sessions, window=window))
    labels = run_label(manifest, str(d))
    return RunView(labels, str(d), events, sessions, summary, window_of(summary), manifest, run_setting(d, manifest))


def _kept_flags(old: dict, figures_flags: list[str]) -> list[str]:
    """The recomputed figures' flags and the run's own (``stalled``, ``clocks_throttled``), which events cannot show."""
    return sorted(set(figures_flags) | ({FLAG_STALLED, FLAG_THROTTLED} & set(old.get("flags", []))))


def unique_labels(views: Sequence[RunView]) -> list[str]:
    """Labels, disambiguated by directory name when two runs would read the same."""
    labels = [v.label for v in views]
    return [f"{l} ({Path(v.dir).name})" if labels.count(l) > 1 else l for l, v in zip(labels, views)]


# ---- pure figure data ----------------------------------------------------------------------


def steady_ms(view: RunView, boundary: str) -> np.ndarray:
    if boundary not in M.boundaries_seen(view.events):
        return np.array([], dtype=np.float64)
    return M.steady_intervals(view.events, boundary, view.window, view.sessions).ns() / 1e6


def ecdf(values: Sequence[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted values and the fraction of samples ≤ each (a step function ending at 1)."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    return x, np.arange(1, x.size + 1) / x.size if x.size else np.array([])


def per_chunk_stages(events: Sequence[ChunkEvent], sessions: Sequence[SessionStart], window: M.Window) -> dict[int, dict[str, float]]:
    """chunk index → segment → nearest-rank P50 ms over measured, non-cancelled sessions (negative
    segments, an ordering fault, are left out rather than drawn below the axis)."""
    acc: dict[int, dict[str, list[int]]] = {}
    for e in M.measured_chunks(events, sessions, window, include_cancelled=False):
        for name, d in M.stage_durations(e).items():
            if d >= 0:
                acc.setdefault(e.chunk, {}).setdefault(name, []).append(d)
    return {c: {n: S.nearest_rank(v, 50) / 1e6 for n, v in st.items()} for c, st in sorted(acc.items())}


def pick_session(events: Sequence[ChunkEvent], sessions: Sequence[SessionStart], window: M.Window) -> tuple[int, int] | None:
    """The first measured, non-cancelled session with chunks (run order); else any session with chunks."""
    table = M.session_table(events)
    cancelled = M.cancelled_keys(events, sessions)
    order = sorted(table, key=lambda k: (k[1], k[0]))
    for k in order:
        if window.measured(k[1]) and k not in cancelled:
            return k
    return order[0] if order else None


def _group(role: str, n: int) -> str:
    return f"{role} rank 0" + (f" of {n} (the group, in lockstep)" if n > 1 else "")


def lanes_of(manifest: dict) -> list[tuple[str, tuple[str, ...]]]:
    """(lane, stages) for every process that timed something, from the run's manifest (one of each
    kind when there is none): a group's rank 0 stands for the group."""
    cfg = manifest.get("config", {})
    par = cfg.get("parallel", {})
    sp, vae = int(par.get("sp", 1)), int(par.get("vae_ranks", 1))
    stream = cfg.get("runtime", {}).get("sink") == "stream"
    lanes = [("driver", DRIVER_STAGES), (_group("DiT", sp), DIT_STAGES), (_group("VAE", vae), VAE_STAGES)]
    if stream:  # the client acknowledges: "delivered" is its clock
        return lanes + [("encoder", ("ipc", "encode")), ("client", ("sink",))]
    return lanes + [("encoder", ("ipc", "encode", "sink"))]  # the file sink writes inside the encoder process


def timeline_bars(events: Sequence[ChunkEvent], sessions: Sequence[SessionStart], key: tuple[int, int],
                  manifest: dict | None = None) -> list[Bar]:
    """Every lane's segments of one session, in ms from its start (or its first submit)."""
    chunks = M.session_table(events).get(key, {})
    start = {s.key: s.start_ns for s in sessions}.get(key)
    if start is None:
        firsts = [t for e in chunks.values() for t in e.present().values()]
        start = min(firsts) if firsts else 0
    out = []
    for c in sorted(chunks):
        e = chunks[c]
        for lane, stages in lanes_of(manifest or {}):
            for st in stages:
                a, b = e.at(INTERVALS[st][0]), e.at(INTERVALS[st][1])
                if a is not None and b is not None and b >= a:
                    out.append(Bar(lane, st, c, (a - start) / 1e6, (b - a) / 1e6))
    return out


def per_chunk_interval(events: Sequence[ChunkEvent], sessions: Sequence[SessionStart], window: M.Window,
                       boundary: str = STAGE_REFERENCE) -> dict[int, float]:
    """chunk index i ≥ 1 → nearest-rank P50 ms of B(i) − B(i−1) over measured, non-cancelled
    sessions: the delivery interval the stage plot marks beside each chunk's stack."""
    table = M.session_table(M.measured_chunks(events, sessions, window, include_cancelled=False))
    acc: dict[int, list[int]] = {}
    for chunks in table.values():
        for smp in M.session_intervals(chunks, boundary, sorted(c for c in chunks if c >= 1))[0]:
            acc.setdefault(smp.chunk, []).append(smp.ns)
    return {c: S.nearest_rank(v, 50) / 1e6 for c, v in sorted(acc.items())}


def ttfc_by_boundary(events: Sequence[ChunkEvent], sessions: Sequence[SessionStart], window: M.Window) -> dict[str, tuple[float, float, float]]:
    """boundary → (P50, min, max) TTFC in ms over measured sessions, boundaries in data-flow order;
    the same ``summary.dist`` as the report's TTFC table, so the P50 is the nearest-rank one."""
    out = {}
    if not sessions:
        return out
    for b in M.boundaries_seen(events):
        d = dist(M.ttfc(events, sessions, b, window).ns())
        if d.n:
            out[b] = (d.p50_ms, d.min_ms, d.max_ms)
    return out


def slowest_stages(long_tail: dict) -> tuple[list[str], list[tuple[str, dict[str, float], float]]]:
    """(stages, rows) of a long-tail summary: the stages between reference(i−1) and reference(i)
    (gap + the segments up to the reference boundary), and per row (label, stage → ms, interval ms);
    the first row is the median chunk, then the slowest samples, slowest first."""
    ref = long_tail["reference"]
    upto = BOUNDARIES.index(ref)
    stages = ["gap"] + [n for n, _, end in STAGES if BOUNDARIES.index(end) <= upto]
    slow = long_tail.get("slowest") or []
    if not slow:
        return stages, []
    first = slow[0]
    rows = [("median chunk", {n: first["stages"][n]["median_ms"] for n in stages
                              if n in first["stages"] and first["stages"][n]["median_ms"] is not None},
             first["median_ms"])]
    for x in slow:
        rows.append((f"#{x['rank']} s{x['session']} c{x['chunk']}",
                     {n: x["stages"][n]["ms"] for n in stages if n in x["stages"]}, x["interval_ms"]))
    return stages, rows


# ---- plots ---------------------------------------------------------------------------------


def _plt():
    matplotlib.use("Agg", force=True)  # headless: never needs a display (switched before any figure exists)
    return plt


def _stage_colors() -> dict[str, tuple]:
    cmap = matplotlib.colormaps["tab20"]
    return {name: cmap(i % 20) for i, name in enumerate(STAGE_NAMES)}


def _empty(ax, text: str = "no samples") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def _save(fig, path: Path, values: dict, settings: Sequence[str] = (), note: str = "") -> Plotted:
    fig.tight_layout()
    if settings or note:  # above the panels; bbox_inches="tight" grows the canvas to keep it
        fig.suptitle("\n".join([*settings, *([note] if note else [])]), y=1.0, va="bottom", fontsize=7, color="0.25")
    fig.savefig(path, dpi=DPI, bbox_inches="tight")  # keeps legends placed outside the axes
    _plt().close(fig)
    return Plotted(path, values)


def _integer_counts(axis) -> None:
    axis.set_major_locator(MaxNLocator(integer=True))  # counts: no fractional ticks


def settings_of(views: Sequence[RunView], labels: Sequence[str]) -> list[str]:
    """One title line per run: its label and setting line."""
    return [f"{l} — {v.setting}" if len(views) > 1 else v.setting for v, l in zip(views, labels) if v.setting]


def strip_offsets(n: int) -> np.ndarray:
    """Fixed vertical offsets that spread ``n`` strip-plot points over a band (no randomness)."""
    return ((np.arange(n) % 3) - 1) * 0.1


def plot_intervals(views: Sequence[RunView], labels: Sequence[str], path: Path) -> Plotted:
    """Per boundary, the steady intervals of every run: a histogram, or with fewer than
    ``STRIP_BELOW`` samples in every run a strip of the samples themselves with the P50 marked."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(PLOT_BOUNDARIES), figsize=(4.2 * len(PLOT_BOUNDARIES), 3.6), squeeze=False)
    values: dict = {}
    for ax, b in zip(axes[0], PLOT_BOUNDARIES):
        data = [(steady_ms(v, b), l) for v, l in zip(views, labels)]
        data = [(x, l) for x, l in data if x.size]
        if not data:
            _empty(ax)
        elif max(x.size for x, _ in data) < STRIP_BELOW:
            for i, (x, l) in enumerate(data):
                xs = np.sort(x)
                ax.scatter(xs, i + strip_offsets(xs.size), s=14, label=f"{l} (n={x.size})")
                ax.plot([S.nearest_rank(x, 50)] * 2, [i - 0.3, i + 0.3], color="k", linewidth=1.5)
                values.setdefault(l, {})[b] = {"kind": "strip", "ms": xs.tolist()}
            ax.set_yticks(range(len(data)))
            ax.set_yticklabels([f"n={x.size}" for x, _ in data], fontsize=7)
            ax.set_ylim(-0.6, len(data) - 0.4)
            ax.legend(fontsize=7)
        else:
            lo, hi = min(x.min() for x, _ in data), max(x.max() for x, _ in data)
            bins = np.linspace(lo, hi if hi > lo else lo + 1, 21)
            for x, l in data:
                ax.hist(x, bins=bins, alpha=0.55, label=f"{l} (n={x.size})")
                values.setdefault(l, {})[b] = {"kind": "hist", "ms": x.tolist()}
            ax.set_ylabel("intervals (count)")
            _integer_counts(ax.yaxis)
            ax.legend(fontsize=7)
        strip = data and max(x.size for x, _ in data) < STRIP_BELOW
        ax.set_title(f"steady delivery interval @ {b}" + ("\nevery sample; | = P50 (nearest rank)" if strip else ""),
                     fontsize=9)
        ax.set_xlabel("ms")
    return _save(fig, path, values, settings_of(views, labels))


def plot_cdf(views: Sequence[RunView], labels: Sequence[str], path: Path) -> Plotted:
    plt = _plt()
    fig, axes = plt.subplots(1, len(PLOT_BOUNDARIES), figsize=(4.2 * len(PLOT_BOUNDARIES), 3.6), squeeze=False)
    values: dict = {}
    for ax, b in zip(axes[0], PLOT_BOUNDARIES):
        drawn = False
        for v, l in zip(views, labels):
            x, y = ecdf(steady_ms(v, b))
            if x.size:
                ax.step(np.r_[x[0], x], np.r_[0.0, y], where="post", label=l)  # rises from 0 at the minimum
                values.setdefault(l, {})[b] = x.tolist()
                drawn = True
        if drawn:
            ax.legend(fontsize=7)
            ax.set_ylim(0, 1.02)
        else:
            _empty(ax)
        ax.set_title(f"CDF of steady delivery interval @ {b}", fontsize=9)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of intervals ≤ x")
        ax.grid(alpha=0.3)
    return _save(fig, path, values, settings_of(views, labels))


def _legend_outside(axes, order: Sequence[str]) -> None:
    """One legend for all panels, outside them (so no bar is hidden), in ``order``."""
    handles, names = [], []
    for ax in axes:
        for h, n in zip(*ax.get_legend_handles_labels()):
            if n not in names:
                handles.append(h)
                names.append(n)
    if handles:
        idx = sorted(range(len(names)), key=lambda i: order.index(names[i]) if names[i] in order else len(order))
        axes[-1].legend([handles[i] for i in idx], [names[i] for i in idx], fontsize=7,
                        loc="upper left", bbox_to_anchor=(1.01, 1.0))


def plot_stages(views: Sequence[RunView], labels: Sequence[str], path: Path) -> Plotted:
    plt = _plt()
    colors = _stage_colors()
    fig, axes = plt.subplots(1, len(views), figsize=(5.5 * len(views), 4.4), squeeze=False, sharey=True)
    values: dict = {}
    for ax, v, l in zip(axes[0], views, labels):
        table = per_chunk_stages(v.events, v.sessions, v.window)
        interval = per_chunk_interval(v.events, v.sessions, v.window)
        values[l] = {"stages": table, "interval": interval}
        if not table:
            _empty(ax)
        chunks = list(table)
        bottom = np.zeros(len(chunks))
        for name in STAGE_NAMES:
            h = np.array([table[c].get(name, 0.0) for c in chunks])
            if h.any():
                ax.bar(chunks, h, bottom=bottom, color=colors[name], label=name, width=0.8)
                bottom += h
        if interval:
            ax.plot(list(interval), list(interval.values()), "D", color="k", markersize=5,
                    label=f"P50 interval @ {STAGE_REFERENCE}")
        ax.set_title(l, fontsize=9)
        ax.set_xlabel("chunk")
        ax.set_ylabel("ms (stage P50s, submit → delivered)")
        if chunks:
            ax.set_xticks(chunks)
    _legend_outside(list(axes[0]), [*STAGE_NAMES, f"P50 interval @ {STAGE_REFERENCE}"])
    return _save(fig, path, values, settings_of(views, labels),
                 f"per chunk, the P50 of each stage over measured sessions, stacked: a stack of medians, not one chunk's "
                 f"latency; ◆ = the chunk's P50 interval {STAGE_REFERENCE}(i) − {STAGE_REFERENCE}(i−1) "
                 "(under Case E stages of different chunks overlap, so the stack exceeds it)")


def plot_timeline(views: Sequence[RunView], labels: Sequence[str], path: Path) -> Plotted:
    plt = _plt()
    colors = _stage_colors()
    n_lanes = [len(lanes_of(v.manifest)) for v in views]
    fig, axes = plt.subplots(len(views), 1, figsize=(11, sum(0.38 * n + 1.2 for n in n_lanes) + 0.4), squeeze=False,
                             gridspec_kw={"height_ratios": n_lanes})
    values: dict = {}
    for ax, v, l in zip(axes[:, 0], views, labels):
        lanes = [name for name, _ in lanes_of(v.manifest)]
        key = pick_session(v.events, v.sessions, v.window)
        bars = timeline_bars(v.events, v.sessions, key, v.manifest) if key else []
        values[l] = {"session": key, "lanes": lanes, "bars": [msgspec.to_builtins(b) for b in bars]}
        if not bars:
            _empty(ax, "no session")
        seen = set()
        for bar in bars:
            y = lanes.index(bar.lane)
            ax.barh(y, bar.dur_ms, left=bar.start_ms, height=0.6, color=colors[bar.stage], edgecolor="k", linewidth=0.3,
                    label=bar.stage if bar.stage not in seen else None)
            seen.add(bar.stage)
            if bar.stage in ("dit", "decode", "encode") and bar.dur_ms > 0:
                ax.text(bar.start_ms + bar.dur_ms / 2, y, str(bar.chunk), ha="center", va="center", fontsize=6)
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels(lanes, fontsize=8)
        ax.set_ylim(len(lanes) - 0.5, -0.5)
        title = f"{l}: session {key[0]} (epoch {key[1]})" if key else l
        ax.set_title(f"{title}: every process that timed a stage — chunk index on the bars", fontsize=9)
        ax.set_xlabel("ms since session start")
        if seen:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path, values, settings_of(views, labels))


def plot_ttfc(views: Sequence[RunView], labels: Sequence[str], path: Path) -> Plotted:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 3.8))
    data = [ttfc_by_boundary(v.events, v.sessions, v.window) for v in views]
    bounds = [b for b in BOUNDARIES if any(b in d for d in data)]
    if not bounds:
        _empty(ax, "no TTFC (no session starts or measured sessions)")
    width = 0.8 / max(len(views), 1)
    x = np.arange(len(bounds))
    for i, (d, l) in enumerate(zip(data, labels)):
        p50 = np.array([d[b][0] if b in d else np.nan for b in bounds])
        lo = np.array([d[b][0] - d[b][1] if b in d else 0 for b in bounds])
        hi = np.array([d[b][2] - d[b][0] if b in d else 0 for b in bounds])
        ax.bar(x + i * width - 0.4 + width / 2, p50, width, yerr=[lo, hi], capsize=2, label=l)
    ax.set_xticks(x)
    ax.set_xticklabels(bounds, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms from session start")
    ax.set_title(f"time to first chunk per boundary: bar = {F.label('ttfc_p50')} (nearest rank, as in the table); "
                 "whiskers: min–max over sessions", fontsize=9)
    if bounds:
        ax.legend(fontsize=8)
    return _save(fig, path, dict(zip(labels, data)), settings_of(views, labels))


def plot_slowest(views: Sequence[RunView], labels: Sequence[str], path: Path) -> Plotted:
    """Per long-tail run, the slowest steady intervals as stacked stage bars beside the median chunk."""
    plt = _plt()
    colors = {**_stage_colors(), "gap": (0.55, 0.55, 0.55, 1.0)}
    tails = [(v.summary["long_tail"], l) for v, l in zip(views, labels) if (v.summary.get("long_tail") or {}).get("slowest")]
    rows_of = [slowest_stages(lt) for lt, _ in tails]
    fig, axes = plt.subplots(len(tails), 1, figsize=(11, sum(0.32 * len(r) + 1.3 for _, r in rows_of)), squeeze=False,
                             gridspec_kw={"height_ratios": [len(r) for _, r in rows_of]})
    values: dict = {}
    for ax, (lt, l), (stages, rows) in zip(axes[:, 0], tails, rows_of):
        values[l] = rows
        seen: set[str] = set()
        for y, (name, st, interval) in enumerate(rows):
            left = 0.0
            for n in stages:
                w = st.get(n, 0.0)
                if w > 0:
                    ax.barh(y, w, left=left, height=0.6, color=colors[n], edgecolor="k", linewidth=0.3,
                            label=None if n in seen else n)
                    seen.add(n)
                    left += w
            ax.plot([interval], [y], marker="D", color="k", markersize=5, label="interval" if y == 0 else None)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([r[0] for r in rows], fontsize=8)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xlabel("ms")
        ax.set_title(f"{l}: slowest steady intervals @ {lt['reference']}, slowest first\n"
                     f"chunk i's stages from gap (cpu_ready(i−1) → submit(i)) up to {lt['reference']}, stacked; "
                     "◆ = the interval (stacks exceed it where stages overlap, Case E)", fontsize=9)
    _legend_outside(list(axes[:, 0]), ["gap", *STAGE_NAMES, "interval"])
    return _save(fig, path, values, settings_of([v for v in views if (v.summary.get("long_tail") or {}).get("slowest")],
                                                [l for _, l in tails]))


def render_plots(views: Sequence[RunView], out: Path) -> list[Plotted]:
    labels = unique_labels(views)
    out.mkdir(parents=True, exist_ok=True)
    plotted = [
        plot_intervals(views, labels, out / PLOTS[0]),
        plot_cdf(views, labels, out / PLOTS[1]),
        plot_stages(views, labels, out / PLOTS[2]),
        plot_timeline(views, labels, out / PLOTS[3]),
        plot_ttfc(views, labels, out / PLOTS[4]),
    ]
    if any((v.summary.get("long_tail") or {}).get("slowest") for v in views):
        plotted.append(plot_slowest(views, labels, out / SLOWEST_PLOT))
    return plotted


# ---- markdown ------------------------------------------------------------------------------


def _f(x, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def _ci(ci) -> str:
    return "—" if not ci else f"[{ci[0]:.1f}, {ci[1]:.1f}]"


BOUNDARY_COLUMNS = ("boundary", "n", "sessions", "interval_p50", "interval_p50_ci", "interval_p99", "interval_p99_ci",
                    "interval_max", "fps_mean", "fps_median")
TTFC_COLUMNS = ("boundary", "n", "ttfc_p50", "ttfc_min", "ttfc_max")
STAGE_COLUMNS = ("stage", "span", "n", "stage_p50", "stage_mean", "stage_share", "stage_of_interval")
HANDOFF_COLUMNS = ("handoff_p50", "n")
BLOCKED_COLUMNS = ("blocked_stage", "blocked_total", "blocked_max", "chunks_blocked")
WARMUP_FIGURES = ("warmup_first_chunk", "warmup_excess")
LONG_TAIL_FIGURES = ("tail_percentiles", "interval_p95", "culprits", *T.SLOWEST_COLUMNS)
#: Every figure a report can print; a report defines those it printed (``used_figures``).
REPORT_FIGURES = tuple(dict.fromkeys(BOUNDARY_COLUMNS + HEADLINE_COLUMNS + TTFC_COLUMNS + STAGE_COLUMNS + HANDOFF_COLUMNS
                                     + BLOCKED_COLUMNS + ("p99_is_max",) + WARMUP_FIGURES + LONG_TAIL_FIGURES
                                     + tuple(F.flag_figure(f) for f in F.FLAG_NAMES) + TELEMETRY_FIGURES))


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _p99(d: dict) -> str:
    return f"{_f(d['p99_ms'])}{'*' if d['p99_is_max'] else ''}"


def headline_section(view: RunView, label: str) -> list[str]:
    """The run's setting, its headline at the reference boundary, and every flag raised, defined."""
    s = view.summary
    h = s.get("headline", {})
    return [
        f"### {label}", "", f"`{view.setting}`" if view.setting else "(no manifest: setting unknown)", "",
        *F.header(HEADLINE_COLUMNS),
        f"| {h.get('boundary', '?')} | {_f(h.get('fps_mean'), '{:.2f}')} | {_f(h.get('fps_median'), '{:.2f}')} | "
        f"{_f(h.get('p50_ms'))} | {_f(h.get('p99_ms'))}{'*' if h.get('p99_is_max') else ''} | "
        f"{_f(h.get('ttfc_p50_ms'))} | {h.get('n', 0)} |",
        "",
        *([f"- {tel}", ""] if (tel := telemetry_line(s.get("telemetry"))) else []),
        *[f"- {line.strip()}" for line in flag_lines(s.get("flags", []))],
        *([""] if s.get("flags") else []),
    ]


def _warmup_rows(s: dict, mode: str | None) -> list[str]:
    stages = (s.get("warmup") or {}).get("stages") or {}
    if not stages:
        return []
    out = ["", f"Warm-up (the first warm-up session, mode {mode or '?'}):", "",
           "| stage | " + F.label("warmup_first_chunk") + " | " + F.label("stage_p50") + " | " + F.label("warmup_excess") + " |",
           "|---|---:|---:|---:|"]
    for st, x in stages.items():
        out.append(f"| {st} | {_f(x.get('first_ms'))} | {_f(x.get('steady_p50_ms'))} | {_f(x.get('excess_ms'))} |")
    return out


def run_section(view: RunView, label: str) -> list[str]:
    """The run's tables (its headline is in ``headline_section``)."""
    s = view.summary
    w = s.get("window", {})
    sched = view.manifest.get("scheduler")
    lines = [
        f"## {label}",
        "",
        f"`{view.dir}` — status {s.get('status', '?')}, valid {s.get('valid', '?')}"
        + (f", flags: {', '.join(s['flags'])}" if s.get("flags") else ""),
        "",
        f"Window: {w.get('definition', '?')}. Percentiles: {w.get('percentile_rule', '?')}.",
        "",
        "Steady delivery intervals per boundary:",
        "",
        *F.header(BOUNDARY_COLUMNS),
    ]
    for b, bs in s.get("boundaries", {}).items():
        iv = bs["intervals"]
        lines.append(f"| {b} | {iv['n']} | {bs['n_sessions']} | {_f(iv['p50_ms'])} | {_ci(bs['p50_ci_ms'])} | "
                     f"{_p99(iv)} | {_ci(bs['p99_ci_ms'])} | {_f(iv['max_ms'])} | "
                     f"{_f(bs['fps_mean'], '{:.2f}')} | {_f(bs.get('fps_median'), '{:.2f}')} |")
    lines += ["", f"{F.label('p99_is_max')} {F.define('p99_is_max').formula}.", "", "Time to first chunk:", "",
              *F.header(TTFC_COLUMNS)]
    for b, d in s.get("ttfc", {}).items():
        lines.append(f"| {b} | {d['n']} | {_f(d['p50_ms'])} | {_f(d['min_ms'])} | {_f(d['max_ms'])} |")
    lines += ["", "Stages of a steady chunk:", "", *F.header(STAGE_COLUMNS)]
    for name, st in s.get("stages", {}).items():
        d = st["durations"]
        lines.append(f"| {name} | {st['start']} → {st['end']} | {d['n']} | {_f(d['p50_ms'], '{:.2f}')} | "
                     f"{_f(d['mean_ms'], '{:.2f}')} | {_f(st['share'], '{:.1%}')} | {_f(st['share_of_interval'], '{:.1%}')} |")
    lines += _warmup_rows(s, view.manifest.get("mode"))
    ho = s.get("handoff", {})
    if ho.get("n"):
        lines += ["", *F.header(HANDOFF_COLUMNS, sched), f"| {_f(ho['p50_ms'], '{:.2f}')} | {ho['n']} |"]
    if s.get("blocked"):
        lines += ["", "Producers blocked on a full queue (every chunk of every measured session):", "",
                  *F.header(BLOCKED_COLUMNS)]
        for k, bl in s["blocked"].items():
            lines.append(f"| {k} | {_f(bl['total_ms'])} | {_f(bl['max_ms'])} | {bl['chunks_blocked']} / {bl['chunks']} |")
    lt = s.get("long_tail")
    if lt and lt.get("boundaries"):
        cols, rows = T.percentile_table(lt)
        lines += ["", f"### {F.label('tail_percentiles')}", "", *F.header(cols), *map(_md_row, rows)]
    if lt and lt.get("slowest"):
        lines += ["", f"### slowest steady intervals @ {lt['reference']}", "", *F.header(T.SLOWEST_COLUMNS),
                  *map(_md_row, T.slowest_table(lt))]
        if lt.get("culprits"):
            lines += ["", f"{F.label('culprits')}: " + ", ".join(f"{k} {v}" for k, v in lt["culprits"].items()) + "."]
    lines.append("")
    return lines


def used_figures(views: Sequence[RunView], production: bool = False) -> tuple[str, ...]:
    """The figures the report prints for these runs, in table order: a section that is absent for
    every run (no handoff, no blocking, no long tail, no warm-up) defines nothing."""
    sums = [v.summary for v in views]
    names = [*HEADLINE_COLUMNS, *BOUNDARY_COLUMNS, "p99_is_max", *TTFC_COLUMNS, *STAGE_COLUMNS]
    if any((s.get("warmup") or {}).get("stages") for s in sums):
        names += WARMUP_FIGURES
    if any((s.get("handoff") or {}).get("n") for s in sums):
        names += HANDOFF_COLUMNS
    if any(s.get("blocked") for s in sums):
        names += BLOCKED_COLUMNS
    if any((s.get("long_tail") or {}).get("boundaries") for s in sums):
        names += ["tail_percentiles", "interval_p95"]
    if any((s.get("long_tail") or {}).get("slowest") for s in sums):
        names += [*T.SLOWEST_COLUMNS, "culprits"]
    names += [F.flag_figure(f) for f in F.FLAG_NAMES if any(f in s.get("flags", []) for s in sums)]
    if any(s.get("telemetry") for s in sums):
        names += TELEMETRY_FIGURES
    if production:
        names += [*P.COLUMNS, *P.FIGURE_OF.values()]
    return tuple(dict.fromkeys(names))


def definitions_section(names: Sequence[str]) -> list[str]:
    """The figures the report printed, each defined once (``measure.figures``)."""
    return ["## figure definitions", "", "Every figure printed above, once. "
            "Labels that read differently under a scheduler are the same figure.", "", *F.table_md(tuple(names)), ""]


def production_section(view: RunView, bench: dict | None) -> list[str]:
    """The run beside DESIGN §12 (``measure.production``), resolution and ranks from its manifest."""
    cfg = view.manifest.get("config", {})
    video, parallel = cfg.get("video", {}), cfg.get("parallel", {})
    res = (video.get("height"), video.get("width"))
    res_s = f"{res[0]}×{res[1]}"
    head = [f"### against the production figures (DESIGN §12, {res_s})", ""]
    if res not in P.PRODUCTION:
        return head + [f"No production figures for {res[0]}×{res[1]} (DESIGN §12 has 480×832 and 704×1280).", ""]
    layers = cfg.get("model", {}).get("num_layers")
    if bench is not None and (bench.get("preset"), bench.get("layers", layers)) != (cfg.get("name"), layers):
        return head + [f"--bench is for {bench.get('preset')!r} with {bench.get('layers')} layers, this run is "
                       f"{cfg.get('name')!r} with {layers}: its FLOPs do not apply, so no table.", ""]
    rows = P.production_rows(view.summary, view.events, view.sessions, view.window, res, parallel, bench,
                             view.manifest.get("scheduler"))
    setup = (f"This run: SP={parallel.get('sp')}, VAE ranks={parallel.get('vae_ranks')}, mode "
             f"{cfg.get('runtime', {}).get('mode')}, {view.label}. Production: 4 GPUs, SP=4 + 4 VAE ranks sharing "
             "them, compiled, Case D.")
    return head + [setup, ""] + P.render_rows(rows) + [""]


PLOT_TITLES = {
    "intervals.png": "Steady delivery intervals per boundary (a strip of every sample when n is small)",
    "intervals_cdf.png": "CDF of steady intervals per boundary",
    "stages_per_chunk.png": "Per-chunk stage P50s, stacked, with the P50 interval marked",
    "timeline.png": "One measured session, every process that timed a stage",
    "ttfc.png": "Time to first chunk (P50 as in the TTFC table; whiskers min–max)",
    SLOWEST_PLOT: "Slowest steady intervals, broken down by stage",
}


def render_md(views: Sequence[RunView], plots: Sequence[Plotted], out: Path, production: bool = False,
              bench: dict | None = None) -> str:
    """Headlines under their settings, the plots, the tables, then the definitions used."""
    labels = unique_labels(views)
    lines = ["# harness report", "", "Runs: " + ", ".join(f"**{l}**" for l in labels), "", "## headline", ""]
    for v, l in zip(views, labels):
        lines += headline_section(v, l)
    lines += ["## plots", ""]
    for p in (x.path for x in plots):
        rel = p.relative_to(out) if p.is_relative_to(out) else p
        lines += [f"### {PLOT_TITLES.get(p.name, p.name)}", "", f"![{p.stem}]({rel.as_posix()})", ""]
    for v, l in zip(views, labels):
        lines += run_section(v, l)
        if production:
            lines += production_section(v, bench)
    return "\n".join(lines + definitions_section(used_figures(views, production)))


def render_report(run_dirs: Sequence[str | Path], out: str | Path | None = None, production: bool = False,
                  bench: dict | None = None) -> list[Path]:
    """Render the plots and ``report.md`` (in ``out``, default the first run directory); returns
    every file written, ``report.md`` first."""
    if not run_dirs:
        raise ValueError("report needs at least one run directory")
    views = [load_view(d) for d in run_dirs]
    out = Path(out) if out else Path(run_dirs[0])
    plots = render_plots(views, out)
    path = out / "report.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(render_md(views, plots, out, production, bench))
    tmp.replace(path)
    return [path, *(p.path for p in plots)]


def write_report(run_dirs: Sequence[str | Path], out: str | Path | None = None, production: bool = False,
                 bench: dict | None = None) -> Path:
    """``render_report``, returning the path of ``report.md``."""
    return render_report(run_dirs, out, production, bench)[0]


def main(args) -> int:
    try:
        bench = json.loads(read_bounded(args.bench, MAX_JSON_BYTES, "bench-engine --json result")) if args.bench else None
        if bench is not None and not {"flops", "peak_bf16_tflops", "peak_tf32_tflops"} <= set(bench):
            raise HarnessError(f"{args.bench} is not a GPU bench-engine --json result (no FLOPs or measured peaks)")
        written = render_report(args.runs, args.out, args.against_production or bench is not None, bench)
    except (OSError, ValueError) as e:  # msgspec decode errors are ValueErrors too
        raise HarnessError(str(e).splitlines()[0]) from None
    for p in written:
        print(f"wrote {p}")
    return 0
