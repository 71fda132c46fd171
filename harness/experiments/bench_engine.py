"""``bench-engine``: the engine alone, no serving path — how fast are the DiT and the VAE?

DiT: one session on SP ranks, chunks until the KV window is saturated plus a few steady ones;
per chunk the host time around the 5 forwards (synchronised), per forward from CUDA events on a
GPU. VAE: a streaming session on M ranks, per-chunk decode time. FLOPs come from the dispatch
recorder run over the *same code* on the meta device (no memory, no arithmetic), whole model;
MFU is against a peak measured in the same process (bf16 dense GEMM for the DiT, TF32 for the
VAE) unless one is given.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Iterable

import torch

from harness import candidates as C
from harness.config import HarnessConfig, override
from harness.drivers.config_options import base_config
from harness.drivers.procwatch import rss_bytes
from harness.engine.attention import check_backend, gpu_only
from harness.engine.conditions import SessionConditions
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup, run_ranks
from harness.engine.vae_engine import VaeEngine
from harness.errors import HarnessError
from harness.experiments.kernel_profile import ProfileChunk
from harness.hooks.dispatch import DispatchRecorder
from harness.limits import check_chunks_option
from harness.measure.kernels import render
from harness.workers.common import set_deterministic


def steady_chunk_index(cfg: HarnessConfig) -> int:
    """First chunk whose effective KV length is the full window (chunk 5 for 18/3)."""
    return cfg.cache.window_frames // cfg.video.frames_per_chunk - 1


def check_steady_chunks(chunks: int, cfg: HarnessConfig) -> int:
    """``steady_chunk_index``, refusing sessions too short to reach it: their last chunk would be
    timed against a full window's FLOPs, or judged as steady with a shorter window."""
    steady = steady_chunk_index(cfg)
    if chunks <= steady:
        raise HarnessError(f"--chunks {chunks}: sessions need more than {steady} chunks for a steady (window-saturated) chunk")
    return steady


def warmup_chunks(chunks: int) -> int:
    """Chunks of the unmeasured warm-up session of a compiled mode: a whole session, so that every
    K length the measured sessions meet — the saturated window's included — has been compiled and
    recorded. A 3-chunk warm-up left the first saturated chunk of the first measured session
    (always the baseline's) 1.3–2.6 % slow on an H200, biasing A/B ratios towards the candidate."""
    return chunks


# ---- FLOPs on the meta device ------------------------------------------------------------
def meta_attention(name: str) -> str:
    """The attention backend the meta-device FLOP count runs: the configured one, unless only a
    GPU can run it (FA3's kernels and the project's Triton kernels refuse the meta device)."""
    return "sdpa" if gpu_only(name) else name


def count_steady_flops(cfg: HarnessConfig) -> dict[str, int]:
    """FLOPs of one steady, KV-saturated chunk (5 DiT forwards + its VAE decode), whole model.

    SP only redistributes the same GEMMs and attention over ranks, so the SP=1 count is the sum
    over ranks; the VAE's halo columns add a few percent at M>1 that this count leaves out.
    The count is nominal (DESIGN §8: 4·Sq·Skv·H·D whatever kernel runs it), so a backend that
    cannot run on the meta device (FlashAttention-3) is counted through SDPA's path instead.
    """
    cfg1 = override(cfg, parallel={"sp": 1, "vae_ranks": 1}, runtime={"attention": meta_attention(cfg.runtime.attention)})
    meta = torch.device("meta")
    steady = steady_chunk_index(cfg1)
    dit = DitEngine(cfg1, group=RankGroup.single(), device=meta, seed=0)
    s = dit.start_session(SessionConditions(prompt="flops", seed=0, image_latent=None))
    actions = [""] * cfg1.video.frames_per_chunk
    for _ in range(steady):
        dit.advance_without_compute(s)
    with DispatchRecorder(path=None) as rec:
        latent = dit.generate_chunk(s, actions)
    dit.end_session(s)
    cats = rec.flops_by_category()

    vae = VaeEngine(cfg1, group=RankGroup.single(), device=meta, seed=0)
    vs = vae.start_session()
    lat = torch.empty_like(latent, device=meta)
    vae.decode_chunk(vs, lat)
    with DispatchRecorder(path=None) as vrec:
        vae.decode_chunk(vs, lat)
    vae.end_session(vs)
    vcats = vrec.flops_by_category()
    out = {
        "linear_flops": int(cats.get("linear", 0)),
        "self_attention_flops": int(cats.get("self_attention", 0)),
        "cross_attention_flops": int(cats.get("cross_attention", 0)),
        "vae_conv_flops": int(sum(vcats.values())),
    }
    out["dit_flops"] = out["linear_flops"] + out["self_attention_flops"] + out["cross_attention_flops"] + int(cats.get("other", 0))
    out["other_dit_flops"] = int(cats.get("other", 0))
    out["total_flops"] = out["dit_flops"] + out["vae_conv_flops"]
    return out


