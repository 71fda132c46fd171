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
import stat
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
#: the longest wait a config may set (rank_timeout_s, stall_report_s): a week
MAX_WAIT_S = 7 * 24 * 3600.0
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
    """The file's bytes, refusing anything over ``limit`` without reading it all, and anything not a
    regular file without waiting on it (``OSError`` is the caller's)."""
    # O_NONBLOCK: opening a FIFO nobody writes returns at once instead of waiting for a writer
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{path} is not a regular file; not a {what}")
        os.set_blocking(fd, True)
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
    if not cfg.schedule.num_train_timesteps >= 1:
        raise ConfigError("schedule.num_train_timesteps must be positive")
    for name, value, ceiling in (("model.eps", m.eps, 1.0), ("runtime.rank_timeout_s", r.rank_timeout_s, MAX_WAIT_S),
                                 ("runtime.stall_report_s", r.stall_report_s, MAX_WAIT_S)):
        if not 0 < value <= ceiling:  # nan and inf too: a wait of inf overflows the first timed wait, in a rank
            raise ConfigError(f"{name} = {value} must be positive, finite and at most {ceiling:g}")
    for name, value in (("runtime.compile_allowance_s", r.compile_allowance_s),
                        ("runtime.compile_allowance_chunks", r.compile_allowance_chunks)):
        if not 0 <= value <= MAX_WAIT_S:  # nan and inf too
            raise ConfigError(f"{name} = {value} must be ≥ 0, finite and at most {MAX_WAIT_S:g}")
    if not all(0 <= t <= cfg.schedule.num_train_timesteps for t in cfg.schedule.timesteps) or len(cfg.schedule.timesteps) > 1000:
        raise ConfigError(f"schedule.timesteps must lie in 0-{cfg.schedule.num_train_timesteps} (at most 1000 steps)")
    if err := session_frames_error(v.chunks_per_session, v.frames_per_chunk):
        raise ConfigError(f"video.chunks_per_session: {err}")


# ---- what the machine can hold ------------------------------------------------------------------
#: one process's own footprint before it holds any tensor: Python, torch and the harness imported
#: (the VmHWM of such a process is ≈ 390 MiB on CPU; every rank, the encoder and the driver pay it)
PROCESS_BYTES = 512 << 20
#: live copies of a VAE stage's largest activation at once: the input, its padded copy with the
#: cached history, the norm and SiLU outputs, the convolution's output and the residual
VAE_ACTIVATION_COPIES = 6


def _conv(cin: int, cout: int, k: int) -> int:
    return cin * cout * k + cout


def _res(cin: int, cout: int) -> int:
    return cin + _conv(cin, cout, 27) + cout + _conv(cout, cout, 27) + (_conv(cin, cout, 1) if cin != cout else 0)


def _mid(dim: int) -> int:
    return 2 * _res(dim, dim) + dim + _conv(dim, 3 * dim, 1) + _conv(dim, dim, 1)


