"""``report``: ``report.md`` with the summary tables and PNG plots of one or more run directories.

Plots (matplotlib, Agg backend: headless, no display needed):

- ``intervals_hist.png`` / ``intervals_cdf.png``: steady delivery intervals per boundary, runs overlaid.
- ``stages_per_chunk.png``: per chunk index, the median of every segment of ``metrics.SEGMENTS``
  over the measured sessions, stacked; one panel per run, side by side (Case D vs Case E).
- ``timeline.png``: one measured session as a Gantt chart, one lane per process (DiT rank 0,
  VAE rank 0, IPC, encoder, sink); one panel per run.
- ``ttfc.png``: TTFC per boundary (median, with min–max whiskers over sessions), runs grouped.

The figures come from small pure functions over the event table (``ecdf``, ``per_chunk_stages``,
``timeline_bars``, ``ttfc_by_boundary``) so that what is drawn can be tested without drawing it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import msgspec
import numpy as np

from harness.limits import MAX_JSON_BYTES, read_bounded
from harness.measure import metrics as M
from harness.measure.events import BOUNDARIES, ChunkEvent, SessionStart, read_run
from harness.measure.summary import SUMMARY_FILE, build_summary

PLOT_BOUNDARIES: tuple[str, ...] = ("cpu_ready", "encoded", "delivered")
#: Gantt lanes: the process that spends each segment (ipc is the hop into the encoder process).
LANES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("DiT rank 0", ("dit",)),
    ("VAE rank 0", ("decode", "convert", "d2h")),
    ("IPC", ("ipc",)),
    ("encoder", ("encode",)),
    ("sink", ("sink",)),
)
PLOTS: tuple[str, ...] = ("intervals_hist.png", "intervals_cdf.png", "stages_per_chunk.png", "timeline.png", "ttfc.png")
DPI = 100


class RunView(msgspec.Struct, frozen=True):
    label: str
    dir: str
    events: list[ChunkEvent]
    sessions: list[SessionStart]
    summary: dict
    window: M.Window
    manifest: dict = {}


class Bar(msgspec.Struct, frozen=True):
    lane: str
    stage: str
    chunk: int
    start_ms: float
    dur_ms: float


# ---- loading -------------------------------------------------------------------------------


def run_label(manifest: dict, run_dir: str) -> str:
    """"case-d", "case-e +H5a" …; the directory name when there is no manifest."""
    if not manifest:
        return Path(run_dir).name
    cands = manifest.get("candidates") or []
    return manifest.get("scheduler", "?") + (f" +{'+'.join(cands)}" if cands else "")


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
        summary = json.loads(read_bounded(d / SUMMARY_FILE, MAX_JSON_BYTES, "summary"))
    else:
        chunks = manifest.get("config", {}).get("video", {}).get("chunks_per_session")
        window = M.window_for(chunks) if chunks else M.DEFAULT_WINDOW
        summary = msgspec.to_builtins(build_summary(events, sessions, window=window))
    labels = run_label(manifest, str(d))
    return RunView(labels, str(d), events, sessions, summary, window_of(summary), manifest)


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
    """chunk index → segment → median ms over measured, non-cancelled sessions (negative
    segments, an ordering fault, are left out rather than drawn below the axis)."""
    acc: dict[int, dict[str, list[int]]] = {}
    for e in M.measured_chunks(events, sessions, window, include_cancelled=False):
        for name, d in M.stage_durations(e).items():
            if d >= 0:
                acc.setdefault(e.chunk, {}).setdefault(name, []).append(d)
    return {c: {n: float(np.median(v)) / 1e6 for n, v in st.items()} for c, st in sorted(acc.items())}


def pick_session(events: Sequence[ChunkEvent], sessions: Sequence[SessionStart], window: M.Window) -> tuple[int, int] | None:
    """The first measured, non-cancelled session with chunks (run order); else any session with chunks."""
    table = M.session_table(events)
    cancelled = M.cancelled_keys(events, sessions)
    order = sorted(table, key=lambda k: (k[1], k[0]))
    for k in order:
        if window.measured(k[1]) and k not in cancelled:
            return k
    return order[0] if order else None


def timeline_bars(events: Sequence[ChunkEvent], sessions: Sequence[SessionStart], key: tuple[int, int]) -> list[Bar]:
    """Every lane's segments of one session, in ms from its start (or its first submit)."""
    chunks = M.session_table(events).get(key, {})
    start = {s.key: s.start_ns for s in sessions}.get(key)
    if start is None:
        firsts = [t for e in chunks.values() for t in e.present().values()]
        start = min(firsts) if firsts else 0
    seg = {name: (a, b) for name, a, b in M.SEGMENTS}
    out = []
    for c in sorted(chunks):
        e = chunks[c]
        for lane, stages in LANES:
            for st in stages:
                a, b = e.at(seg[st][0]), e.at(seg[st][1])
                if a is not None and b is not None and b >= a:
                    out.append(Bar(lane, st, c, (a - start) / 1e6, (b - a) / 1e6))
    return out