# ---- peaks ---------------------------------------------------------------------------------
def measure_peak_tflops(device: torch.device, dtype: torch.dtype, n: int = 8192, iters: int = 30) -> float:
    """Dense GEMM throughput on random data: the ceiling MFU is stated against."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    return 2 * n**3 * iters / (start.elapsed_time(end) / 1e3) / 1e12


# ---- timed runs, one process per rank -----------------------------------------------------
def _device_for(cfg: HarnessConfig, rank: int) -> torch.device:
    if cfg.runtime.device == "cuda":
        d = torch.device(f"cuda:{rank % torch.cuda.device_count()}")
        torch.cuda.set_device(d)
        return d
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dit_engine_for(group: RankGroup, cfg: HarnessConfig):
    """One rank's DiT engine and device; the deterministic mode's process flags go first."""
    if cfg.runtime.mode == "deterministic":
        set_deterministic()
    device = _device_for(cfg, group.rank)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return DitEngine(cfg, group=group, device=device, seed=cfg.runtime.seed), device


def timed_session(eng, device: torch.device, actions: list[str], *, prompt: str, seed: int, chunks: int,
                  on_latent=None) -> list[float]:
    """Milliseconds of each chunk of one session, the device synchronised around each;
    ``on_latent`` gets every chunk's latent after its time is taken."""
    s = eng.start_session(SessionConditions(prompt=prompt, seed=seed))
    times = []
    for _ in range(chunks):
        _sync(device)
        t0 = time.perf_counter()
        x = eng.generate_chunk(s, actions)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if on_latent is not None:
            on_latent(x)
    eng.end_session(s)
    return times


def _dit_rank(group: RankGroup, cfg: HarnessConfig, chunks: int, sessions: int = 1,
              candidates: tuple[C.Chosen, ...] = (), kernels: bool = False) -> dict:
    """Chunk times of the first measured session; device memory and host RSS after every session
    ends (flat over many sessions means nothing leaks per session). Compiled modes first run an
    unmeasured whole session (``warmup_chunks``): compilation and CUDA-graph recording of every K length.
    ``candidates``' DiT patches are applied before anything runs; ``kernels`` adds one chunk to
    the first measured session, profiled (``kernel_profile``) and left out of its times."""
    eng, device = dit_engine_for(group, cfg)
    C.EnginePatches(candidates).apply(dit=eng)

    def session(n: int, seed: int, on_latent=None) -> list[float]:
        return timed_session(eng, device, ["W"] * cfg.video.frames_per_chunk, prompt="bench", seed=seed, chunks=n,
                             on_latent=on_latent)

    out: dict = {}
    if cfg.runtime.mode != "eager":
        t0 = time.perf_counter()
        out["warmup_chunk_ms"] = session(warmup_chunks(chunks), seed=1000)
        out["warmup_s"] = time.perf_counter() - t0
    mem = []
    for i in range(sessions):
        prof = None
        if kernels and i == 0 and device.type == "cuda":
            prof = ProfileChunk(skip=chunks)
        times = session(chunks + (prof is not None), seed=i, on_latent=prof)
        if prof is not None:
            out["kernels"], times = prof.result, times[:chunks]
        if i == 0:
            out["chunk_ms"] = times
        _sync(device)
        mem.append({"allocated_mib": torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None,
                    "reserved_mib": torch.cuda.memory_reserved(device) / 2**20 if device.type == "cuda" else None,
                    "rss_mib": (rss_bytes(os.getpid()) or 0) / 2**20})
    out["memory_after_session"] = mem
    out["kv_tokens"] = [min((c + 1) * cfg.tokens_per_chunk, cfg.max_kv_tokens) for c in range(chunks)]
    out["attention"] = eng.attention_description()
    out["compile"] = eng.compile_stats()
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def timed_decode(eng: VaeEngine, latents: Iterable[torch.Tensor], keep: Callable[[torch.Tensor], Any] | None = None
                 ) -> tuple[list[float], list]:
    """One decode session over ``latents`` (each moved to the engine's device before its clock
    starts): every chunk's host wall ms around synchronised calls, and ``keep`` of every output
    this rank gets (rank 0's frames; nothing is held when ``keep`` is None)."""
    s = eng.start_session()
    times, kept = [], []
    for lat in latents:
        lat = lat.to(eng.device)
        _sync(eng.device)
        t0 = time.perf_counter()
        out = eng.decode_chunk(s, lat)
        _sync(eng.device)
        times.append((time.perf_counter() - t0) * 1e3)
        if keep is not None and out is not None:
            kept.append(keep(out))
    eng.end_session(s)
    return times, kept


