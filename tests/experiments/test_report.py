"""``report``: tables and PNG plots, rendered headless, from hand-built and real run directories."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from harness.cli import main
from harness.measure import figures as F
from harness.measure import metrics as M
from harness.measure import run_report as R
from harness.measure.events import write_events, write_sessions


def open_png(path: Path) -> np.ndarray:
    try:
        from PIL import Image

        return np.asarray(Image.open(path).convert("RGB"))
    except ImportError:  # matplotlib reads PNG without PIL
        import matplotlib.image

        return (matplotlib.image.imread(path)[..., :3] * 255).astype(np.uint8)


def assert_sane_png(path: Path) -> None:
    img = open_png(path)
    h, w = img.shape[:2]
    assert w >= 300 and h >= 200, (path.name, img.shape)
    ink = np.any(img < 200, axis=-1).mean()  # share of pixels that are not (near) white
    assert 0.005 < ink < 0.9, (path.name, ink)  # not blank, not a solid block
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 8, path.name  # more than a few flat colours


def hand_run(d: Path, table, slow) -> Path:
    events, starts = table(slow)
    d.mkdir(parents=True)
    write_events(d / "events.jsonl", events)
    write_sessions(d / "sessions.jsonl", starts)
    return d


def test_report_renders_every_plot_headless_from_hand_built_runs(tmp_path, tables):
    a = hand_run(tmp_path / "a", tables.case_d, {2: {6: {"decode": 50}}})
    b = hand_run(tmp_path / "b", tables.case_d, {3: {7: {"dit": 30}}})
    path = R.write_report([a, b], tmp_path / "out")
    assert path == tmp_path / "out" / "report.md"
    for name in R.PLOTS:
        assert_sane_png(tmp_path / "out" / name)
    md = path.read_text()
    assert md.count("| boundary | n | sessions |") == 2  # one summary table per run
    assert md.count("## figure definitions") == 1  # every column defined once, for all runs
    for name in R.PLOTS:
        assert f"]({name})" in md


def test_report_cli_on_case_d_and_case_e(h5a_compare, capsys):
    _, out, _ = h5a_compare
    a, b = out / "round0-A", out / "round0-B"
    assert main(["report", str(a), str(b)]) == 0
    assert "report.md" in capsys.readouterr().out
    md = (a / "report.md").read_text()
    assert "## case-d" in md and "## case-e +H5a" in md
    for name in R.PLOTS:
        assert_sane_png(a / name)


def test_report_refuses_a_directory_without_events(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no events.jsonl" in capsys.readouterr().err


def test_figure_data(tables):
    events, starts = tables.case_d({2: {6: {"decode": 50}}})
    x, y = R.ecdf([3.0, 1.0, 2.0])
    assert x.tolist() == [1.0, 2.0, 3.0] and y.tolist() == pytest.approx([1 / 3, 2 / 3, 1.0])
    stages = R.per_chunk_stages(events, starts, M.DEFAULT_WINDOW)
    assert sorted(stages) == list(range(10))
    assert stages[6]["decode"] == pytest.approx(30)  # P50 over 3 measured sessions: the stall is one of them
    key = R.pick_session(events, starts, M.DEFAULT_WINDOW)
    assert key == (1, 1)  # the first measured session, not the warm-up
    bars = R.timeline_bars(events, starts, key)  # no manifest: one process of each kind
    assert {b.lane for b in bars} == {"driver", "DiT rank 0", "VAE rank 0", "encoder"}
    manifest = {"config": {"parallel": {"sp": 2, "vae_ranks": 3}}}
    # lanes only for what was timed: ranks >= 1 record nothing, so they get no lane (not copies of rank 0's bars)
    lanes = {b.lane for b in R.timeline_bars(events, starts, key, manifest)}
    assert lanes == {"driver", "DiT rank 0 of 2 (the group, in lockstep)", "VAE rank 0 of 3 (the group, in lockstep)",
                     "encoder"}
    assert [name for name, _ in R.lanes_of(manifest)] == ["driver", *sorted(lanes - {"driver", "encoder"}), "encoder"]
    assert len([b for b in bars if b.stage == "dit"]) == 10
    dit0 = next(b for b in bars if b.stage == "dit" and b.chunk == 0)
    assert dit0.start_ms == pytest.approx(10 + 1) and dit0.dur_ms == pytest.approx(40)
    ttfc = R.ttfc_by_boundary(events, starts, M.DEFAULT_WINDOW)
    assert list(ttfc) == list(M.boundaries_seen(events)) and ttfc["submit"][0] == pytest.approx(10)


def test_all_gpu_idle_counts_the_time_no_chunk_has_gpu_work(tables):
    assert M.uncovered_ns(0, 100, []) == 100
    assert M.uncovered_ns(0, 100, [(10, 30), (20, 40), (90, 200), (-50, 5)]) == 100 - 5 - 30 - 10
    events, starts = tables.case_d({})
    sel = M.all_gpu_idle(events, M.DEFAULT_WINDOW, starts)
    n = tables.NOMINAL
    # Case D: between two cpu_ready, the GPUs wait for the driver's gap and the hops around the DiT
    idle = tables.GAP + n["dit_queue"] + n["latent_ipc"] + n["decode_wait"] + n["decode_queue"]
    assert len(sel.samples) == sel.expected == 3 * 4  # 3 measured sessions × chunks 5-8
    assert {s.ns for s in sel.samples} == {idle * tables.MS}


def test_report_against_production(tmp_path, tables, capsys):
    import json

    import msgspec

    from harness.measure import production as P

    events, starts = tables.case_d({})
    events = [msgspec.structs.replace(e, gpu_ms={"dit": 40.0, "decode": 30.0}) for e in events]
    d = tmp_path / "run"
    d.mkdir()
    write_events(d / "events.jsonl", events)
    write_sessions(d / "sessions.jsonl", starts)
    cfg = {"name": "lingbot-480x832", "video": {"height": 480, "width": 832},
           "parallel": {"sp": 4, "vae_ranks": 4}, "runtime": {"mode": "compiled"}}
    (d / "manifest.json").write_text(json.dumps({"scheduler": "case-d", "config": cfg}))
    bench = {"preset": "lingbot-480x832", "flops": {"dit_flops": 4e14, "vae_conv_flops": 1.2e13},
             "peak_bf16_tflops": 800.0, "peak_tf32_tflops": 400.0}
    view = R.load_view(d)
    rows = {r.key if r.key != "fps" else r.label: r for r in P.production_rows(
        view.summary, view.events, view.sessions, view.window, (480, 832), cfg["parallel"], bench, "case-d")}
    dit = rows["dit_ms"]
    assert dit.ours == pytest.approx(40) and dit.ratio == pytest.approx(40 / 678) and dit.advantage == pytest.approx(678 / 40)
    mfu = rows["dit_mfu"]
    assert mfu.ours == pytest.approx(4e14 / 0.040 / (800e12 * 4))  # FLOPs / GPU time / (peak × SP ranks)
    assert mfu.advantage == pytest.approx(mfu.ours / 0.49)
    assert rows["vae_mfu"].ours == pytest.approx(1.2e13 / 0.030 / (400e12 * 4))
    assert rows["handoff_ms"].ours == pytest.approx(tables.GAP + 1)
    seg = tables.NOMINAL
    assert rows["vae_segment_ms"].ours == pytest.approx(
        sum(seg[k] for k in ("decode_wait", "decode_queue", "decode", "convert", "d2h")))
    fps = rows[f"{F.label('fps_mean')} @ cpu_ready"]
    assert fps.production.lo == 14.4 and fps.advantage == pytest.approx(fps.ours / 14.5)
    # through the CLI: the table lands in report.md; a file that is not a GPU bench result is refused
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    assert main(["report", str(d), "--bench", str(tmp_path / "bench.json"), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "against the production figures (DESIGN §12, 480×832)" in md and "| DiT P50 ms | 40.0 | 678.0 | 0.059 | 16.95× |" in md
    # every column and row of the production table is a figure of the one table, defined in the report
    section = md.split("### against the production figures", 1)[1].split("\n\n", 2)[2].split("\n\n", 1)[0].splitlines()
    assert [F.resolve(c).name for c in table_headers("\n".join(section[:2]))] == list(P.COLUMNS)
    assert {F.resolve(r.split("|")[1].split(" @ ")[0]).name for r in section[2:]} == set(P.FIGURE_OF.values())
    for name in (*P.COLUMNS, *P.FIGURE_OF.values()):
        assert md.count(f"| `{name}` |") == 1, name
    # FLOPs of another depth (a --set model.num_layers run, say) must not make an MFU
    cfg["model"] = {"num_layers": 4}
    (d / "manifest.json").write_text(json.dumps({"scheduler": "case-d", "config": cfg}))
    (tmp_path / "bench40.json").write_text(json.dumps({**bench, "layers": 40}))
    assert main(["report", str(d), "--bench", str(tmp_path / "bench40.json"), "--out", str(tmp_path / "rep4")]) == 0
    md = (tmp_path / "rep4" / "report.md").read_text()
    assert "its FLOPs do not apply" in md and "| DiT MFU" not in md.split("## figure definitions")[0]
    (tmp_path / "cpu.json").write_text(json.dumps({"preset": "tiny", "flops": {}}))
    assert main(["report", str(d), "--bench", str(tmp_path / "cpu.json")]) != 0
    assert "not a GPU bench-engine" in capsys.readouterr().err


# ---- every printed figure resolves to measure.figures ------------------------------------------


def table_headers(md: str) -> list[str]:
    """Header cells of every markdown table except the definition table itself."""
    lines = md.splitlines()
    out = []
    for head, sep in zip(lines, lines[1:]):
        if head.startswith("|") and sep.startswith("|---") and not head.startswith("| figure | label |"):
            out += [c.strip() for c in head.strip().strip("|").split("|")]
    return out


def headline_labels(lines: list[str]) -> list[str]:
    """The figure labels of the console headline: its column header and every 'LABEL[ @ B]: value' line."""
    import re

    out = []
    for line in lines:
        body = line.strip()
        if body.startswith("boundary "):
            out += re.split(r"\s{2,}", body)
        elif body.startswith("* "):
            out.append("*")
        elif body.startswith("flag "):  # "flag NAME: its definition": NAME is the flag's label
            out.append(body[len("flag "):].split(": ", 1)[0])
        elif ": " in body and not body.startswith(("run directory", "sessions served", "summary flags", "setting:",
                                                   "INVALID:")) and " = " not in body:
            out.append(body.rsplit(": ", 1)[0].split(" @ ")[0])
    return out


def summary_figure_keys(summary: dict) -> set[str]:
    """Keys of every figure-carrying record of summary.json whose value is a number (or null)."""
    recs = [summary["headline"], summary["handoff"], summary["rollout"], summary["rollout"]["time"]]
    for section in ("boundaries", "ttfc", "stages", "blocked", "gpu_ms"):
        for rec in summary[section].values():
            recs.append(rec)
            recs += [v for v in rec.values() if isinstance(v, dict)]
    return {k for r in recs for k, v in r.items() if v is None or isinstance(v, (int, float, list))}


def ttfc_table(md: str, label: str) -> dict[str, float]:
    """boundary → TTFC P50 from the TTFC table of run ``label`` in report.md."""
    section = md.split(f"\n## {label}\n", 1)[1].split("\n## ", 1)[0]  # the run's tables, not its "### label" headline
    rows = section.split("| boundary | n | TTFC P50 ms |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return {r.split("|")[1].strip(): float(r.split("|")[3]) for r in rows}


def test_every_figure_of_a_case_d_a_case_e_and_a_server_run_resolves_to_one_definition(h5a_compare, tmp_path):
    import json
    import subprocess
    import sys

    from harness.experiments.scenario import REPO_ROOT, ServerProcess
    from harness.measure.headline import headline
    from harness.measure import figures as F

    _, out, _ = h5a_compare
    srv = ServerProcess(["--preset", "tiny", "--sessions", "2", "--chunks", "7"], tmp_path / "srv")
    host_port = srv.url.split("//")[1].split("/")[0]
    client = subprocess.run([sys.executable, "-m", "harness", "client", "--connect", host_port, "--sessions", "2",
                             "--chunks", "7", "--out", str(tmp_path / "client")], capture_output=True, text=True,
                            timeout=300, cwd=REPO_ROOT)
    assert client.returncode == 0, client.stderr
    assert srv.wait(120) == 0, srv.stderr()[-2000:]  # --sessions 2 served: the server ends by itself
    runs = [out / "round0-A", out / "round0-B", srv.out]
    man = json.loads((srv.out / "manifest.json").read_text())
    assert man["protocol"]["media"] == "client" and not list((srv.out / "media").iterdir())

    # the console headline: serve --listen prints the same figures as serve, all from the table
    server_lines = srv.stdout_lines[srv.stdout_lines.index(f"run directory: {srv.out}"):]
    assert any(l.strip().startswith("boundary ") for l in server_lines), server_lines
    for run, lines in zip(runs, [None, None, server_lines]):
        summary = json.loads((run / "summary.json").read_text())
        sched = json.loads((run / "manifest.json").read_text())["scheduler"]
        labels = headline_labels(lines if lines is not None else headline(summary, sched))
        assert F.label("fps_mean") in labels and F.label("interval_p50") in labels
        for l in labels:
            F.resolve(l)  # KeyError names any label the table lacks
        assert summary_figure_keys(summary) <= F.summary_keys(), summary_figure_keys(summary) - F.summary_keys()
    case_e = headline_labels(headline(json.loads((runs[1] / "summary.json").read_text()), "case-e"))
    assert F.label("handoff_p50", "case-e") in case_e and F.label("handoff_p50") not in case_e

    report = R.write_report(runs, tmp_path / "rep")
    md = report.read_text()
    assert md.count("— status complete, valid True") == 3  # how each run ended, as its summary says
    headers = table_headers(md)
    assert len(headers) > 40
    for cell in headers:
        F.resolve(cell)
    used = R.used_figures([R.load_view(r) for r in runs])
    for name in R.REPORT_FIGURES:  # each printed figure defined exactly once, and no other
        assert md.count(f"| `{name}` |") == (name in used), name

    # the TTFC plot shows the table's (nearest-rank) P50, for every run and boundary
    views = [R.load_view(r) for r in runs]
    labels = R.unique_labels(views)
    plotted = R.plot_ttfc(views, labels, tmp_path / "ttfc.png").values
    for label in labels:
        table = ttfc_table(md, label)
        assert table and set(table) == set(plotted[label])
        for b, (p50, lo, hi) in plotted[label].items():
            assert round(p50, 1) == table[b] and lo <= p50 <= hi
    for name in R.PLOTS:
        assert_sane_png(tmp_path / "rep" / name)


def test_a_long_tail_report_breaks_the_slowest_intervals_down_by_stage(tmp_path, tables):
    import json

    import msgspec

    from harness.measure import tails
    from harness.measure.summary import build_summary

    d = hand_run(tmp_path / "lt", tables.case_d, {2: {6: {"decode": 50}}, 3: {7: {"dit": 30}}})
    events, starts = tables.case_d({2: {6: {"decode": 50}}, 3: {7: {"dit": 30}}})
    summary = msgspec.to_builtins(build_summary(events, starts))
    summary["long_tail"] = msgspec.to_builtins(tails.tail_summary(events, starts, M.DEFAULT_WINDOW, k=3))
    (d / "summary.json").write_text(json.dumps(summary))
    plotted = R.render_plots([R.load_view(d)], tmp_path / "out")
    slow = next(p for p in plotted if p.path.name == R.SLOWEST_PLOT)
    assert_sane_png(slow.path)
    (label, rows), = slow.values.items()
    assert [r[0] for r in rows] == ["median chunk", "#1 s2 c6", "#2 s3 c7", "#3 s1 c5"]
    med, first, second = rows[0][1], rows[1][1], rows[2][1]
    n = tables.NOMINAL
    assert first["decode"] == n["decode"] + 50 and second["dit"] == n["dit"] + 30 and med["decode"] == n["decode"]
    # Case D: gap + the stages up to cpu_ready tile the interval, so the stack ends on the ◆
    for _, stages, interval in rows:
        assert sum(stages.values()) == pytest.approx(interval)
    assert "sink" not in first  # after the reference boundary: not part of this interval
    md = R.write_report([d], tmp_path / "rep").read_text()
    assert f"]({R.SLOWEST_PLOT})" in md and "### slowest steady intervals @ cpu_ready" in md
    assert f"### {F.label('tail_percentiles')}" in md and f"{F.label('culprits')}: dit 1, decode 1." in md
    for cell in table_headers(md):  # the long-tail tables too: every column a figure, defined once
        assert md.count(f"| `{F.resolve(cell).name}` |") == 1, cell


def test_report_md_reads_headline_setting_plots_tables_then_only_the_definitions_it_used(tmp_path, tables, capsys):
    import json

    d = hand_run(tmp_path / "run", tables.case_d, {2: {6: {"decode": 50}}})
    (d / "manifest.json").write_text(json.dumps({"preset": "tiny", "mode": "eager", "scheduler": "case-d", "hooks": [],
                                                 "candidates": [], "config": {"runtime": {"device": "cpu"},
                                                                              "parallel": {"sp": 2, "vae_ranks": 2}}}))
    assert main(["report", str(d)]) == 0
    wrote = [l.removeprefix("wrote ") for l in capsys.readouterr().out.splitlines()]
    assert wrote == [str(d / "report.md"), *(str(d / p) for p in R.PLOTS)]  # every file it wrote, named
    md = (d / "report.md").read_text()
    order = [md.index(x) for x in ("## headline", "`setting: preset tiny", "## plots", "| boundary | n | sessions |",
                                   "## figure definitions")]
    assert order == sorted(order)
    defs = md.split("## figure definitions")[1]
    assert "`interval_p50`" in defs and "`flag_too_few_samples`" in defs  # printed: defined
    for absent in ("slow_grew", "tail_percentiles", "culprits", "flag_stalled"):  # no long tail, no stall here
        assert f"`{absent}`" not in defs
    # n = 12 steady intervals per boundary: a strip of every sample, not a 20-bin histogram
    plotted = R.plot_intervals([R.load_view(d)], ["case-d"], tmp_path / "i.png").values
    assert plotted["case-d"]["cpu_ready"]["kind"] == "strip" and len(plotted["case-d"]["cpu_ready"]["ms"]) == 12
    # the stage plot marks each chunk's P50 interval: under Case D the stack of P50s ends on it
    stages = R.plot_stages([R.load_view(d)], ["case-d"], tmp_path / "s.png").values["case-d"]
    assert set(stages["interval"]) == set(range(1, 10))


def test_a_summary_of_an_older_schema_is_recomputed_from_its_events(tmp_path, tables):
    """A schema-2 summary's fps_median ranked per-interval FPS (the other middle sample at even n):
    the report recomputes the figures from events.jsonl by today's rules and keeps the run's stalled flag."""
    import json

    import msgspec

    from harness.measure.summary import build_summary

    d = hand_run(tmp_path / "old", tables.case_d, {2: {6: {"decode": 50}}})
    events, starts = tables.case_d({2: {6: {"decode": 50}}})
    now = msgspec.to_builtins(build_summary(events, starts))
    old = {**json.loads(json.dumps(now)), "schema": 2, "flags": [*now["flags"], "stalled"], "status": "complete"}
    old["boundaries"]["cpu_ready"] = {**old["boundaries"]["cpu_ready"], "fps_median": -1.0}
    old.pop("warmup")
    (d / "summary.json").write_text(json.dumps(old))
    view = R.load_view(d)
    assert view.summary["boundaries"]["cpu_ready"]["fps_median"] == now["boundaries"]["cpu_ready"]["fps_median"]
    assert view.summary["warmup"] == now["warmup"] and "stalled" in view.summary["flags"]
    assert view.summary["status"] == "complete"  # how the run went is the run's own record