def ttfc_by_boundary(events: Sequence[ChunkEvent], sessions: Sequence[SessionStart], window: M.Window) -> dict[str, tuple[float, float, float]]:
    """boundary → (median, min, max) TTFC in ms over measured sessions, boundaries in data-flow order."""
    out = {}
    if not sessions:
        return out
    for b in M.boundaries_seen(events):
        v = M.ttfc(events, sessions, b, window).ns() / 1e6
        if v.size:
            out[b] = (float(np.median(v)), float(v.min()), float(v.max()))
    return out


# ---- plots ---------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)  # headless: never needs a display
    import matplotlib.pyplot as plt

    return plt


def _stage_colors() -> dict[str, tuple]:
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    return {name: cmap(i % 20) for i, name in enumerate(M.SEGMENT_NAMES)}


def _empty(ax, text: str = "no samples") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, bbox_inches="tight")  # keeps legends placed outside the axes
    _plt().close(fig)
    return path


def plot_intervals(views: Sequence[RunView], labels: Sequence[str], path: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, len(PLOT_BOUNDARIES), figsize=(4.2 * len(PLOT_BOUNDARIES), 3.6), squeeze=False)
    for ax, b in zip(axes[0], PLOT_BOUNDARIES):
        data = [(steady_ms(v, b), l) for v, l in zip(views, labels)]
        data = [(x, l) for x, l in data if x.size]
        if data:
            lo, hi = min(x.min() for x, _ in data), max(x.max() for x, _ in data)
            bins = np.linspace(lo, hi if hi > lo else lo + 1, 21)
            for x, l in data:
                ax.hist(x, bins=bins, alpha=0.55, label=f"{l} (n={x.size})")
            ax.legend(fontsize=7)
        else:
            _empty(ax)
        ax.set_title(f"steady interval @ {b}")
        ax.set_xlabel("ms")
        ax.set_ylabel("intervals")
    return _save(fig, path)