def _vae_rank(group: RankGroup, cfg: HarnessConfig, chunks: int, candidates: tuple[C.Chosen, ...] = ()) -> dict:
    device = _device_for(cfg, group.rank)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    eng = VaeEngine(cfg, group=group, device=device, seed=cfg.runtime.seed)
    C.EnginePatches(candidates).apply(vae=eng)  # the VAE candidates (H3a, H3b); DiT ones patch nothing here
    gen = torch.Generator().manual_seed(0)
    shape = (16, cfg.video.frames_per_chunk, cfg.video.latent_h, cfg.video.latent_w)
    times, _ = timed_decode(eng, (torch.randn(shape, generator=gen) for _ in range(chunks)))
    out = {"decode_ms": times, "dtype": str(eng.dtype).removeprefix("torch."), "tf32": eng.conv_tf32}
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def flatness(chunk_ms: list[float], late: int = 9, early: int = 6) -> float | None:
    """chunk ``late`` ÷ chunk ``early`` (0-based), the issue's steady-state check: both past the
    window's saturation for the presets' 18-frame window of 3-frame chunks (saturated from chunk
    5), so a ratio away from 1 means per-chunk cost still grows (or the clock drifts)."""
    return chunk_ms[late] / chunk_ms[early] if len(chunk_ms) > late else None


def memory_growth(samples: list[dict]) -> dict:
    """Device allocated/reserved and host RSS after the last session minus after the first (MiB)."""
    first, last = samples[0], samples[-1]
    return {k: None if first[k] is None else last[k] - first[k] for k in first}


