"""GPU acceptance checks for H2a, H3a, H4a, H4b and the compiled modes, one compact JSON report each.

    python -m harness gpu-checks output  [--json F]   # H4a + H4b: exactness, convert+D2H times
    python -m harness gpu-checks vae     [--json F]   # H3a: compiled vs eager decode
    python -m harness gpu-checks vae-layout [--json F] [--variants V,…] # cuDNN autotuning, whole-chunk steps,
                                                                  # NDHWC, bf16, fp16, compiled (H3a)
    python -m harness gpu-checks condition [--json F] [--variants M,…]  # the image condition's encoder passes per chunk, per H3c mode
    python -m harness gpu-checks ffn-epilogue [--json F] # H6e's fused FFN-up epilogue vs torch.compile's
    python -m harness gpu-checks dit     [--json F] [--chunks 7] [--compile-mode M]
                                                                  # compiled vs eager DiT (+ H2a)
    python -m harness gpu-checks determinism [--json F] [--chunks 3]
                                                                  # two launches of --mode deterministic
    python -m harness gpu-checks colocate [--json F] [--chunks 9] [--mode compiled]
                                                                  # DiT + VAE decode in one process, two streams

All on one GPU at the full 480×832 preset (SP 1, one VAE rank), random weights from a fixed seed.
Times are host wall times around synchronised calls; "steady" chunks are those with a saturated
KV window (chunk ≥ 5). The numeric gates are the run gates' metrics (``measure.gates``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from harness.candidates import EnginePatches
from harness.config import load_preset, override
from harness.engine.conditions import SessionConditions
from harness.engine.convert import to_uint8
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup
from harness.engine.vae_engine import VaeEngine
from harness.experiments.epilogue_probe import check_ffn_epilogue
from harness.errors import HarnessError
from harness.experiments.vae_probe import VARIANTS as VAE_VARIANTS
from harness.experiments.vae_probe import check_condition, check_vae_layout
from harness.measure.gates import latent_metrics, latent_passes, pixel_metrics, pixel_passes
from harness.pipeline.ring import FrameRing
from harness.workers.vae_worker import OutputPath
from harness.workers.common import set_deterministic

PRESET = "lingbot-480x832"
ACTIONS = [["W", "WJ", ""], ["D", "", "I"], ["", "", ""], ["SL", "K", "A"]]


def _cfg(**runtime):
    return override(load_preset(PRESET), parallel={"sp": 1, "vae_ranks": 1}, runtime=runtime)


def _sync() -> None:
    torch.cuda.synchronize()


def _ms(fn, reps: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


# ---- H4a + H4b ---------------------------------------------------------------------------------
def _decoded_chunk() -> torch.Tensor:
    """A real 12-frame 480×832 chunk: the full-size decoder's second chunk of a session."""
    cfg = _cfg()
    eng = VaeEngine(cfg, group=RankGroup.single(), device=torch.device("cuda"), seed=0)
    g = torch.Generator(device="cuda").manual_seed(0)
    s = eng.start_session()
    shape = (16, cfg.video.frames_per_chunk, cfg.video.latent_h, cfg.video.latent_w)
    eng.decode_chunk(s, torch.randn(shape, generator=g, device="cuda"))
    frames = eng.decode_chunk(s, torch.randn(shape, generator=g, device="cuda"))
    eng.end_session(s)
    del eng
    torch.cuda.empty_cache()
    return frames