def plot_cdf(views: Sequence[RunView], labels: Sequence[str], path: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, len(PLOT_BOUNDARIES), figsize=(4.2 * len(PLOT_BOUNDARIES), 3.6), squeeze=False)
    for ax, b in zip(axes[0], PLOT_BOUNDARIES):
        drawn = False
        for v, l in zip(views, labels):
            x, y = ecdf(steady_ms(v, b))
            if x.size:
                ax.step(np.r_[x[0], x], np.r_[0.0, y], where="post", label=l)  # rises from 0 at the minimum
                drawn = True
        if drawn:
            ax.legend(fontsize=7)
            ax.set_ylim(0, 1.02)
        else:
            _empty(ax)
        ax.set_title(f"CDF of steady interval @ {b}")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction ≤ x")
        ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_stages(views: Sequence[RunView], labels: Sequence[str], path: Path) -> Path:
    plt = _plt()
    colors = _stage_colors()
    fig, axes = plt.subplots(1, len(views), figsize=(5.5 * len(views), 4.2), squeeze=False, sharey=True)
    for ax, v, l in zip(axes[0], views, labels):
        table = per_chunk_stages(v.events, v.sessions, v.window)
        if not table:
            _empty(ax)
        chunks = list(table)
        bottom = np.zeros(len(chunks))
        for name in M.SEGMENT_NAMES:
            h = np.array([table[c].get(name, 0.0) for c in chunks])
            if h.any():
                ax.bar(chunks, h, bottom=bottom, color=colors[name], label=name, width=0.8)
                bottom += h
        ax.set_title(f"{l}: median stage time per chunk")
        ax.set_xlabel("chunk")
        ax.set_ylabel("ms (submit → delivered)")
        if chunks:
            ax.set_xticks(chunks)
    handles, names = [], []
    for ax in axes[0]:  # one legend for all panels, outside them, so no bar is hidden
        for h, n in zip(*ax.get_legend_handles_labels()):
            if n not in names:
                handles.append(h)
                names.append(n)
    if handles:
        order = sorted(range(len(names)), key=lambda i: M.SEGMENT_NAMES.index(names[i]))
        axes[0][-1].legend([handles[i] for i in order], [names[i] for i in order], fontsize=7,
                           loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def plot_timeline(views: Sequence[RunView], labels: Sequence[str], path: Path) -> Path:
    plt = _plt()
    colors = _stage_colors()
    fig, axes = plt.subplots(len(views), 1, figsize=(11, 2.6 * len(views) + 0.6), squeeze=False)
    lanes = [name for name, _ in LANES]
    for ax, v, l in zip(axes[:, 0], views, labels):
        key = pick_session(v.events, v.sessions, v.window)
        bars = timeline_bars(v.events, v.sessions, key) if key else []
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
        ax.set_yticklabels(lanes)
        ax.invert_yaxis()
        title = f"{l}: session {key[0]} (epoch {key[1]})" if key else l
        ax.set_title(f"{title} — chunk index on the bars")
        ax.set_xlabel("ms since session start")
        if seen:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def plot_ttfc(views: Sequence[RunView], labels: Sequence[str], path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 3.8))
    data = [ttfc_by_boundary(v.events, v.sessions, v.window) for v in views]
    bounds = [b for b in BOUNDARIES if any(b in d for d in data)]
    if not bounds:
        _empty(ax, "no TTFC (no session starts or measured sessions)")
    width = 0.8 / max(len(views), 1)
    x = np.arange(len(bounds))
    for i, (d, l) in enumerate(zip(data, labels)):
        med = np.array([d[b][0] if b in d else np.nan for b in bounds])
        lo = np.array([d[b][0] - d[b][1] if b in d else 0 for b in bounds])
        hi = np.array([d[b][2] - d[b][0] if b in d else 0 for b in bounds])
        ax.bar(x + i * width - 0.4 + width / 2, med, width, yerr=[lo, hi], capsize=2, label=l)
    ax.set_xticks(x)
    ax.set_xticklabels(bounds, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms from session start")
    ax.set_title("time to first chunk per boundary (median; whiskers: min–max over sessions)")
    if bounds:
        ax.legend(fontsize=8)
    return _save(fig, path)


def render_plots(views: Sequence[RunView], out: Path) -> list[Path]:
    labels = unique_labels(views)
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_intervals(views, labels, out / PLOTS[0]),
        plot_cdf(views, labels, out / PLOTS[1]),
        plot_stages(views, labels, out / PLOTS[2]),
        plot_timeline(views, labels, out / PLOTS[3]),
        plot_ttfc(views, labels, out / PLOTS[4]),
    ]


# ---- markdown ------------------------------------------------------------------------------