def run_bench(cfg: HarnessConfig, chunks: int | None = None, peak_tflops: float | None = None,
              sessions: int = 1, candidates: tuple[C.Chosen, ...] = (), kernels: bool = False, vae: bool = True,
              save=None) -> dict:
    """``cfg`` already carries the candidates' configuration part (``candidates.configure``).

    The steps run in order — DiT ranks, VAE ranks, the FLOP count, the peaks — and ``save(res)``
    gets the result after each, marked ``complete: false`` with the steps done so far, so a step
    that fails (an FA3 backend on the meta device did) never takes the figures measured before it."""
    save = save or (lambda res: None)
    chunks = chunks or cfg.video.chunks_per_session
    steady = check_steady_chunks(chunks, cfg)
    backend = "nccl" if cfg.runtime.device == "cuda" else "gloo"
    res: dict = {
        "complete": False, "steps_done": [],
        "preset": cfg.name, "device": cfg.runtime.device, "sp": cfg.parallel.sp, "vae_ranks": cfg.parallel.vae_ranks,
        "mode": cfg.runtime.mode, "layers": cfg.model.num_layers, "sessions": sessions, "dtype": cfg.runtime.dtype,
        "kv_path": cfg.runtime.kv_path, "candidates": [str(c) for c in candidates],
    }

    def done(step: str, **figures) -> None:
        res.update(figures)
        res["steps_done"].append(step)
        save(res)

    dit = run_ranks(_dit_rank, cfg.parallel.sp, cfg, chunks, sessions, tuple(candidates), kernels,
                    backend=backend, timeout_s=3600)[0]
    dit_ms = statistics.median(dit["chunk_ms"][steady:])
    done("dit", compile=dit["compile"], warmup_chunk_ms=dit.get("warmup_chunk_ms"), warmup_s=dit.get("warmup_s"),
         steady_flatness_9_vs_6=flatness(dit["chunk_ms"]), memory_after_session=dit["memory_after_session"],
         memory_growth_mib=memory_growth(dit["memory_after_session"]), attention=dit["attention"],
         dit_chunk_ms=dit["chunk_ms"], dit_kv_tokens=dit["kv_tokens"], dit_steady_chunk_ms=dit_ms,
         dit_forward_ms=dit_ms / (len(cfg.schedule.timesteps) + 1), dit_kernels=dit.get("kernels"),
         peak_mem_gib={"dit": dit.get("peak_mem_gib"), "vae": None})
    vres = (run_ranks(_vae_rank, cfg.parallel.vae_ranks, cfg, min(chunks, 4), tuple(candidates), backend=backend,
                      timeout_s=3600)[0] if vae else None)
    vae_ms = statistics.median(vres["decode_ms"][1:] or vres["decode_ms"]) if vres else None
    done("vae", vae_decode_ms=vres["decode_ms"] if vres else None, vae_steady_decode_ms=vae_ms,
         vae_decode_dtype=vres["dtype"] if vres else None, vae_conv_tf32=vres["tf32"] if vres else None,
         peak_mem_gib={"dit": dit.get("peak_mem_gib"), "vae": vres.get("peak_mem_gib") if vres else None})
    flops = count_steady_flops(cfg)
    done("flops", flops=flops, dit_tflops_per_s=flops["dit_flops"] / (dit_ms / 1e3) / 1e12,
         vae_tflops_per_s=flops["vae_conv_flops"] / (vae_ms / 1e3) / 1e12 if vres else None)
    if cfg.runtime.device == "cuda":
        dev = torch.device("cuda:0")
        bf16 = peak_tflops or measure_peak_tflops(dev, torch.bfloat16)
        torch.backends.cuda.matmul.allow_tf32 = True
        tf32 = measure_peak_tflops(dev, torch.float32)
        # per-GPU MFU: the DiT's FLOPs are spread over sp GPUs, the VAE's over vae_ranks GPUs
        peaks = {"peak_bf16_tflops": bf16, "peak_tf32_tflops": tf32, "dit_mfu": res["dit_tflops_per_s"] / (bf16 * cfg.parallel.sp)}
        if vres:
            peaks["vae_mfu"] = res["vae_tflops_per_s"] / (tf32 * cfg.parallel.vae_ranks)
    elif peak_tflops:
        peaks = {"peak_tflops": peak_tflops, "dit_mfu": res["dit_tflops_per_s"] / (peak_tflops * cfg.parallel.sp)}
    else:
        peaks = {}
    res["complete"] = True
    done("peaks", **peaks)
    return res