def check_output(reps: int = 50) -> dict:
    """H4a and H4b as a VAE rank applies them (``EnginePatches`` on an ``OutputPath``), against
    the reference output path."""
    frames = _decoded_chunk()
    shape = (frames.shape[1], frames.shape[2], frames.shape[3], 3)
    plain, patched = OutputPath(frames.device), OutputPath(frames.device)
    patches = EnginePatches(["H4a", "H4b"])
    patches.apply(output=patched)
    # two rings: registering one with the driver must not speed up the reference's copies
    rings = [FrameRing.create(f"harness-gpucheck-{os.getpid()}-{i}", 1, int(np.prod(shape))) for i in range(2)]
    try:
        ref_u8 = plain.convert(frames)
        edge = torch.tensor([-1.0, 1.0, 0.0, float("nan"), float("inf"), -float("inf"), 3.0, -3.0], device="cuda")
        k = torch.arange(256, device="cuda", dtype=torch.float32)
        edge = torch.cat([edge, (k + 0.5) / 127.5 - 1, torch.nextafter((k + 0.5) / 127.5 - 1, torch.tensor(9.0, device="cuda"))])
        edge = torch.cat([edge, edge.new_zeros((-edge.numel()) % 3)]).view(3, 1, 1, -1)
        out = {"shape": list(frames.shape),
               "h4a_exact_chunk": bool(torch.equal(ref_u8, patched.convert(frames))),
               "h4a_exact_edges": bool(torch.equal(plain.convert(edge), patched.convert(edge)))}
        refs = [r.acquire(0, 0) for r in rings]
        pageable, registered = (r.buffer(ref, shape) for r, ref in zip(rings, refs))
        patched.copy_out(ref_u8, registered)
        out["h4b_exact"] = bool(np.array_equal(registered, ref_u8.cpu().numpy()))
        times = {}
        for name, conv, copy, dst in (("reference", plain.convert, plain.copy_out, pageable),
                                      ("h4a", patched.convert, plain.copy_out, pageable),
                                      ("h4b", plain.convert, patched.copy_out, registered),
                                      ("h4a+h4b", patched.convert, patched.copy_out, registered)):
            times[f"{name}_convert_ms"] = round(_ms(lambda: conv(frames), reps)[0], 3)
            times[f"{name}_convert_d2h_ms"] = round(_ms(lambda: copy(conv(frames), dst), reps)[0], 3)
        out["h4b_path"] = patched.copy_out.describe()
        out["pageable_is_pinned"] = torch.from_numpy(pageable).is_pinned()
        out["times"] = times
        base = times["reference_convert_d2h_ms"]
        out["ratio_vs_reference"] = {k: round(times[f"{k}_convert_d2h_ms"] / base, 3) for k in ("h4a", "h4b", "h4a+h4b")}
        del pageable, registered
        for r, ref in zip(rings, refs):
            r.release(ref)
    finally:
        patches.revert()  # H4b unregisters the ring before it is unmapped
        for r in rings:
            r.close()
            r.unlink()
    return out


# ---- H3a ---------------------------------------------------------------------------------------
def check_vae(chunks: int = 6, mode: str = "default") -> dict:
    from torch._dynamo.utils import counters  # torch._dynamo costs ≈ 1 s to import; only this check reads it

    cfg = _cfg()
    eng = VaeEngine(cfg, group=RankGroup.single(), device=torch.device("cuda"), seed=0)
    shape = (16, cfg.video.frames_per_chunk, cfg.video.latent_h, cfg.video.latent_w)

    def session() -> tuple[list[np.ndarray], list[float], list[int]]:
        g = torch.Generator(device="cuda").manual_seed(1)
        s = eng.start_session()
        pix, times, compiles = [], [], []
        for _ in range(chunks):
            lat = torch.randn(shape, generator=g, device="cuda")
            before = counters["frames"]["ok"]
            _sync()
            t0 = time.perf_counter()
            f = eng.decode_chunk(s, lat)
            _sync()
            times.append((time.perf_counter() - t0) * 1e3)
            compiles.append(counters["frames"]["ok"] - before)
            pix.append(to_uint8(f).cpu().numpy())
        eng.end_session(s)
        return pix, times, compiles

    eager, t_eager, _ = session()
    eng.compile_decoder(**({} if mode == "default" else {"mode": mode}))
    t0 = time.perf_counter()
    comp, t_first, c_first = session()  # compiles here
    first_session_s = time.perf_counter() - t0
    comp2, t_comp, c_comp = session()
    metrics = [pixel_metrics(a, b) for a, b in zip(eager, comp2)]
    steady = slice(1, None)
    return {
        "mode": mode, "tf32_conv": eng.conv_tf32,
        "gate_pass": all(not pixel_passes(m) for m in metrics),
        "worst_rmse": max(m["rmse"] for m in metrics), "worst_max_abs": max(m["max_abs"] for m in metrics),
        "same_as_first_compiled_session": all(np.array_equal(a, b) for a, b in zip(comp, comp2)),
        "eager_chunk_ms": [round(t, 1) for t in t_eager], "compiled_chunk_ms": [round(t, 1) for t in t_comp],
        "steady_ratio": round(statistics.median(t_comp[steady]) / statistics.median(t_eager[steady]), 3),
        "first_compiled_session_s": round(first_session_s, 1),
        "compiles_first_session": c_first, "compiles_second_session": c_comp,
    }


