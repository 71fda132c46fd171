"""Up-front bounds: what a config, a session and a config file may ask for.

Everything here is checked before any process starts or any memory is taken, so an absurd size
is one line and exit 2 rather than an ENOMEM traceback minutes later. Two kinds of bound:

* *shape bounds* (``check_shapes``) depend on the config alone: every dimension positive, none
  beyond a generous ceiling, and a session no longer than the DiT's RoPE position table;
* *fit bounds* (``check_fits``) depend on the machine: the estimated bytes of weights, KV cache
  and frame ring against host memory, ``/dev/shm`` and (on CUDA) the device's memory. They are
  estimates from the shapes (weights and KV only; activations come on top), so they refuse what
  cannot fit, never promise that what passes will.

Files are read through ``read_bounded``: a config file or a JSON record over its ceiling is one
line, not a read of whatever happens to be at that path.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from harness.errors import ConfigError, HarnessError

#: latent frames per session that have a RoPE position (Wan's table size); the DiT reads it from here
ROPE_MAX_FRAMES = 1024
#: a config file is a few hundred bytes; anything this large is not one
MAX_CONFIG_BYTES = 1 << 20
#: a JSON record the harness wrote (manifest, summary, bench-engine or compare result, capture index)
MAX_JSON_BYTES = 64 << 20
#: generous ceilings: far above any model this harness serves, far below an allocation that hangs a host
MAX_PIXELS_SIDE = 8192
MAX = {"dim": 65536, "num_layers": 1024, "num_heads": 1024, "ffn_dim": 262144, "text_dim": 65536,
       "text_len": 65536, "freq_dim": 65536, "frames_per_chunk": 64, "fps": 240, "sp": 64, "vae_ranks": 64,
       "ring_slots": 256, "queue_depth": 1024, "max_pending_decodes": 64, "sessions": 1_000_000,
       "encoder_threads": 256, "base_dim": 4096, "num_res_blocks": 64, "max_sessions": 1024}

#: [section] fields a config file must spell out: the shapes that say which model it is. Leaving
#: one out would silently take the full LingBot model's value (a 5120-wide "tiny" model); the
#: fields not listed are architecture constants (channels, patch size, eps, VAE z_dim) or run settings.
REQUIRED_FIELDS = {
    "model": ("dim", "num_layers", "num_heads", "ffn_dim", "text_dim", "text_len", "freq_dim"),
    "video": ("height", "width", "latent_frames_per_chunk", "chunks_per_session"),
    "vae": ("base_dim", "dim_mult", "num_res_blocks"),
}

_DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


def session_frames_error(chunks: int, frames_per_chunk: int) -> str | None:
    """Why a session of ``chunks`` chunks cannot run (its latent frames exceed the position table), or None."""
    if chunks * frames_per_chunk > ROPE_MAX_FRAMES:
        return (f"a session of {chunks} chunks is {chunks * frames_per_chunk} latent frames; the model's position "
                f"table holds {ROPE_MAX_FRAMES} (at most {ROPE_MAX_FRAMES // frames_per_chunk} chunks)")
    return None


def check_chunks_option(chunks: int | None, frames_per_chunk: int) -> None:
    """A command's ``--chunks`` (None: the preset's, already checked with the config)."""
    if chunks and (err := session_frames_error(chunks, frames_per_chunk)):
        raise ConfigError(f"--chunks {chunks}: {err}")


def max_chunks(frames_per_chunk: int) -> int:
    return ROPE_MAX_FRAMES // max(frames_per_chunk, 1)


def check_required(raw: dict, where: str) -> None:
    """A config file that leaves out a shape field is refused, not completed with the full model's value."""
    for section, fields in REQUIRED_FIELDS.items():
        got = raw.get(section)
        missing = [f for f in fields if not isinstance(got, dict) or f not in got]
        if missing:
            raise ConfigError(f"{where}: [{section}] must set {', '.join(missing)} (shape fields are never "
                              "defaulted; copy them from a preset in configs/)")


def read_bounded(path: str | Path, limit: int, what: str, error: type[HarnessError] = HarnessError) -> bytes:
    """The file's bytes, refusing anything over ``limit`` without reading it all (``OSError`` is the caller's)."""
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise error(f"{path} is over {limit >> 10} KiB; not a {what}")
    return raw


def read_config_bytes(path: Path) -> bytes:
    try:
        return read_bounded(path, MAX_CONFIG_BYTES, "config file", ConfigError)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None


def _spelled(obj, field: str) -> str:
    """The field's name as the user writes it in TOML and --set (its msgspec encode name)."""
    return next((f.encode_name for f in msgspec.structs.fields(obj) if f.name == field), field)


