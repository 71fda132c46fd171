"""What ran, in one line: the setting printed above every headline (the console's, report.md's,
every plot title's, and compare.md's through ``setting_line``), so that a figure is never read
without the preset, device, mode, scheduler, ranks, engine, candidates, hooks and host load that
produced it.

Everything here is read from the run's manifest (``drivers.rundir.manifest`` plus what ``serve``
adds: ``devices``, ``engine``, ``host``) and the hooks' own reports (``hooks.*.json``); nothing is
guessed, and what a manifest does not say is printed as ``?``.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.limits import MAX_JSON_BYTES, read_bounded
from harness.measure import figures as F

#: the hooks' reports in a run directory, one per process (``hooks.active.ActiveHooks.report``)
HOOK_REPORTS = "hooks.*.json"


def hook_cost_ms(run_dir: str | Path) -> dict[str, float]:
    """Per hook, the cost its processes measured inside the run (``overhead_ms.<hook>_in_run``,
    summed over processes): what the hook added to the timed work, as far as it can time itself."""
    out: dict[str, float] = {}
    for p in sorted(Path(run_dir).glob(HOOK_REPORTS)):
        try:
            rep = json.loads(read_bounded(p, MAX_JSON_BYTES, "hook report"))
        except (OSError, ValueError):
            continue  # a report that cannot be read claims no cost; the line says "cost not reported"
        for k, v in (rep.get("overhead_ms") or {}).items():
            if k.endswith("_in_run") and isinstance(v, (int, float)):
                name = k[: -len("_in_run")]
                out[name] = out.get(name, 0.0) + float(v)
    return out


def _hooks(manifest: dict, costs: dict[str, float] | None) -> str:
    hooks = manifest.get("hooks") or []
    if not hooks:
        return "hooks none"
    costs = costs or {}
    shown = [f"{h} ({costs[h]:.1f} ms in-run)" if h in costs else h for h in hooks]
    return "hooks " + ", ".join(shown) + ("" if costs else " (cost not reported)")


def _load(host: dict) -> str:
    cpus = host.get("cpus", "?")
    start, end = host.get("load_start"), host.get("load_end")
    if start is None:
        return "host load not recorded"
    span = f"{start[0]:.2f}" + (f"→{end[0]:.2f}" if end else "")
    return f"host load {span} (1-min, start→end) on {cpus} CPUs"


def setting_parts(manifest: dict, costs: dict[str, float] | None = None) -> list[str]:
    """The setting's fields, in reading order (each already labelled)."""
    cfg = manifest.get("config") or {}
    rt, par = cfg.get("runtime") or {}, cfg.get("parallel") or {}
    devices = [d for d in manifest.get("devices") or [] if d != "cpu"]  # GPU names ("cpu": the encoder's, or a CPU run)
    device = rt.get("device", "?") + (f" ({', '.join(devices)})" if devices else "")
    engine = (manifest.get("engine") or {}).get("backend") or (cfg.get("engine") or {}).get("backend", "?")
    cands = manifest.get("candidates") or []
    return [
        f"preset {manifest.get('preset', cfg.get('name', '?'))}",
        f"device {device}",
        f"mode {manifest.get('mode', rt.get('mode', '?'))}",
        str(manifest.get("scheduler", rt.get("scheduler", "?"))),
        f"SP {par.get('sp', '?')} / VAE ranks {par.get('vae_ranks', '?')}",
        f"engine {engine}",
        "candidates " + ("+".join(cands) if cands else "none"),
        _hooks(manifest, costs) + (f" · telemetry {rt['telemetry_hz']:g} Hz" if rt.get("telemetry_hz") else ""),
        _load(manifest.get("host") or {}),
    ]


def setting_line(manifest: dict, costs: dict[str, float] | None = None) -> str:
    """``setting: preset tiny · device cpu · mode eager · case-d · SP 1 / VAE ranks 1 · …``"""
    return "setting: " + " · ".join(setting_parts(manifest, costs))


def run_setting(run_dir: str | Path, manifest: dict | None = None) -> str:
    """The setting line of a run directory (its manifest and hook reports)."""
    if manifest is None:
        try:
            manifest = json.loads(read_bounded(Path(run_dir) / "manifest.json", MAX_JSON_BYTES, "manifest"))
        except (OSError, ValueError):
            manifest = {}
    return setting_line(manifest, hook_cost_ms(run_dir))


def flag_lines(flags: list[str], indent: str = "  ") -> list[str]:
    """Every raised flag with its definition (``figures``), whether or not the run is valid."""
    return [f"{indent}flag {f}: {F.define(F.flag_figure(f)).formula}" for f in flags]
