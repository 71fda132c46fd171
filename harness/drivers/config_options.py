"""Command-line options → a validated config and serve options, below every command.

``cli`` parses; every command (``serve``, ``compare``, ``scenario``, ``ab-engine``, …) turns its
namespace into a ``HarnessConfig`` here, so each one validates, refuses and overrides alike:
the preset or file, then ``--set``, then the flags, then the engine backend's install check and
every candidate resolved against the result — all before anything is allocated or started.
"""

from __future__ import annotations

import argparse

from harness.candidates.explicit import refuse_rewrites
from harness.config import HarnessConfig, apply_sets, load_config, load_preset, override
from harness.engine import backends
from harness.engine.checkpoint import check_checkpoints
from harness.errors import HarnessError


def add_serve_options(p: argparse.ArgumentParser) -> None:
    """The options of every command that serves the topology (serve, compare, scenario)."""
    g = p.add_argument_group("run")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--config", help="TOML config file (see configs/)")
    src.add_argument("--preset", default=None, help="preset name from configs/ (default: tiny)")
    g.add_argument("--candidate", action="append", default=[], metavar="ID", help="apply an optimisation candidate (repeatable)")
    g.add_argument("--scheduler", choices=["case-d", "case-e"])
    g.add_argument("--mode", choices=["eager", "compiled", "deterministic"])
    g.add_argument("--sessions", type=int, help="sessions including the warm-up one (epoch 0)")
    g.add_argument("--chunks", type=int, help="chunks per session (default from the preset)")
    g.add_argument("--seed", type=int)
    g.add_argument("--hooks", default="", help="comma list: nvtx,dispatch,trace,profile[=A:B],capture[=BUDGET]")
    g.add_argument("--telemetry", type=float, metavar="HZ",
                   help="sample every GPU through NVML HZ times a second into the run directory (energy per frame, "
                        "throttling; CUDA only, needs harness[gpu]; default off)")
    g.add_argument("--sp", type=int, help="DiT sequence-parallel ranks")
    g.add_argument("--vae-ranks", type=int, help="VAE width-sharded ranks")
    g.add_argument("--device", choices=["cpu", "cuda"])
    g.add_argument("--engine", choices=["reference", "vllm-omni"],
                   help="the DiT: the harness's reference engine (default) or vLLM-Omni's LingBot-World modules "
                        "(needs the vllm extra; SP=1 on CPU)")
    g.add_argument("--dit-weights", metavar="PATH",
                   help="the DiT's checkpoint: a safetensors file or a directory of them (default: random weights from --seed)")
    g.add_argument("--vae-weights", metavar="PATH",
                   help="the VAE's checkpoint (encoder and decoder): a safetensors file or a directory holding one "
                        "(default: random weights from --seed)")
    g.add_argument("--launcher", choices=["local", "ray"], default="local",
                   help="local processes, or Ray actors in a placement group (multi-node; needs harness[ray])")
    g.add_argument("--ray-address", help="Ray cluster to join (e.g. HEAD_IP:6379; default: RAY_ADDRESS, the local cluster, or a new one)")
    g.add_argument("--ray-frame-path", choices=["auto", "ring", "socket"], default="auto",
                   help="frames VAE rank 0 -> encoder: shared-memory ring on one node, socket across nodes (auto)")
    g.add_argument("--ray-cpus-per-rank", type=float, help="CPUs per rank bundle (default: a fair share, at most 1)")
    g.add_argument("--encoder", help="encoder backend (pyav, ffmpeg)")
    g.add_argument("--sink", help="sink: file, null, stream or throttled:FPS (a file sink that accepts at most FPS frames/s)")
    g.add_argument("--ring-slots", type=int)
    g.add_argument("--dit-gpus", type=_gpu_list, help="GPU index per DiT rank, e.g. 0,1 (default: rank r on GPU r)")
    g.add_argument("--vae-gpus", type=_gpu_list, help="GPU index per VAE rank, e.g. 2,3 for separate placement")
    add_set_option(g)
    g.add_argument("--out", help="run directory (default runs/<run_id>); an existing non-empty one is refused")
    g.add_argument("--no-progress", action="store_true")


