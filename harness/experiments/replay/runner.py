"""Running the matrix: every case on every backend of its kind, checked, timed, a winner per case.

For each input and each backend: build the call (not timed), run it once (``first_ms``:
compilation included), compare the result with the FP64 reference, then warm up and time
repeated calls. A backend that cannot run the input (no kernel for the device/dtype/shape,
missing package, out of memory, an exception) or whose result fails the check is a *failure*
with its reason and no time: it never shows up as fast.
"""

from __future__ import annotations

import statistics
import warnings
from typing import Any, Callable

import torch

from harness.experiments.replay import op_backends_fa3
from harness.experiments.replay.op_backends import Backend, Unsupported, backends_for, register_builtins
from harness.experiments.replay.cases import Case
from harness.experiments.replay.reference import check, reference
from harness.experiments.replay.settings import DEFAULT_REPEATS, DEFAULT_WARMUP
from harness.experiments.replay.timing import sync, time_calls, timed_once


def load_backends() -> None:
    """Fill the registry: the built-in families, then the FA3 rows (idempotent)."""
    register_builtins()
    op_backends_fa3.register()


def _is_oom(e: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    text = str(e).lower()
    return isinstance(e, (oom, MemoryError)) or "out of memory" in text or "can't allocate memory" in text


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:400]


def classify(e: BaseException) -> tuple[str, str]:
    """(status, reason) of a backend that raised."""
    if isinstance(e, Unsupported):
        return "unsupported", str(e)
    if _is_oom(e):
        return "oom", _first_line(e)
    text = str(e)
    if isinstance(e, (ImportError, NotImplementedError)) or "No viable backend" in text or "No available kernel" in text:
        return "unsupported", _first_line(e)
    return "error", _first_line(e)


def _warning_text(caught: list) -> str:
    # SDPA says *why* a pinned kernel refused in UserWarnings ("Flash attention requires …")
    lines = []
    for w in caught:
        for line in str(w.message).splitlines():
            line = line.strip()
            if line and line not in lines and "called without torch.compile" not in line:
                lines.append(line)
    return " | ".join(lines)[:600]


def _timing_figures(times: list[float], flops: int | None) -> dict:
    times = sorted(times)
    res = {"median_ms": statistics.median(times), "min_ms": times[0], "p90_ms": times[min(len(times) - 1, int(0.9 * len(times)))],
           "repeats": len(times), "times_ms": [round(x, 6) for x in times]}
    if flops and res["median_ms"] > 0:
        res["tflops"] = flops / (res["median_ms"] * 1e-3) / 1e12
    return res


def run_backend(case: Case, backend: Backend, t: dict, ref: dict, device, *, warmup: int, repeats: int) -> dict:
    """One backend on one input: its status, reason, check and (when it passed, or its gate is the
    model's) its times."""
    res: dict[str, Any] = {"backend": backend.name, "status": "ok", "reason": None, "median_ms": None}
    caught: list = []
    try:
        if "cuda" in backend.needs and device.type != "cuda":
            raise Unsupported("needs a CUDA device")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prep = backend.make(case, t, device)
            with prep.context(), torch.inference_mode():
                sync(device)
                out, res["first_ms"] = timed_once(prep.fn, device)
                chk = check(ref, out)
                res["check"] = {k: v for k, v in chk.items() if k != "reason"}
                del out
                if not chk["passed"]:
                    res.update(status="numerics", reason=chk.get("reason", "check failed"))
                    if not backend.model_gated:
                        return res
                times = time_calls(prep.fn, device, warmup, repeats)
    except Exception as e:  # noqa: BLE001  (every failure is data, not a crash of the replay)
        status, reason = classify(e)
        extra = _warning_text(caught)
        res.update(status=status, reason=reason + (f" [{extra}]" if extra and status != "ok" else ""))
        res.pop("first_ms", None)
        if status == "oom" and device.type == "cuda":
            torch.cuda.empty_cache()
        return res
    res.update(_timing_figures(times, case.flops()))
    return res


def _pick_winner(entry: dict) -> None:
    """The fastest passing backend of an entry, and every passing one's ratio to it."""
    ok = [r for r in entry["results"] if r["status"] == "ok"]
    best = min(ok, key=lambda r: r["median_ms"]) if ok else None
    entry["winner"] = best["backend"] if best else None
    entry["winner_ms"] = best["median_ms"] if best else None
    for r in ok:
        r["ratio"] = r["median_ms"] / best["median_ms"] if best["median_ms"] > 0 else 1.0


def replay_cases(cases: list[Case], *, device, backends: list[str] | None = None, warmup: int = DEFAULT_WARMUP,
                 repeats: int = DEFAULT_REPEATS, log: Callable[[str], None] | None = print) -> list[dict]:
    """One entry per case: its description, the results of every backend, and the local winner."""
    out = []
    for i, case in enumerate(cases):
        entry = case.describe()
        bes = backends_for(case.kind, device, backends)
        try:
            t = case.load(device)
            with torch.inference_mode():
                ref = reference(case, t, device)
        except Exception as e:  # noqa: BLE001
            status, reason = classify(e)
            entry["results"] = [{"backend": b.name, "status": status, "reason": f"input/reference: {reason}", "median_ms": None}
                                for b in bes]
            entry["winner"] = None
            out.append(entry)
            continue
        entry["results"] = [run_backend(case, b, t, ref, device, warmup=warmup, repeats=repeats) for b in bes]
        _pick_winner(entry)
        del t, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if log:
            cells = ", ".join(f"{r['backend']} {r['median_ms']:.3f}" if r["status"] == "ok" else f"{r['backend']} ✗{r['status']}"
                              for r in entry["results"])
            log(f"[{i + 1}/{len(cases)}] {case.label()}: {cells}")
        out.append(entry)
    return out


load_backends()  # whatever can run a replay sees every backend, FA3 rows included