def vae_decoder_params(vae) -> int:
    """Parameters of the Wan 2.1 decoder (engine/vae.py's Decoder and post_quant_conv), exactly."""
    dims = [vae.base_dim * u for u in (vae.dim_mult[-1], *reversed(vae.dim_mult))]
    n = _conv(vae.z_dim, vae.z_dim, 1) + _conv(vae.z_dim, dims[0], 27) + _mid(dims[0])
    last = len(vae.dim_mult) - 1
    for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
        cin = cin // 2 if i > 0 else cin
        n += _res(cin, cout) + vae.num_res_blocks * _res(cout, cout)
        if i != last:
            n += _conv(cout, cout // 2, 9) + (_conv(cout, 2 * cout, 3) if vae.temporal_upsample[i] else 0)
    return n + dims[-1] + _conv(dims[-1], 3, 27)


def vae_encoder_params(vae) -> int:
    """Parameters of the Wan 2.1 encoder and quant_conv (the conditioning image's), exactly."""
    dims = [vae.base_dim * u for u in (1, *vae.dim_mult)]
    z2 = 2 * vae.z_dim
    n = _conv(3, dims[0], 27)
    last = len(vae.dim_mult) - 1
    down = tuple(reversed(vae.temporal_upsample))
    for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
        n += _res(cin, cout) + (vae.num_res_blocks - 1) * _res(cout, cout)
        if i != last:
            n += _conv(cout, cout, 9) + (_conv(cout, cout, 3) if down[i] else 0)
    return n + _mid(dims[-1]) + dims[-1] + _conv(dims[-1], z2, 27) + _conv(z2, z2, 1)


def vae_rank_bytes(cfg) -> int:
    """One VAE rank: its process, the decoder's weights (built in fp32 on the host first), one
    session's feature cache, a decode step's activations at its largest stage, the single-head
    attention's score matrix (the mid block attends over every latent position of a frame, the
    strip's queries against the full width) and the chunk's pixels (gathered at rank 0)."""
    v, vae, vr = cfg.video, cfg.vae, cfg.parallel.vae_ranks
    b = _DTYPE_BYTES[cfg.runtime.vae_dtype]
    dims = [vae.base_dim * u for u in (vae.dim_mult[-1], *reversed(vae.dim_mult))]
    cache = act = 0
    frames = 1  # per decode step: one latent frame, doubled by each temporal upsampling
    for i, c in enumerate(dims[1:]):
        h, w = v.latent_h << i, (v.latent_w // vr) << i
        plane = (h + 2) * (w + 2)
        widest = max(c, dims[i] if i == 0 else dims[i] // 2)  # every upsampler halves the channels
        # a stage's 3x3x3 convolutions each keep 2 padded input frames: 2 per residual block
        cache += 2 * 2 * (vae.num_res_blocks + 1) * widest * plane * b
        act = max(act, VAE_ACTIVATION_COPIES * (frames + 2) * widest * plane * b)
        if cfg.runtime.device == "cpu":  # torch's CPU conv3d unfolds its input: 27 columns per channel
            act = max(act, (VAE_ACTIVATION_COPIES + 27) * frames * widest * plane * b)
        if i < len(vae.temporal_upsample) and vae.temporal_upsample[i]:
            frames *= 2
    positions = v.latent_h * v.latent_w
    scores = positions // vr * positions * b
    pixels = 2 * 3 * v.pixel_frames(1) * v.height * v.width * 4
    allocated = vae_decoder_params(vae) * 4 + cache + act + scores + pixels
    # + 5 %: the allocator's slack — the measured peak of the same decode moves by a few MiB from
    # one process to the next, and a bound must hold for every one of them
    return PROCESS_BYTES + allocated + allocated // 20


def dit_rank_bytes(cfg) -> int:
    """One DiT rank: its process, the DiT's weights, the KV pool, every resident session's text
    (the embedding, its projection and each layer's text K/V), a chunk's activations, and the
    conditioning image's VAE encoder with its full-resolution first stage.

    Weights: per block attention and camera GEMMs (12·dim²) and the FFN (2·dim·ffn), plus the
    embeddings (7·dim² + text_dim·dim) — within 2 % of the full model's exact count (dit.py) from
    below; every SP rank holds all of them. KV: K and V for every layer over the visible
    window, heads split over SP, one pool per resident session."""
    m, v, sp = cfg.model, cfg.video, cfg.parallel.sp
    b = _DTYPE_BYTES[cfg.runtime.dtype]
    params = m.num_layers * (12 * m.dim * m.dim + 2 * m.dim * m.ffn_dim) + m.text_dim * m.dim + 7 * m.dim * m.dim
    kv = 2 * m.num_layers * cfg.max_kv_tokens * (m.dim // sp) * b * cfg.cache.max_sessions
    text = (m.text_len * m.text_dim * 4 + (1 + 2 * m.num_layers) * m.text_len * m.dim * b) * cfg.cache.max_sessions
    tokens = cfg.tokens_per_chunk
    act = tokens * (8 * m.dim + m.ffn_dim) * b + 2 * cfg.max_kv_tokens * m.dim * b  # + the gathered window K/V
    image = vae_encoder_params(cfg.vae) * 4 + VAE_ACTIVATION_COPIES * 3 * cfg.vae.base_dim * (v.height + 2) * (v.width + 2) * 4
    rays = 3 * v.frames_per_chunk * 4 * 6 * v.height * v.width * 4  # Plücker rays per pixel frame, before unshuffling
    return PROCESS_BYTES + params * b + kv + text + act + image + rays


def estimate_bytes(cfg) -> dict[str, int]:
    """Estimated resident bytes of each DiT rank, each VAE rank, and the host's frame ring.

    Every term is what the process allocates for that shape, counted from the config
    (``dit_rank_bytes``, ``vae_rank_bytes``); tests/hostile/test_memory_estimate.py holds each
    rank's estimate to at least what a process of that shape actually peaks at on the CPU, and at
    most a stated factor above it. Transient allocator slack and kernels' scratch come on top."""
    v = cfg.video
    ring = cfg.runtime.ring_slots * v.frames_per_chunk * 4 * v.height * v.width * 3
    return {"dit_rank": dit_rank_bytes(cfg), "vae_rank": vae_rank_bytes(cfg), "ring": ring}


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
    p = cfg.parallel
    shm = _shm_free()
    if shm is not None and est["ring"] > shm:
        raise ConfigError(f"the frame ring needs {_gib(est['ring'])} of /dev/shm, {_gib(shm)} free "
                          "(lower runtime.ring_slots or the resolution)")
    if cfg.runtime.device == "cpu":
        host = _meminfo_bytes("MemTotal")
        # every rank is a process of its own, the encoder and the driver two more
        need = est["dit_rank"] * p.sp + est["vae_rank"] * p.vae_ranks + est["ring"] + 2 * PROCESS_BYTES
        if host is not None and need > host:
            raise ConfigError(f"estimated {_gib(need)} for {p.sp} DiT ranks ({_gib(est['dit_rank'])} each), "
                              f"{p.vae_ranks} VAE ranks ({_gib(est['vae_rank'])} each) and the ring; "
                              f"this host has {_gib(host)}")
        return est
    # what a GPU holds: the process's own footprint stays on the host
    dit, vae = est["dit_rank"] - PROCESS_BYTES, est["vae_rank"] - PROCESS_BYTES
    shared = not p.dit_devices and not p.vae_devices  # DiT rank r and VAE rank r on GPU r
    per_gpu = max(dit + vae if shared else dit, vae)
    if device_bytes is not None and per_gpu > device_bytes:
        raise ConfigError(f"estimated {_gib(per_gpu)} per GPU (DiT rank {_gib(dit)}, VAE rank {_gib(vae)}"
                          f"{', sharing it' if shared else ''}); the GPU holds {_gib(device_bytes)}")
    return est