def check_shapes(cfg) -> None:
    """Every size positive and under its ceiling; the session within the position table."""
    m, v, c, p, r, vae = cfg.model, cfg.video, cfg.cache, cfg.parallel, cfg.runtime, cfg.vae
    named = {"model": m, "video": v, "cache": c, "parallel": p, "runtime": r, "vae": vae}
    for section, obj in named.items():
        for field, ceiling in MAX.items():
            if hasattr(obj, field):
                value = getattr(obj, field)
                if not 1 <= value <= ceiling:
                    raise ConfigError(f"{section}.{_spelled(obj, field)} = {value} is outside 1-{ceiling}")
    for side in ("height", "width"):
        value = getattr(v, side)
        if not 1 <= value <= MAX_PIXELS_SIDE:
            raise ConfigError(f"video.{side} = {value} is outside 1-{MAX_PIXELS_SIDE} pixels")
    small = [("model.in_channels", m.in_channels), ("model.out_channels", m.out_channels), ("vae.z_dim", vae.z_dim),
             *((f"model.patch_size[{i}]", x) for i, x in enumerate(m.patch_size)),
             *((f"vae.dim_mult[{i}]", x) for i, x in enumerate(vae.dim_mult))]
    for name, value in small:
        if not 1 <= value <= 4096:
            raise ConfigError(f"{name} = {value} is outside 1-4096")
    if not (c.sink_frames >= 0 and c.block_size >= 0 and 1 <= c.window_frames <= ROPE_MAX_FRAMES):
        raise ConfigError(f"cache: sink_frames and block_size must be ≥ 0, window_frames in 1-{ROPE_MAX_FRAMES}")
    if not (m.eps > 0 and r.rank_timeout_s > 0 and r.stall_report_s > 0 and cfg.schedule.num_train_timesteps >= 1):
        raise ConfigError("model.eps, runtime.rank_timeout_s, runtime.stall_report_s and "
                          "schedule.num_train_timesteps must be positive")
    if r.compile_allowance_s < 0 or r.compile_allowance_chunks < 0:
        raise ConfigError("runtime.compile_allowance_s and runtime.compile_allowance_chunks must be ≥ 0")
    if not all(0 <= t <= cfg.schedule.num_train_timesteps for t in cfg.schedule.timesteps) or len(cfg.schedule.timesteps) > 1000:
        raise ConfigError(f"schedule.timesteps must lie in 0-{cfg.schedule.num_train_timesteps} (at most 1000 steps)")
    if err := session_frames_error(v.chunks_per_session, v.frames_per_chunk):
        raise ConfigError(f"video.chunks_per_session: {err}")


# ---- what the machine can hold ------------------------------------------------------------------
def estimate_bytes(cfg) -> dict[str, int]:
    """Estimated resident bytes: per DiT rank (weights + KV pool), and the host's frame ring.

    Weights: per block attention and camera GEMMs (12·dim²) and the FFN (2·dim·ffn), plus the
    embeddings (7·dim² + text_dim·dim) — within 2 % of the full model's exact count (dit.py) from
    below; every SP rank holds all of them. KV: K and V for every layer over the visible
    window, heads split over SP, one pool per resident session.
    """
    m, v = cfg.model, cfg.video
    b = _DTYPE_BYTES[cfg.runtime.dtype]
    params = m.num_layers * (12 * m.dim * m.dim + 2 * m.dim * m.ffn_dim) + m.text_dim * m.dim + 7 * m.dim * m.dim
    kv = 2 * m.num_layers * cfg.max_kv_tokens * (m.dim // cfg.parallel.sp) * b * cfg.cache.max_sessions
    ring = cfg.runtime.ring_slots * v.frames_per_chunk * 4 * v.height * v.width * 3
    return {"dit_rank": params * b + kv, "ring": ring}


def _meminfo_bytes(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _shm_free() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_fits(cfg, device_bytes: int | None = None) -> dict[str, int]:
    """Refuse a config whose estimated memory exceeds what this machine holds (one line).

    ``device_bytes``: one GPU's memory (CUDA runs; None skips that check, e.g. no GPU visible here).
    Returns the estimate (recorded in the manifest)."""
    est = estimate_bytes(cfg)
    ranks = cfg.parallel.sp
    shm = _shm_free()
    if shm is not None and est["ring"] > shm:
        raise ConfigError(f"the frame ring needs {_gib(est['ring'])} of /dev/shm, {_gib(shm)} free "
                          "(lower runtime.ring_slots or the resolution)")
    if cfg.runtime.device == "cpu":
        host = _meminfo_bytes("MemTotal")
        need = est["dit_rank"] * ranks + est["ring"]
        if host is not None and need > host:
            raise ConfigError(f"estimated {_gib(need)} of weights, KV cache and ring; this host has {_gib(host)}")
    elif device_bytes is not None and est["dit_rank"] > device_bytes:
        raise ConfigError(f"estimated {_gib(est['dit_rank'])} of weights and KV cache per DiT rank; "
                          f"the GPU holds {_gib(device_bytes)}")
    return est