def _f(x, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def _ci(ci) -> str:
    return "—" if not ci else f"[{ci[0]:.1f}, {ci[1]:.1f}]"


def run_section(view: RunView, label: str) -> list[str]:
    s = view.summary
    h = s.get("headline", {})
    w = s.get("window", {})
    lines = [
        f"## {label}",
        "",
        f"`{view.dir}` — status {s.get('status', '?')}, valid {s.get('valid', '?')}"
        + (f", flags: {', '.join(s['flags'])}" if s.get("flags") else ""),
        "",
        f"Headline @ {h.get('boundary', '?')}: steady FPS {_f(h.get('fps_steady'), '{:.2f}')}, "
        f"interval P50 {_f(h.get('p50_ms'))} ms, P99 {_f(h.get('p99_ms'))} ms"
        + (" (= max, < 100 samples)" if h.get("p99_is_max") else "")
        + f", TTFC P50 {_f(h.get('ttfc_p50_ms'))} ms, n = {h.get('n', 0)}.",
        "",
        f"Window: {w.get('definition', '?')}. Percentiles: {w.get('percentile_rule', '?')}.",
        "",
        "| boundary | n | sessions | P50 ms | P50 95 % CI | P99 ms | P99 95 % CI | max ms | FPS steady |",
        "|---|---:|---:|---:|---|---:|---|---:|---:|",
    ]
    for b, bs in s.get("boundaries", {}).items():
        iv = bs["intervals"]
        lines.append(f"| {b} | {iv['n']} | {bs['n_sessions']} | {_f(iv['p50_ms'])} | {_ci(bs['p50_ci_ms'])} | "
                     f"{_f(iv['p99_ms'])}{'*' if iv['p99_is_max'] else ''} | {_ci(bs['p99_ci_ms'])} | {_f(iv['max_ms'])} | "
                     f"{_f(bs['fps_steady'], '{:.2f}')} |")
    lines += ["", "\\* P99 is the maximum (fewer than 100 samples).", "",
              "| TTFC @ | n | P50 ms | min ms | max ms |", "|---|---:|---:|---:|---:|"]
    for b, d in s.get("ttfc", {}).items():
        lines.append(f"| {b} | {d['n']} | {_f(d['p50_ms'])} | {_f(d['min_ms'])} | {_f(d['max_ms'])} |")
    lines += ["", "| stage | from → to | n | P50 ms | mean ms | share | of interval |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, st in s.get("stages", {}).items():
        d = st["durations"]
        lines.append(f"| {name} | {st['start']} → {st['end']} | {d['n']} | {_f(d['p50_ms'], '{:.2f}')} | "
                     f"{_f(d['mean_ms'], '{:.2f}')} | {_f(st['share'], '{:.1%}')} | {_f(st['share_of_interval'], '{:.1%}')} |")
    ho = s.get("handoff", {})
    if ho.get("n"):
        lines += ["", f"Handoff cpu_ready(i−1) → dit_start(i): P50 {_f(ho['p50_ms'], '{:.2f}')} ms (n = {ho['n']})."]
    if s.get("blocked"):
        lines += ["", "| blocked stage | total ms | max ms | chunks blocked |", "|---|---:|---:|---:|"]
        for k, bl in s["blocked"].items():
            lines.append(f"| {k} | {_f(bl['total_ms'])} | {_f(bl['max_ms'])} | {bl['chunks_blocked']} / {bl['chunks']} |")
    lt = s.get("long_tail")
    if lt and lt.get("slowest"):
        lines += ["", f"### slowest steady intervals @ {lt['reference']}", "",
                  "| # | epoch | chunk | interval ms | +vs median | grew | first late |", "|---:|---:|---:|---:|---:|---|---|"]
        for x in lt["slowest"]:
            lines.append(f"| {x['rank']} | {x['epoch']} | {x['chunk']} | {x['interval_ms']:.1f} | {x['excess_ms']:+.1f} | "
                         f"{x['grew'] or '—'} | {x['first_late'] or '—'} |")
    lines.append("")
    return lines


def production_section(view: RunView, bench: dict | None) -> list[str]:
    """The run beside DESIGN §12 (``measure.production``), resolution and ranks from its manifest."""
    from harness.measure import production as P

    cfg = view.manifest.get("config", {})
    video, parallel = cfg.get("video", {}), cfg.get("parallel", {})
    res = (video.get("height"), video.get("width"))
    head = ["### against the production figures (DESIGN §12)", ""]
    if res not in P.PRODUCTION:
        return head + [f"No production figures for {res[0]}×{res[1]} (DESIGN §12 has 480×832 and 704×1280).", ""]
    layers = cfg.get("model", {}).get("num_layers")
    if bench is not None and (bench.get("preset"), bench.get("layers", layers)) != (cfg.get("name"), layers):
        return head + [f"--bench is for {bench.get('preset')!r} with {bench.get('layers')} layers, this run is "
                       f"{cfg.get('name')!r} with {layers}: its FLOPs do not apply, so no table.", ""]
    rows = P.production_rows(view.summary, view.events, view.sessions, view.window, res, parallel, bench)
    setup = (f"This run: SP={parallel.get('sp')}, VAE ranks={parallel.get('vae_ranks')}, mode "
             f"{cfg.get('runtime', {}).get('mode')}, {view.label}. Production: 4 GPUs, SP=4 + 4 VAE ranks sharing "
             "them, compiled, Case D.")
    return head + [setup, ""] + P.render_rows(rows, res) + [""]


def render_md(views: Sequence[RunView], plots: Sequence[Path], out: Path, production: bool = False,
              bench: dict | None = None) -> str:
    labels = unique_labels(views)
    lines = ["# harness report", "", "Runs: " + ", ".join(f"**{l}**" for l in labels), ""]
    for v, l in zip(views, labels):
        lines += run_section(v, l)
        if production:
            lines += production_section(v, bench)
    lines += ["## plots", ""]
    titles = {
        "intervals_hist.png": "Steady delivery intervals per boundary",
        "intervals_cdf.png": "CDF of steady intervals per boundary",
        "stages_per_chunk.png": "Per-chunk stage breakdown (median over measured sessions)",
        "timeline.png": "One measured session, per process",
        "ttfc.png": "Time to first chunk",
    }
    for p in plots:
        rel = p.relative_to(out) if p.is_relative_to(out) else p
        lines += [f"### {titles.get(p.name, p.name)}", "", f"![{p.stem}]({rel.as_posix()})", ""]
    return "\n".join(lines)


def write_report(run_dirs: Sequence[str | Path], out: str | Path | None = None, production: bool = False,
                 bench: dict | None = None) -> Path:
    """Render the plots and ``report.md`` (in ``out``, default the first run directory); returns its path."""
    if not run_dirs:
        raise ValueError("report needs at least one run directory")
    views = [load_view(d) for d in run_dirs]
    out = Path(out) if out else Path(run_dirs[0])
    plots = render_plots(views, out)
    path = out / "report.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(render_md(views, plots, out, production, bench))
    tmp.replace(path)
    return path


def main(args) -> int:
    from harness.errors import HarnessError

    try:
        bench = json.loads(read_bounded(args.bench, MAX_JSON_BYTES, "bench-engine --json result")) if args.bench else None
        if bench is not None and not {"flops", "peak_bf16_tflops", "peak_tf32_tflops"} <= set(bench):
            raise HarnessError(f"{args.bench} is not a GPU bench-engine --json result (no FLOPs or measured peaks)")
        path = write_report(args.runs, args.out, args.against_production or bench is not None, bench)
    except (OSError, ValueError) as e:  # msgspec decode errors are ValueErrors too
        raise HarnessError(str(e).splitlines()[0]) from None
    print(f"wrote {path}")
    return 0