# ---- DiT: compiled vs eager, H2a ---------------------------------------------------------------
def _dit_session(eng, chunks: int, seed: int = 5) -> tuple[list[np.ndarray], list[float]]:
    s = eng.start_session(SessionConditions(prompt="gpu check", seed=seed))
    lat, times = [], []
    for c in range(chunks):
        _sync()
        t0 = time.perf_counter()
        x = eng.generate_chunk(s, ACTIONS[c % len(ACTIONS)])
        lat.append(x.cpu().numpy())  # synchronises
        times.append((time.perf_counter() - t0) * 1e3)
    eng.end_session(s)
    return lat, times


def _gate(a: list[np.ndarray], b: list[np.ndarray]) -> dict:
    m = [latent_metrics(x, y) for x, y in zip(a, b)]
    return {"pass": all(not latent_passes(x) for x in m), "worst_rel_l2": max(x["rel_l2"] for x in m),
            "worst_allclose_excess": max(x["allclose_excess"] for x in m),
            "rel_l2_per_chunk": [round(x["rel_l2"], 5) for x in m]}


def _steady(times: list[float]) -> float:
    return round(statistics.median(times[5:] or times), 1)


def _with_candidate(eng, cid: str, chunks: int) -> tuple[list[np.ndarray], list[float]]:
    """One session with candidate ``cid`` patched in as a DiT rank patches it, reverted after."""
    patches = EnginePatches([cid])
    patches.apply(dit=eng)
    try:
        return _dit_session(eng, chunks)
    finally:
        patches.revert()


#: Compiled variants ``check_dit`` can time and gate against eager: (inductor mode, extra options).
#: "engine" is what ``--mode compiled`` runs; the others isolate one choice each.
VARIANTS = {
    "engine": (None, {}),
    "no-cudagraphs": ("default", {}),
    "no-pattern-matcher": (None, {"pattern_matcher": False}),
    "no-emulate-casts": (None, {"emulate_precision_casts": False}),
}


def check_dit(chunks: int = 7, compile_mode: str | None = None, h2a: bool = True,
              variants: tuple[str, ...] = ("engine",)) -> dict:
    """Eager, then each compiled variant from scratch (``torch._dynamo.reset``): a first session
    (compilation, CUDA-graph recording), a second one timed and gated against eager."""
    eng = DitEngine(_cfg(), group=RankGroup.single(), device=torch.device("cuda"), seed=0)
    out = {"attention": eng.attention_description()}
    eager, t_eager = _dit_session(eng, chunks)
    out["eager_chunk_ms"] = [round(t) for t in t_eager]
    if h2a:
        cached, t_cached = _with_candidate(eng, "H2a", chunks)
        out["h2a_eager"] = {"exact": all(a.tobytes() == b.tobytes() for a, b in zip(eager, cached)),
                            "chunk_ms": [round(t) for t in t_cached],
                            "steady_ratio": round(_steady(t_cached) / _steady(t_eager), 3)}
    out["steady_ms"] = {"eager": _steady(t_eager)}
    eng.mode = "compiled"
    for name in variants:
        mode, extra = VARIANTS[name]
        torch._dynamo.reset()
        eng.compile(compile_mode if name == "engine" else mode or compile_mode, extra)
        t0 = time.perf_counter()
        try:
            compiled, _ = _dit_session(eng, chunks)
            first_s = time.perf_counter() - t0
            compiled2, t_comp2 = _dit_session(eng, chunks)
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            continue
        st = eng.compile_stats()
        rec = {"compile_options": eng.compile_options, "first_session_s": round(first_s, 1),
               "chunk_ms": [round(t) for t in t_comp2], "steady_ms": _steady(t_comp2),
               "speedup_vs_eager": round(_steady(t_eager) / _steady(t_comp2), 3),
               "gate_vs_eager": _gate(eager, compiled2),
               "repeat_exact": all(a.tobytes() == b.tobytes() for a, b in zip(compiled, compiled2)),
               "compile_stats": {k: st.get(k) for k in ("frames", "graphs", "graph_breaks", "recompiles",
                                                       "recompile_reasons", "cudagraphs", "cudagraphs_recorded",
                                                       "cudagraph_skips")},
               "compiles_first_chunk": st["compiles_per_chunk"][0],
               "compiles_after_first_chunk": sum(st["compiles_per_chunk"][1:])}
        if h2a and name == variants[0]:
            cached_c, t_cc = _with_candidate(eng, "H2a", chunks)
            rec["h2a"] = {"exact": all(a.tobytes() == b.tobytes() for a, b in zip(compiled2, cached_c)),
                          "steady_ratio": round(_steady(t_cc) / _steady(t_comp2), 3)}
        out[name] = rec
        out["steady_ms"][name] = rec["steady_ms"]
    return out