def write_result(path: str, res: dict) -> None:
    """The result as it stands, replacing the previous one whole (never a half-written file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=2)
    os.replace(tmp, path)


def _print(res: dict) -> None:
    print(f"bench-engine {res['preset']} on {res['device']}: SP={res['sp']} VAE ranks={res['vae_ranks']} "
          + (f"candidates={'+'.join(res['candidates'])} " if res.get("candidates") else "")
          + f"dtype={res['dtype']} mode={res['mode']} layers={res['layers']} attention={res['attention']} kv={res['kv_path']}")
    print("  DiT per chunk (ms): " + " ".join(f"{t:.1f}" for t in res["dit_chunk_ms"]))
    print(f"  DiT steady chunk {res['dit_steady_chunk_ms']:.2f} ms, per forward {res['dit_forward_ms']:.2f} ms, "
          f"{res['dit_tflops_per_s']:.3f} TFLOP/s" + (f", MFU {res['dit_mfu']:.1%}" if "dit_mfu" in res else ""))
    if res.get("dit_kernels"):
        print("  DiT steady chunk " + render(res["dit_kernels"]))
    if res["vae_steady_decode_ms"] is None:
        print("  VAE not run (--no-vae)")
    else:
        print(f"  VAE steady decode {res['vae_steady_decode_ms']:.2f} ms, {res['vae_tflops_per_s']:.3f} TFLOP/s"
              + (f", MFU {res['vae_mfu']:.1%} (TF32)" if "vae_mfu" in res else ""))
    if res["steady_flatness_9_vs_6"] is not None:
        print(f"  chunk 9 / chunk 6: {res['steady_flatness_9_vs_6']:.4f}")
    c = res["compile"]
    if c.get("compiled"):
        after = sum(c["compiles_per_chunk"][len(res["warmup_chunk_ms"] or []):])
        print(f"  compiled ({c['options'].get('mode')}): warm-up session {res['warmup_s']:.1f} s, "
              f"compilations after it {after}, recompiles {c['recompiles']}"
              + (f", CUDA graphs recorded {c.get('cudagraphs_recorded')}, skipped {c.get('cudagraph_skips')}" if c.get("cudagraphs") else ""))
        for row in (c.get("cudagraph_input_copies") or [])[:8]:
            print(f"    copied into {row['graphs']} recorded graph(s) at every replay: {row['input']}")
    g = res["memory_growth_mib"]
    print(f"  memory over {res['sessions']} session(s), last − first (MiB): "
          + ", ".join(f"{k} {v:+.1f}" for k, v in g.items() if v is not None))
    f = res["flops"]
    print(f"  FLOPs per steady chunk: linear {f['linear_flops']:.4g}, self-attn {f['self_attention_flops']:.4g}, "
          f"cross-attn {f['cross_attention_flops']:.4g}, VAE conv {f['vae_conv_flops']:.4g}")


def main(args) -> int:
    cfg = override(base_config(args), parallel={"sp": args.sp, "vae_ranks": args.vae_ranks},
                   runtime={"device": args.device, "mode": args.mode})
    resolved = C.resolve(tuple(args.candidate), cfg)  # once: the ranks get its records
    for c, _ in resolved:  # unknown, conflicting or unavailable: refused here too
        # only engine patches are applied (DiT ones in _dit_rank, VAE ones in _vae_rank): anything
        # else would be named in the result without having changed what was measured
        if c.patch_output or c.changes != "engine":
            what = "the output path" if c.patch_output else f"the {c.changes}"
            raise HarnessError(f"bench-engine --candidate {c.id}: it changes {what}, which bench-engine does not apply; use compare")
        if c.patch_vae and args.no_vae:
            raise HarnessError(f"bench-engine --candidate {c.id} changes the VAE decode, which --no-vae does not run")
    cfg = C.configure_resolved(resolved, cfg)
    for name in ("chunks", "sessions"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise HarnessError(f"--{name} must be ≥ 1")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise HarnessError(f"--json {args.json}: its folder does not exist")

    check_chunks_option(args.chunks, cfg.video.frames_per_chunk)  # up front, not in a rank minutes later
    if args.flops_only:
        print(json.dumps(count_steady_flops(cfg)))
        return 0
    if cfg.runtime.device == "cuda" and not torch.cuda.is_available():
        raise HarnessError("--device cuda but no CUDA device is visible (use --device cpu or --flops-only)")
    check_backend(cfg.runtime.attention, cfg.runtime.device)  # also one set with --set, not by a candidate
    save = (lambda res: write_result(args.json, res)) if args.json else None
    res = run_bench(cfg, args.chunks, args.peak_tflops, args.sessions, C.chosen(resolved), args.kernels, vae=not args.no_vae,
                    save=save)
    _print(res)
    sys.stdout.flush()
    return 0