def _gpu_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated GPU indices, got {text!r}") from None


def add_set_option(p) -> None:
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field (repeatable), e.g. model.num_layers=4")


def base_config(args: argparse.Namespace) -> HarnessConfig:
    """--config or --preset (default tiny), then the --set overrides; a named checkpoint checked."""
    cfg = _preset_and_sets(args)
    check_checkpoints(cfg)  # a wrong path or shape now, not as a rank's traceback after launch
    return cfg


def _preset_and_sets(args: argparse.Namespace) -> HarnessConfig:
    cfg = load_config(args.config) if args.config else load_preset(args.preset or "tiny")
    return apply_sets(cfg, getattr(args, "set", None) or [])


def resolve_config(args: argparse.Namespace) -> HarnessConfig:
    """The serve options' config: ``base_config``'s preset and --set, the flags, the backend's install check and every
    candidate (``--candidate`` and ``--baseline``) resolved against it; a refusal is a HarnessError."""
    cfg = _preset_and_sets(args)  # its checkpoints are checked once, with the flags' below
    for name in ("sessions", "chunks", "sp", "vae_ranks", "ring_slots"):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise HarnessError(f"--{name.replace('_', '-')} must be ≥ 1, got {v}")
    cfg = override(
        cfg,
        engine={"backend": getattr(args, "engine", None), "dit_weights": getattr(args, "dit_weights", None),
                "vae_weights": getattr(args, "vae_weights", None)},
        parallel={"sp": args.sp, "vae_ranks": args.vae_ranks, "dit_devices": getattr(args, "dit_gpus", None),
                  "vae_devices": getattr(args, "vae_gpus", None)},
        video={"chunks_per_session": args.chunks},
        runtime={
            "scheduler": args.scheduler, "mode": args.mode, "sessions": args.sessions, "seed": args.seed,
            "device": args.device, "encoder": args.encoder, "sink": args.sink, "ring_slots": args.ring_slots,
            "telemetry_hz": getattr(args, "telemetry", None),
        },
    )
    backends.check(cfg)  # e.g. the install command, before anything else happens
    check_checkpoints(cfg)  # --set's and the flags' together
    specs = dict.fromkeys([*getattr(args, "candidate", []), *getattr(args, "baseline", [])])  # compare names repeats itself
    refuse_rewrites(list(specs), cfg, explicit_fields(args))  # resolves every candidate against the config
    return cfg


#: option → config field it sets, for refusing a candidate that would rewrite it
_OPTION_FIELDS = {"scheduler": "runtime.scheduler", "mode": "runtime.mode", "device": "runtime.device",
                  "encoder": "runtime.encoder", "sink": "runtime.sink", "ring_slots": "runtime.ring_slots",
                  "sessions": "runtime.sessions", "seed": "runtime.seed", "sp": "parallel.sp",
                  "vae_ranks": "parallel.vae_ranks", "chunks": "video.chunks_per_session",
                  "telemetry": "runtime.telemetry_hz"}


def explicit_fields(args: argparse.Namespace) -> dict[str, str]:
    """Config fields the user set on the command line (flags and --set), each with the option that set it."""
    out = {key: f"--{name.replace('_', '-')}" for name, key in _OPTION_FIELDS.items() if getattr(args, name, None) is not None}
    for item in getattr(args, "set", None) or []:
        out[item.partition("=")[0].strip()] = f"--set {item}"
    return out


def launcher_options(args: argparse.Namespace) -> dict:
    """ServeOptions fields that pick and configure the launcher."""
    if getattr(args, "launcher", "local") != "ray":
        return {"launcher": "local"}
    return {"launcher": "ray", "launcher_options": {"address": args.ray_address, "frame_path": args.ray_frame_path,
                                                    "cpus_per_rank": args.ray_cpus_per_rank}}