# ---- DiT and VAE on one GPU: what true concurrency could buy Case E -----------------------------
def check_colocate(chunks: int = 9, mode: str = "compiled") -> dict:
    """The ceiling of Case E on a GPU the DiT and the VAE share.

    Two processes without MPS time-slice the GPU, so Case E there cannot beat Case D (gpu-batch5).
    This check asks what concurrency itself could buy: one process holds both engines; per chunk
    it runs (serial) the DiT chunk then the decode of its latent, or (concurrent) the DiT chunk i
    on a high-priority stream while a thread decodes chunk i−1 on a low-priority stream. The
    steady per-chunk wall time of each, side by side in one process, bounds what any sharing
    mechanism (MPS, streams) can reach when both workloads are compute-bound.
    """
    if chunks < 7:  # steady rounds are 6 … chunks − 1: a saturated DiT chunk and a saturated decode
        raise HarnessError("colocate needs --chunks ≥ 7 (rounds 6 … chunks − 1 are the steady ones)")
    dev = torch.device("cuda")
    dit = DitEngine(_cfg(mode=mode), group=RankGroup.single(), device=dev, seed=0)
    vae = VaeEngine(_cfg(), group=RankGroup.single(), device=dev, seed=0)
    hi, lo = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)

    def run(concurrent: bool) -> tuple[list[float], list[np.ndarray]]:
        sd = dit.start_session(SessionConditions(prompt="gpu check", seed=5))
        sv = vae.start_session()
        times, pixels, prev = [], [], None
        for c in range(chunks + 1):  # the last round only drains the final decode
            _sync()
            t0 = time.perf_counter()
            box: dict = {}

            def decode(lat=prev) -> None:
                try:
                    with torch.cuda.stream(lo):
                        box["f"] = vae.decode_chunk(sv, lat)
                        lo.synchronize()
                except BaseException as e:  # noqa: BLE001 - re-raised by the main thread after join
                    box["error"] = e

            th = threading.Thread(target=decode) if concurrent and prev is not None else None
            if th:
                th.start()
            x = None
            try:
                if c < chunks:
                    with torch.cuda.stream(hi):
                        x = dit.generate_chunk(sd, ACTIONS[c % len(ACTIONS)])
                        hi.synchronize()
            finally:
                if th:
                    th.join()
            if not th and prev is not None:
                decode()
            if "error" in box:
                raise box["error"]
            _sync()
            times.append((time.perf_counter() - t0) * 1e3)
            if "f" in box:
                pixels.append(box["f"].float().cpu().numpy())
            prev = x
        dit.end_session(sd)
        vae.end_session(sv)
        return times, pixels

    out: dict = {"mode": mode, "chunks": chunks}
    try:
        run(False)  # warm-up: compilation, CUDA-graph recording, cuDNN plans
        serial, p_serial = run(False)
        conc, p_conc = run(True)
    except Exception as e:  # noqa: BLE001 - report the failure as the check's result
        return {**out, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    # round c of the serial run is decode(c−1) + DiT(c): the same work as round c of the concurrent run
    steady = slice(6, chunks)
    s_ms, c_ms = statistics.median(serial[steady]), statistics.median(conc[steady])
    out.update({"serial_round_ms": [round(t, 1) for t in serial], "concurrent_round_ms": [round(t, 1) for t in conc],
                "steady_serial_ms": round(s_ms, 1), "steady_concurrent_ms": round(c_ms, 1),
                "concurrent_over_serial": round(c_ms / s_ms, 4),
                "decoded_equal": len(p_serial) == len(p_conc) == chunks
                                 and all(np.array_equal(a, b) for a, b in zip(p_serial, p_conc))})
    return out


# ---- deterministic mode: two launches ----------------------------------------------------------
def _dit_run(mode: str, chunks: int, save: str) -> None:
    """One launch (a fresh process): the session's latents to ``save`` (.npz)."""
    eng = DitEngine(_cfg(mode=mode), group=RankGroup.single(), device=torch.device("cuda"), seed=0)
    lat, times = _dit_session(eng, chunks)
    np.savez(save, *lat)
    Path(save + ".json").write_text(json.dumps({"chunk_ms": [round(t) for t in times],
                                                "stats": eng.compile_stats()}, default=str))


def check_determinism(chunks: int = 3) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for mode in ("deterministic", "eager"):
            files = []
            for launch in range(2):
                f = os.path.join(d, f"{mode}{launch}.npz")
                env = dict(os.environ)
                if mode == "deterministic":  # what the worker's process_setup does, before CUDA starts
                    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
                subprocess.run([sys.executable, "-m", "harness", "gpu-checks", "dit-run", "--mode", mode,
                                "--chunks", str(chunks), "--save", f], check=True, env=env)
                files.append(np.load(f))
            a, b = files
            out[mode] = {"launches_bit_identical": all(a[k].tobytes() == b[k].tobytes() for k in a.files),
                         "chunk_ms": json.loads(Path(os.path.join(d, f"{mode}1.npz.json")).read_text())["chunk_ms"]}
        det = np.load(os.path.join(d, "deterministic0.npz"))
        eag = np.load(os.path.join(d, "eager0.npz"))
        out["deterministic_vs_eager_gate"] = _gate([eag[k] for k in eag.files], [det[k] for k in det.files])
    return out


def main(a) -> int:
    """``python -m harness gpu-checks CHECK`` (options in ``cli``: parsing it must not wait for torch)."""
    if not torch.cuda.is_available():
        raise HarnessError(f"gpu-checks {a.check} needs a CUDA device")
    if a.check == "dit-run":
        a.mode = a.mode or "deterministic"
        if a.mode == "deterministic":
            set_deterministic()
        _dit_run(a.mode, a.chunks or 3, a.save)
        return 0
    t0 = time.perf_counter()
    if a.check == "output":
        report = check_output()
    elif a.check == "vae":
        report = check_vae(a.chunks or 6, a.compile_mode or "default")
    elif a.check == "vae-layout":
        report = check_vae_layout(a.chunks or 6, tuple(a.variants.split(",")) if a.variants else tuple(VAE_VARIANTS))
    elif a.check == "ffn-epilogue":
        report = check_ffn_epilogue()
    elif a.check == "condition":
        report = check_condition(a.chunks or 12, **({"modes": tuple(a.variants.split(","))} if a.variants else {}))
    elif a.check == "dit":
        report = check_dit(a.chunks or 7, a.compile_mode, h2a=not a.no_h2a, variants=tuple((a.variants or "engine").split(",")))
    elif a.check == "colocate":
        report = check_colocate(a.chunks or 9, a.mode or "compiled")
    else:
        report = check_determinism(a.chunks or 3)
    report = {"check": a.check, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "wall_s": round(time.perf_counter() - t0, 1), **report}
    text = json.dumps(report, default=str)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    return 0

