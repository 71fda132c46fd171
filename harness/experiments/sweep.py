"""``python -m harness sweep``: a grid of ``load`` runs, one table and a Pareto plot.

The grid is the product of the axes given (``--rates`` Poisson rates in sessions per minute ×
``--replicas`` × ``--candidate`` sets × ``--size``; an axis not given has one value: the server's
default). Every point is a ``load`` run directory under the sweep directory (``points/NN-…``),
started with its own server (``--connect``: one server for every point, which then only varies the
rate). Every point's plan is built and checked before the first one runs, so a bad value anywhere
is refused before anything starts. The sweep writes ``sweep.json`` (one row per point),
``sweep.md`` (the table, figure labels from ``measure.figures``) and ``pareto.png``: goodput per
GPU (per replica when the points ran on the CPU, which holds no GPU) against the cost axis (TTFC P50, or the delivery interval's P99), the points no other point
dominates (``measure.pareto.pareto_front``) marked and joined.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import itertools
import json
import sys
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import msgspec

from harness.drivers.rundir import command_line, new_run_dir, release_reserve, versions, write_json
from harness.errors import HarnessError
from harness.experiments import load as L
from harness.measure.figures import define, label
from harness.measure.goodput import per_gpu, per_replica
from harness.measure.pareto import pareto_front

X_AXES = {"ttfc": ("load_ttfc", "TTFC P50 incl. queue (ms)"), "p99": ("interval_p99", "interval P99 at delivered (ms)")}


class Point(msgspec.Struct, kw_only=True):
    name: str
    rate_per_min: float
    replicas: int | None
    candidates: list[str]
    size: str | None
    run_dir: str = ""
    status: str = ""
    outcomes: dict[str, int] = {}
    offered_per_min: float | None = None
    served_per_min: float | None = None
    goodput_per_min: float | None = None
    goodput_low: float | None = None
    goodput_high: float | None = None
    goodput_per_replica: float | None = None
    #: None on a CPU run (it holds no GPU) and with --connect (the server's GPUs are not known here)
    goodput_per_gpu: float | None = None
    device: str | None = None
    ttfc_p50_ms: float | None = None
    interval_p99_ms: float | None = None
    stopped_early: bool = False
    pareto: bool = False


def _list(text: str, cast, flag: str) -> list:
    try:
        vals = [cast(x) for x in text.split(",") if x.strip()] if text else []
    except ValueError:
        raise HarnessError(f"{flag} {text!r}: expected comma-separated numbers") from None
    if any(not v > 0 for v in vals):
        raise HarnessError(f"{flag} {text!r}: every value must be positive")
    return vals


def _size(text: str) -> list[str]:
    w, x, h = text.lower().partition("x")
    if not x or not w.isdigit() or not h.isdigit():
        raise HarnessError(f"--size {text!r}: expected WIDTHxHEIGHT, e.g. 128x64")
    return ["--set", f"video.width={int(w)}", "--set", f"video.height={int(h)}"]


def grid(args) -> list[Point]:
    rates = _list(args.rates, float, "--rates")
    if not rates:
        raise HarnessError("--rates: give at least one Poisson rate (sessions per minute)")
    replicas = _list(args.replicas, int, "--replicas") or [None]
    cands = [[] if c == "none" else [x for x in c.split("+") if x] for c in args.candidate] or [[]]
    sizes = args.size or [None]
    if args.connect and (args.replicas or args.candidate or args.size):
        raise HarnessError("--replicas, --candidate and --size restart the server per point: not with --connect")
    for s in sizes:
        if s is not None:
            _size(s)
    pts = []
    for k, (r, n, c, s) in enumerate(itertools.product(rates, replicas, cands, sizes)):
        name = "-".join([f"{k:02d}", f"r{r:g}"] + ([f"x{n}"] if n else []) + (["+".join(c)] if c else []) + ([s] if s else []))
        pts.append(Point(name=name, rate_per_min=r, replicas=n, candidates=c, size=s))
    return pts


def point_args(args, p: Point, out: Path) -> argparse.Namespace:
    """The ``load`` command line of one point."""
    size = _size(p.size) if p.size else []
    sets = list(args.set) + [size[i + 1] for i in range(0, len(size), 2)]
    return argparse.Namespace(
        connect=args.connect, api=args.api, arrivals=f"poisson:{p.rate_per_min:g}", seed=args.seed, duration=args.duration,
        sessions=args.sessions, max_concurrency=args.max_concurrency, chunks=args.chunks, slo=args.slo,
        early_stop=args.early_stop, queue_timeout=args.queue_timeout, session_timeout=args.session_timeout, slice=None,
        out=str(out / "points" / p.name), overwrite=False, preset=args.preset, set=sets if not args.connect else [],
        candidate=p.candidates, replicas=p.replicas, serve_args=args.serve_args if not args.connect else "")


def fill(p: Point, run_dir: Path, summary: dict, gpus_per_replica: int) -> None:
    ld = summary.get("load") or {}
    g = ld.get("goodput") or {}
    p.run_dir, p.status = str(run_dir), summary.get("status", "")
    p.outcomes, p.offered_per_min, p.served_per_min = ld.get("outcomes", {}), ld.get("offered_per_min"), ld.get("served_per_min")
    p.goodput_per_min, p.goodput_low, p.goodput_high = g.get("per_min"), g.get("low"), g.get("high")
    p.device = server_device(run_dir)
    p.goodput_per_replica = per_replica(p.goodput_per_min, p.replicas or 1)
    p.goodput_per_gpu = per_gpu(p.goodput_per_min, p.replicas or 1, gpus_per_replica, p.device)
    p.ttfc_p50_ms = ld.get("ttfc_p50_ms")
    p.interval_p99_ms = ((summary.get("boundaries") or {}).get(L.REFERENCE) or {}).get("intervals", {}).get("p99_ms")
    p.stopped_early = bool(ld.get("stopped_early"))


def server_device(run_dir: Path) -> str | None:
    """The device of the server a point started (its manifest's config); None with --connect."""
    try:
        return json.loads((run_dir / "server" / "manifest.json").read_text())["config"]["runtime"]["device"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def y_figure(points: list[Point]) -> str:
    """Goodput per GPU when every point ran on GPUs, else per replica (a CPU replica holds no GPU)."""
    return "sweep_goodput_per_gpu" if points and all(p.goodput_per_gpu is not None for p in points
                                                      if p.goodput_per_min is not None) else "sweep_goodput_per_replica"


def y_value(p: Point, figure: str) -> float | None:
    return p.goodput_per_gpu if figure == "sweep_goodput_per_gpu" else p.goodput_per_replica


def cost(p: Point, x_axis: str) -> float | None:
    return p.ttfc_p50_ms if x_axis == "ttfc" else p.interval_p99_ms


def mark_front(points: list[Point], x_axis: str) -> None:
    y = y_figure(points)
    front = set(pareto_front([(cost(p, x_axis), y_value(p, y)) for p in points]))
    for i, p in enumerate(points):
        p.pareto = i in front


def _f(v, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def table_md(points: list[Point]) -> list[str]:
    heads = ["point", "rate /min", "replicas", "candidates", "size", "outcomes", label("load_offered") + " /min",
             label("load_served") + " /min", label("load_goodput") + " /min [95 %]", label("sweep_goodput_per_replica"),
             label("sweep_goodput_per_gpu"),
             label("load_ttfc") + " P50", label("interval_p99") + " (delivered)", "stopped early", label("sweep_pareto")]
    rows = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for p in points:
        oc = ", ".join(f"{k} {v}" for k, v in p.outcomes.items() if v)
        rows.append("| " + " | ".join([
            p.name, f"{p.rate_per_min:g}", str(p.replicas or 1), "+".join(p.candidates) or "baseline", p.size or "preset",
            oc or p.status, _f(p.offered_per_min), _f(p.served_per_min),
            f"{_f(p.goodput_per_min)} [{_f(p.goodput_low)}, {_f(p.goodput_high)}]", _f(p.goodput_per_replica),
            _f(p.goodput_per_gpu),
            _f(p.ttfc_p50_ms, "{:.0f}"), _f(p.interval_p99_ms, "{:.0f}"), "yes" if p.stopped_early else "no",
            "★" if p.pareto else ""]) + " |")
    return rows


def plot(points: list[Point], x_axis: str, path: Path, title: str) -> None:
    matplotlib.use("Agg", force=True)  # headless: never needs a display
    fig, ax = plt.subplots(figsize=(7, 4.5))
    fig_y = y_figure(points)
    ok = [p for p in points if cost(p, x_axis) is not None and y_value(p, fig_y) is not None]
    for p in ok:
        y = y_value(p, fig_y)
        scale = y / p.goodput_per_min if p.goodput_per_min else 1.0  # the interval scaled as the point
        lo, hi = (p.goodput_low or 0) * scale, (p.goodput_high or 0) * scale
        ax.errorbar(cost(p, x_axis), y, yerr=[[y - lo], [hi - y]],
                    fmt="o", color="tab:red" if p.pareto else "tab:gray", capsize=3)
        ax.annotate(p.name, (cost(p, x_axis), y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    front = sorted((p for p in ok if p.pareto), key=lambda p: cost(p, x_axis))
    if front:
        ax.plot([cost(p, x_axis) for p in front], [y_value(p, fig_y) for p in front], "--*", color="tab:red",
                markersize=12, label="not dominated (Pareto)")
        ax.legend(loc="best", fontsize=8)
    ax.set_xlabel(X_AXES[x_axis][1] + " — lower is better")
    ax.set_ylabel(f"{label(fig_y)} ({define(fig_y).unit}, 95 % CI)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.margins(x=0.15, y=0.1)  # room for the points' names
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    points = grid(args)
    if args.gpus_per_replica < 1:
        raise HarnessError(f"--gpus-per-replica must be ≥ 1, got {args.gpus_per_replica}")
    if args.out is not None and not args.out.strip():
        raise HarnessError(f"--out {args.out!r} is empty; name a directory, or leave --out out for runs/<run_id>")
    probe = Path(args.out or "sweep")
    plans = [L.plan_from_args(point_args(args, p, probe)) for p in points]  # every point checked before any runs
    out = new_run_dir(args.out, "sweep", args.overwrite)
    man = {"command": command_line(sys.argv), "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
           "status": "running", "sweep": {"points": [p.name for p in points], "x_axis": args.x_axis,
                                          "gpus_per_replica": args.gpus_per_replica}, "versions": versions()}
    write_json(out / "manifest.json", man)
    status, error = "failed", None
    try:
        for p, plan in zip(points, plans):
            print(f"sweep point {p.name}: load --arrivals {plan.arrivals.text}", flush=True)
            run_dir, summary, _ = L.run_load(msgspec.structs.replace(plan, out=str(out / "points" / p.name)))
            fill(p, run_dir, summary, args.gpus_per_replica)
        status = "complete"
    except BaseException as e:
        error = str(e) if isinstance(e, HarnessError) else f"{type(e).__name__}: {e}"
        raise
    finally:
        release_reserve(out)
        for empty in ("media", "outputs"):  # a run directory's, never used by a sweep's own level
            with contextlib.suppress(OSError):
                (out / empty).rmdir()
        mark_front(points, args.x_axis)
        write_json(out / "sweep.json", points)
        lines = table_md(points)
        (out / "sweep.md").write_text("\n".join(["# sweep", "", f"SLO: {args.slo}; cost axis: {X_AXES[args.x_axis][1]}", "",
                                                 *lines, ""]))
        if any(p.run_dir for p in points):
            plot(points, args.x_axis, out / "pareto.png", f"sweep {out.name}: SLO {args.slo}")
        man.update(status=status, error=error, ended=_dt.datetime.now(_dt.timezone.utc).isoformat())
        write_json(out / "manifest.json", man)
    for line in lines:
        print(line)
    print(f"sweep directory: {out}")
    failed = [p for p in points if p.status != "complete"]
    return 1 if failed else 0
