"""A run's figures beside DESIGN §12's production figures, with the ratio to each.

Production: 4 GPUs, SP=4 DiT + 4 VAE ranks sharing them, compiled, Case D, boundary = CPU-ready
uint8. Pure functions over a run's summary and events (and, for MFU, a ``bench-engine`` JSON of
the same preset: its FLOP count of a steady chunk and the GEMM peaks measured on that machine).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from harness.measure import figures as F
from harness.measure import metrics as M
from harness.measure.stats import nearest_rank
from harness.measure.events import ChunkEvent, SessionStart


class Figure(msgspec.Struct, frozen=True):
    lo: float
    hi: float  # = lo unless production reported a range
    better: Literal["higher", "lower"]

    @property
    def mid(self) -> float:
        return (self.lo + self.hi) / 2


def _f(lo: float, hi: float | None = None, better: Literal["higher", "lower"] = "lower") -> Figure:
    return Figure(lo, lo if hi is None else hi, better)


#: DESIGN §12, by (height, width); MFU as fractions.
PRODUCTION: dict[tuple[int, int], dict[str, Figure]] = {
    (480, 832): {
        "fps": _f(14.4, 14.6, "higher"), "dit_ms": _f(678), "vae_segment_ms": _f(169), "decode_ms": _f(142),
        "handoff_ms": _f(16), "ipc_ms": _f(15.8), "all_gpu_idle_ms": _f(58), "dit_mfu": _f(0.49, better="higher"),
        "vae_mfu": _f(0.145, better="higher"), "ttfc_ms": _f(2380), "p99_ms": _f(838, 866),
    },
    (704, 1280): {
        "fps": _f(4.87, 4.89, "higher"), "dit_ms": _f(2138), "vae_segment_ms": _f(338), "decode_ms": _f(290),
        "handoff_ms": _f(32), "ipc_ms": _f(33.7), "all_gpu_idle_ms": _f(59), "dit_mfu": _f(0.53, better="higher"),
        "vae_mfu": _f(0.159, better="higher"), "p99_ms": _f(2476, 2665),
    },
}

#: Row key → the figure (``measure.figures``) whose label the row carries.
FIGURE_OF = {
    "fps": "fps_mean", "dit_ms": "dit_p50", "vae_segment_ms": "vae_segment_p50", "decode_ms": "decode_p50",
    "handoff_ms": "handoff_p50", "ipc_ms": "ipc_p50", "all_gpu_idle_ms": "all_gpu_idle_p50", "dit_mfu": "dit_mfu",
    "vae_mfu": "vae_mfu", "ttfc_ms": "ttfc_p50", "p99_ms": "interval_p99",
}
#: The table's columns, by figure name.
COLUMNS = ("prod_figure", "prod_ours", "prod_value", "prod_ratio", "prod_advantage", "prod_note")


def row_label(key: str, scheduler: str | None = None, at: str | None = None) -> str:
    """The row's label: its figure's (per scheduler), and the boundary it is taken at."""
    return F.label(FIGURE_OF[key], scheduler) + (f" @ {at}" if at else "")


class Row(msgspec.Struct, frozen=True):
    key: str
    label: str
    ours: float | None
    production: Figure | None
    #: ours ÷ production (midpoint of a range); None without both figures
    ratio: float | None
    #: how many times better ours is (> 1 = better, in the figure's own direction)
    advantage: float | None
    note: str = ""


def mfu(flops: float, ms: float, peak_tflops: float, n_gpus: int) -> float:
    """FLOPs of one chunk done in ``ms`` on ``n_gpus`` GPUs of ``peak_tflops`` each."""
    return flops / (ms / 1e3) / (peak_tflops * 1e12 * n_gpus)


def row(key: str, ours: float | None, production: Figure | None, label: str | None = None, note: str = "") -> Row:
    ratio = advantage = None
    if ours is not None and production is not None and production.mid > 0 and ours > 0:
        ratio = ours / production.mid
        advantage = ratio if production.better == "higher" else 1 / ratio
    return Row(key, label or row_label(key), ours, production, ratio, advantage, note)


def _p50_ms(ns: list[int]) -> float | None:
    return nearest_rank(ns, 50) / 1e6 if ns else None


def production_rows(summary: dict, events: list[ChunkEvent], sessions: list[SessionStart], window: M.Window,
                    resolution: tuple[int, int], parallel: dict, bench: dict | None = None,
                    scheduler: str | None = None) -> list[Row]:
    """The §12 table's rows for one run (``summary`` as written to summary.json); ``scheduler``
    names the handoff row as the run's report does."""
    prod = PRODUCTION.get(resolution, {})
    b = summary.get("boundaries", {})
    st = summary.get("stages", {})

    def stage(name: str) -> float | None:
        return st[name]["durations"]["p50_ms"] if name in st and st[name]["durations"]["n"] else None

    rows = [row("fps", b[k]["fps_mean"], prod.get("fps"), row_label("fps", at=k))
            for k in ("cpu_ready", "encoded", "delivered") if k in b and b[k].get("fps_mean")]
    rows.append(row("dit_ms", stage("dit"), prod.get("dit_ms")))
    steady, _, _ = M.steady_chunks(events, sessions, window)
    seg = [e.cpu_ready - e.latent_ready for e in steady if e.cpu_ready is not None and e.latent_ready is not None]
    rows.append(row("vae_segment_ms", _p50_ms(seg), prod.get("vae_segment_ms")))
    rows.append(row("decode_ms", stage("decode"), prod.get("decode_ms")))
    ho = summary.get("handoff", {})
    ho_ms = ho.get("p50_ms") if ho.get("n") else None
    rows.append(row("handoff_ms", ho_ms, prod.get("handoff_ms"), row_label("handoff_ms", scheduler),
                    note="negative: DiT i started before chunk i−1 was CPU-ready (Case E)" if ho_ms is not None and ho_ms < 0 else ""))
    rows.append(row("ipc_ms", stage("ipc"), prod.get("ipc_ms")))
    idle = [x.ns for x in M.all_gpu_idle(events, window, sessions).samples]
    rows.append(row("all_gpu_idle_ms", _p50_ms(idle), prod.get("all_gpu_idle_ms"),
                    note="host-observed spans"))
    gpu = summary.get("gpu_ms", {})
    need = "needs --bench (bench-engine --json of the same preset)"
    if bench and "dit" in gpu:
        rows.append(row("dit_mfu", mfu(bench["flops"]["dit_flops"], gpu["dit"]["p50_ms"], bench["peak_bf16_tflops"],
                                       parallel.get("sp", 1)), prod.get("dit_mfu"), note="GPU-event time"))
    else:
        rows.append(row("dit_mfu", None, prod.get("dit_mfu"), note=need if not bench else "no DiT GPU time in the run"))
    if bench and "decode" in gpu:
        rows.append(row("vae_mfu", mfu(bench["flops"]["vae_conv_flops"], gpu["decode"]["p50_ms"], bench["peak_tf32_tflops"],
                                       parallel.get("vae_ranks", 1)), prod.get("vae_mfu"), note="GPU-event time"))
    else:
        rows.append(row("vae_mfu", None, prod.get("vae_mfu"), note=need if not bench else "no decode GPU time in the run"))
    tt = summary.get("ttfc", {}).get("cpu_ready", {})
    rows.append(row("ttfc_ms", tt.get("p50_ms") if tt.get("n") else None, prod.get("ttfc_ms"), row_label("ttfc_ms", at="cpu_ready")))
    p99 = b.get("cpu_ready", {})
    ci = p99.get("p99_ci_ms")
    rows.append(row("p99_ms", p99.get("intervals", {}).get("p99_ms"), prod.get("p99_ms"), row_label("p99_ms", at="cpu_ready"),
                    note=(f"95 % CI [{ci[0]:.1f}, {ci[1]:.1f}]" if ci else "")
                    + (" (= max: < 100 samples)" if p99.get("intervals", {}).get("p99_is_max") else "")))
    return rows


def _num(x: float | None, key: str) -> str:
    if x is None:
        return "—"
    if key.endswith("mfu"):
        return f"{x:.1%}"
    return f"{x:.2f}" if key == "fps" or abs(x) < 10 else f"{x:.1f}"


def _fig(f: Figure | None, key: str) -> str:
    if f is None:
        return "—"
    return _num(f.lo, key) if f.lo == f.hi else f"{_num(f.lo, key)}–{_num(f.hi, key)}"


def render_rows(rows: list[Row]) -> list[str]:
    """The table, its columns labelled from ``measure.figures`` (the resolution is the section's)."""
    lines = F.header(COLUMNS)
    for r in rows:
        lines.append(f"| {r.label} | {_num(r.ours, r.key)} | {_fig(r.production, r.key)} | "
                     f"{'—' if r.ratio is None else f'{r.ratio:.3f}'} | "
                     f"{'—' if r.advantage is None else f'{r.advantage:.2f}×'} | {r.note} |")
    return lines
