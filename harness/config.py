"""Typed configuration: model shapes, video geometry, cache, schedule, VAE, parallelism, runtime.

A preset is a TOML file in ``configs/``; every section maps onto one frozen msgspec
struct below, unknown keys are refused, and ``validate`` checks the divisibility rules
that the engine relies on (tokens and heads by SP, latent width by VAE ranks) so that a
bad shape is a one-line error before any process starts.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Literal

import msgspec

from harness.errors import ConfigError
from harness.limits import check_required, check_shapes, read_config_bytes

#: the checkout this package runs from: configs/ and the default runs/ live here
REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"

#: 16 noisy latent + 16 image-condition latent + 4 mask channels (DESIGN §2).
LATENT_CHANNELS = 16
MASK_CHANNELS = 4
VAE_SPATIAL = 8
VAE_TEMPORAL = 4
#: a config's ``name`` and a preset's: one path component of a run directory's name, never a path
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: the largest seed a session may run with (torch generators and numpy take 64-bit seeds)
MAX_SEED = 2**63 - 1
#: the Wan VAE's stages: three 2x spatial up-samplings give VAE_SPATIAL
VAE_STAGES = 4
#: Plücker rays: origin (3) + direction (3) per pixel, pixel-unshuffled by 8 onto the latent grid.
RAY_CHANNELS = 6


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelConfig(_Section):
    dim: int = 5120
    num_layers: int = 40
    num_heads: int = 40
    ffn_dim: int = 13824
    text_dim: int = 4096
    text_len: int = 512
    freq_dim: int = 256
    in_channels: int = 2 * LATENT_CHANNELS + MASK_CHANNELS
    out_channels: int = LATENT_CHANNELS
    patch_size: tuple[int, int, int] = (1, 2, 2)
    eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def cam_channels(self) -> int:
        return RAY_CHANNELS * VAE_SPATIAL * VAE_SPATIAL


class VideoConfig(_Section):
    height: int = 480
    width: int = 832
    #: Latent frames per chunk; spelled ``latent_frames_per_chunk`` in TOML, ``--set`` and
    #: manifests. A chunk decodes to 4 pixel frames per latent frame, the session's first chunk
    #: to 3 fewer (its first latent frame gives 1): ``pixel_frames``.
    frames_per_chunk: int = msgspec.field(default=3, name="latent_frames_per_chunk")
    chunks_per_session: int = 10
    fps: int = 16

    @property
    def latent_h(self) -> int:
        return self.height // VAE_SPATIAL

    @property
    def latent_w(self) -> int:
        return self.width // VAE_SPATIAL

    def pixel_frames(self, chunk: int) -> int:
        """Pixel frames decoded from chunk ``chunk``: the session's first latent frame gives 1."""
        n = self.frames_per_chunk * VAE_TEMPORAL
        return n - (VAE_TEMPORAL - 1) if chunk == 0 else n

    def session_frames(self) -> int:
        return sum(self.pixel_frames(c) for c in range(self.chunks_per_session))


class CacheConfig(_Section):
    sink_frames: int = 9
    window_frames: int = 18  # visible latent frames, the current chunk included
    block_size: int = 0  # tokens per KV block; 0 = one latent frame if legal, else a power of two
    max_sessions: int = 1  # sessions whose KV can be resident at once (pool sizing)


#: "session-stream": one generator per session seeded with the session's seed, drawn in order
#: (each chunk's initial noise, then its re-noise per step), as production draws it;
#: "per-chunk-step": every draw re-seeded from (seed, chunk, step), so a chunk's noise does not
#: depend on the chunks before it (A/B reproducibility of single chunks). harness/engine/noise.py
NoiseConvention = Literal["session-stream", "per-chunk-step"]
NOISE_CONVENTIONS: tuple[str, ...] = ("session-stream", "per-chunk-step")


class ScheduleConfig(_Section):
    timesteps: tuple[int, ...] = (1000, 750, 500, 250)
    flow_shift: float = 5.0
    num_train_timesteps: int = 1000
    noise: NoiseConvention = "session-stream"


class VaeConfig(_Section):
    base_dim: int = 96
    z_dim: int = LATENT_CHANNELS
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temporal_upsample: tuple[bool, ...] = (True, True, False)  # per up stage, Wan 2.1 layout


class ParallelConfig(_Section):
    sp: int = 1
    vae_ranks: int = 1
    #: device index per rank; empty = DiT rank r on GPU r, VAE rank r on GPU r (shared placement).
    dit_devices: tuple[int, ...] = ()
    vae_devices: tuple[int, ...] = ()


Scheduler = Literal["case-d", "case-e"]
Mode = Literal["eager", "compiled", "deterministic"]
Device = Literal["cpu", "cuda"]


class RuntimeConfig(_Section):
    device: Device = "cuda"
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    vae_dtype: Literal["float32", "bfloat16"] = "float32"
    #: the DiT's residual stream: "float32" (Wan's reference numerics) or "runtime" — the runtime
    #: dtype, rounded after every residual add where vLLM-Omni's transformer rounds it (H2b)
    residual: Literal["float32", "runtime"] = "float32"
    #: where a DiT block's last residual add (its gated FFN output) runs: "own", at the block's end,
    #: or "next", at the next block's start, where compiled it fuses with that block's first norm (H2c)
    ffn_residual: Literal["own", "next"] = "own"
    #: how the host-made values the DiT blocks read (RoPE table, modulation, camera tokens) reach
    #: them: "fresh" tensors, or "static" buffers the CUDA graphs read in place (H1g)
    block_inputs: Literal["fresh", "static"] = "fresh"
    #: the DiT self-attention's q/k RMSNorms + RoPE (and, with kv_write "graph", the K/V store):
    #: "ops", the module's own, or "kernel", one op — a Triton kernel on CUDA (H2d)
    qk_norm_rope: Literal["ops", "kernel"] = "ops"
    #: the DiT block's FFN input — its LayerNorm, modulation, rounding and, for an FP8 FFN (H6e),
    #: FFN-up's per-row quantisation: "ops", the module's own, or "kernel", one op — a Triton kernel on CUDA (H2f)
    ffn_norm: Literal["ops", "kernel"] = "ops"
    #: the DiT block's self-attention input — the carried FFN add (H2c), its first LayerNorm,
    #: modulation and rounding: "ops", the module's own, or "kernel", one op — a Triton kernel on CUDA (H2g)
    attn_norm: Literal["ops", "kernel"] = "ops"
    #: how inductor picks its generated kernels' shapes when it compiles the DiT blocks (H2e): ""
    #: its defaults; "multi-kernel" each reduction both looped and persistent (the whole row in
    #: registers), the faster timed at the first call; "coordinate-descent" each kernel's block
    #: sizes and warps tuned on the device; "both"
    inductor_tuning: Literal["", "multi-kernel", "coordinate-descent", "both"] = ""
    #: the image condition's VAE encoder in the DiT rank (engine/image.py): its dtype ("" = vae_dtype),
    #: and whether a chunk's latent frames go through it in one forward with cuDNN autotuning (H3c)
    condition_dtype: Literal["", "float32", "bfloat16", "float16"] = ""
    condition_chunk: bool = False
    #: the image condition's encoder step ``torch.compile``d (inductor, static shapes; H3c's ``-compile``)
    condition_compile: bool = False
    mode: Mode = "eager"
    scheduler: Scheduler = "case-d"
    max_pending_decodes: int = 1
    sessions: int = 6  # the warm-up session (epoch 0) included
    seed: int = 0
    attention: str = "sdpa"
    kv_path: Literal["gather", "paged"] = "gather"
    #: where a session's KV blocks lie in the pool: "window" keeps them contiguous, so "gather" reads in place (H1c)
    kv_layout: Literal["paged", "window"] = "paged"
    #: where the attention cores leave their results: "fresh" (a new tensor per call) or "static"
    #: (one persistent buffer per role, read in place by the CUDA graphs: no input copies, H1d)
    attention_out: Literal["fresh", "static"] = "fresh"
    #: who writes a chunk's K/V into the cache: "copy" (the attention core), "append" (the
    #: attention kernel itself, where it has an appending form: FA3 on the window layout, H1e) or
    #: "graph" (the block's own code, inside its compiled graph, where the K/V are made: H1f)
    kv_write: Literal["copy", "append", "graph"] = "copy"
    #: when a chunk's commit pass (the 5th forward, writing its final K/V) runs: "inline", before
    #: its latent is returned, or "deferred" to the DiT's next call, so the latent leaves one
    #: forward sooner (H5b; engine/dit_engine.py)
    commit: Literal["inline", "deferred"] = "inline"
    #: when a session's first image condition is encoded: "chunk", inside chunk 0's DiT, or
    #: "session", launched as the session starts, so the device encodes while the host makes the
    #: text conditions (H5c; engine/dit_engine.py)
    condition_start: Literal["chunk", "session"] = "chunk"
    ring_slots: int = 4
    queue_depth: int = 2
    encoder: str = "pyav"
    #: "matroska": FFV1 (either encoder backend); "fmp4": lossless H.264 in fragmented MP4 (pyav;
    #: the media of vLLM-Omni's realtime API, ``serve --listen --api vllm-omni``)
    container: Literal["matroska", "fmp4"] = "matroska"
    encoder_threads: int = 4
    sink: str = "file"  # file | null | throttled:FPS (a slow consumer reading FPS frames/s)
    save_epochs: tuple[int, ...] = (0, 1)
    rank_timeout_s: float = 600.0
    #: a stage that owes the driver a reply and sends nothing for this long is reported as stalled
    #: (stderr at once, the summary's ``stalls``); the run goes on until rank_timeout_s gives up
    stall_report_s: float = 10.0
    #: in a compiled mode (compiled, deterministic), the first ``compile_allowance_chunks`` chunks of a warm-up session may
    #: compile: their bound is stall_report_s + this (a stall past it is still reported)
    compile_allowance_s: float = 300.0
    #: chunk 0 and chunk 1 differ in shape (1 + 4·(latent − 1) frames, then 4·latent), so each compiles
    compile_allowance_chunks: int = 2
    #: GPU telemetry through NVML, samples per second in every process that owns a GPU (0: off, the
    #: default: a sampler thread takes its process's GIL at every reading); hooks/telemetry.py
    telemetry_hz: float = 0.0


class EngineConfig(_Section):
    #: the DiT: "reference" (harness.engine) or "vllm-omni" (vLLM-Omni's LingBot-World modules,
    #: the ``vllm`` extra; harness/engine/omni)
    backend: Literal["reference", "vllm-omni"] = "reference"
    #: a checkpoint for the DiT: a safetensors file or a directory of them (a sharded checkpoint),
    #: by the checkpoint's parameter names; "" = random weights from runtime.seed
    dit_weights: str = ""
    #: the VAE's (encoder and decoder): a safetensors file, or a directory holding one of
    #: engine.vae.VAE_FILENAMES; "" = random weights from runtime.seed
    vae_weights: str = ""


class HarnessConfig(_Section):
    name: str = "custom"
    engine: EngineConfig = EngineConfig()
    model: ModelConfig = ModelConfig()
    video: VideoConfig = VideoConfig()
    cache: CacheConfig = CacheConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    vae: VaeConfig = VaeConfig()
    parallel: ParallelConfig = ParallelConfig()
    runtime: RuntimeConfig = RuntimeConfig()

    # ---- derived geometry ------------------------------------------------------------
    @property
    def tokens_per_frame(self) -> int:
        _, ph, pw = self.model.patch_size
        return (self.video.latent_h // ph) * (self.video.latent_w // pw)

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_frame * self.video.frames_per_chunk

    @property
    def block_size(self) -> int:
        return resolve_block_size(self.tokens_per_frame, self.cache.block_size)

    @property
    def max_kv_tokens(self) -> int:
        return self.cache.window_frames * self.tokens_per_frame


def resolve_block_size(tokens_per_frame: int, requested: int) -> int:
    """One latent frame per block when it is a legal paged-kernel block (multiple of 16),
    otherwise the largest power of two (≤ 256) that divides a frame."""
    if requested:
        if tokens_per_frame % requested:
            raise ConfigError(f"cache.block_size {requested} does not divide {tokens_per_frame} tokens per frame")
        return requested
    if tokens_per_frame % 16 == 0:
        return tokens_per_frame
    b = math.gcd(tokens_per_frame, 256)
    return b & -b


def validate(cfg: HarnessConfig) -> HarnessConfig:
    """Raise ConfigError (one line) when the engine could not run these shapes."""
    m, v, c, p = cfg.model, cfg.video, cfg.cache, cfg.parallel
    checks = [
        (m.dim % m.num_heads == 0, f"model.dim {m.dim} is not divisible by num_heads {m.num_heads}"),
        (m.head_dim % 2 == 0, f"head_dim {m.head_dim} must be even (RoPE)"),
        (m.num_layers >= 1, "model.num_layers must be ≥ 1"),
        (v.height % (VAE_SPATIAL * m.patch_size[1]) == 0 and v.width % (VAE_SPATIAL * m.patch_size[2]) == 0,
         f"video {v.height}x{v.width} must be divisible by {VAE_SPATIAL * m.patch_size[1]} (VAE × patch)"),
        (v.frames_per_chunk >= 1 and v.chunks_per_session >= 1, "video.latent_frames_per_chunk and chunks_per_session must be ≥ 1"),
        (p.sp >= 1 and p.vae_ranks >= 1, "parallel.sp and parallel.vae_ranks must be ≥ 1"),
        (m.num_heads % p.sp == 0, f"num_heads {m.num_heads} is not divisible by sp={p.sp}"),
        (cfg.tokens_per_chunk % p.sp == 0, f"tokens per chunk {cfg.tokens_per_chunk} is not divisible by sp={p.sp}"),
        (v.latent_w % p.vae_ranks == 0, f"latent width {v.latent_w} is not divisible by vae_ranks={p.vae_ranks}"),
        (v.latent_w // p.vae_ranks >= 2, f"latent strip of {v.latent_w // max(p.vae_ranks, 1)} columns is too narrow for halos"),
        (c.sink_frames % v.frames_per_chunk == 0, f"cache.sink_frames {c.sink_frames} must be whole chunks of {v.frames_per_chunk}"),
        (c.window_frames > c.sink_frames + v.frames_per_chunk - 1,
         f"cache.window_frames {c.window_frames} must exceed sink_frames + latent_frames_per_chunk - 1"),
        ((c.window_frames - c.sink_frames) % v.frames_per_chunk == 0,
         "cache.window_frames - sink_frames must be whole chunks"),
        (list(cfg.schedule.timesteps) == sorted(cfg.schedule.timesteps, reverse=True) and len(cfg.schedule.timesteps) >= 1,
         "schedule.timesteps must be a non-empty decreasing sequence"),
        (cfg.schedule.noise in NOISE_CONVENTIONS,
         f"schedule.noise must be one of {', '.join(NOISE_CONVENTIONS)}, got {cfg.schedule.noise!r}"),
        (cfg.runtime.sessions >= 1, "runtime.sessions must be ≥ 1 (the warm-up session counts)"),
        (math.isfinite(cfg.runtime.telemetry_hz) and 0 <= cfg.runtime.telemetry_hz <= 100,
         f"runtime.telemetry_hz = {cfg.runtime.telemetry_hz:g} must be 0 (off) or a rate up to 100 samples per second"),
        (cfg.runtime.max_pending_decodes >= 1, "runtime.max_pending_decodes must be ≥ 1"),
        (cfg.runtime.condition_dtype != "float16" or cfg.runtime.device == "cuda",
         "runtime.condition_dtype = float16 needs runtime.device = cuda (the CPU has no fp16 3-D convolution worth running)"),
        (cfg.runtime.ring_slots >= 1 and cfg.runtime.queue_depth >= 1, "runtime.ring_slots and queue_depth must be ≥ 1"),
        (len(cfg.vae.temporal_upsample) == len(cfg.vae.dim_mult) - 1,
         "vae.temporal_upsample needs one entry per up stage (len(dim_mult) - 1)"),
        (sum(cfg.vae.temporal_upsample) == 2, "vae.temporal_upsample must upsample time by 4 (two stages)"),
        (cfg.runtime.container != "fmp4" or cfg.runtime.encoder == "pyav",
         f"runtime.container fmp4 is encoded by the pyav encoder, not {cfg.runtime.encoder!r}"),
    ]
    if cfg.engine.backend == "vllm-omni":
        checks += [
            (p.sp == 1, f"engine.backend vllm-omni runs with parallel.sp = 1 (vLLM-Omni's sequence parallelism needs NCCL "
                        f"on GPUs, not run here); this config has sp = {p.sp}: add --sp 1"),
            (cfg.runtime.device == "cpu", "engine.backend vllm-omni is verified on CPU only (--device cpu)"),
            # its runner is built with enforce_eager: a compiled run would be recorded as compiled and run eager
            (cfg.runtime.mode == "eager", f"engine.backend vllm-omni runs eager only (its block runner is built with "
                                          f"enforce_eager); this config has mode = {cfg.runtime.mode}: use --mode eager"),
        ]

    checks += _architecture_checks(cfg)
    check_shapes(cfg)  # sizes first: a negative or absurd dimension is named as such, not as a divisibility
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    resolve_block_size(cfg.tokens_per_frame, c.block_size)
    return cfg


def _architecture_checks(cfg: HarnessConfig) -> list[tuple[bool, str]]:
    """What the engine fixes and would otherwise refuse only inside a rank, after launch: the
    name (a path component), the channel layout, the VAE's stages, a usable flow shift and seed."""
    m, vae, r = cfg.model, cfg.vae, cfg.runtime
    shift = cfg.schedule.flow_shift
    return [
        (NAME_PATTERN.fullmatch(cfg.name) is not None,
         f"config name {cfg.name!r} must be 1-64 letters, digits, '.', '_' or '-' (it names the run directory)"),
        (m.in_channels == 2 * LATENT_CHANNELS + MASK_CHANNELS,
         f"model.in_channels = {m.in_channels}: the DiT takes {2 * LATENT_CHANNELS + MASK_CHANNELS} "
         "(noisy latent, image latent, mask)"),
        (m.out_channels == LATENT_CHANNELS, f"model.out_channels = {m.out_channels}: the DiT predicts {LATENT_CHANNELS} latent channels"),
        (m.patch_size[0] == 1, f"model.patch_size[0] = {m.patch_size[0]}: latent frames map 1:1 to token frames (must be 1)"),
        (vae.z_dim == LATENT_CHANNELS, f"vae.z_dim = {vae.z_dim}: the DiT's latent has {LATENT_CHANNELS} channels"),
        (len(vae.dim_mult) == VAE_STAGES, f"vae.dim_mult has {len(vae.dim_mult)} entries: the VAE has four stages "
                                          f"(its {VAE_SPATIAL}x spatial factor)"),
        (math.isfinite(shift) and shift > 0, f"schedule.flow_shift = {shift} must be a positive finite number"),
        (0 <= r.seed <= MAX_SEED - r.sessions, f"runtime.seed = {r.seed} is outside 0-{MAX_SEED - r.sessions} "
                                               "(session s runs with seed + s)"),
    ]


def preset_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))


#: Names that were renamed because they did not say what they count: old → new (``section.field``).
RENAMED = {"video.frames_per_chunk": "video.latent_frames_per_chunk"}


def renamed_hint(section: str, name: str) -> str:
    new = RENAMED.get(f"{section}.{name}")
    return f"{section}.{name} is now {new} (it counts latent frames; a chunk has 4 pixel frames per latent " \
           "frame, the session's first chunk 3 fewer)" if new else ""


def load_config(path: str | Path) -> HarnessConfig:
    """A TOML config, read with a size limit; shape fields must be spelled out (limits.REQUIRED_FIELDS)."""
    path = Path(path)
    raw = read_config_bytes(path)
    try:
        cfg = msgspec.toml.decode(raw, type=HarnessConfig)  # unknown keys and wrong types first: the sharper error
        check_required(msgspec.toml.decode(raw), path.name)
    except RecursionError:  # the TOML parser recurses per nesting level; a small file can nest 10^5 deep
        raise ConfigError(f"invalid config {path.name}: nested too deeply (a config is a few flat tables)") from None
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        hint = next((renamed_hint(*old.split(".")) for old in RENAMED
                     if f"`{old.split('.')[1]}` - at `$.{old.split('.')[0]}`" in str(e)), "")
        raise ConfigError(f"invalid config {path.name}: {hint or e}") from None
    return validate(cfg)


def upgrade_recorded(d: dict) -> dict:
    """A config dict recorded in a run's manifest, in today's spelling. Manifests written before a
    rename carry the old name; they are records, not input, so the old name is read as the new one."""
    d = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    for old, new in RENAMED.items():
        (sec, name), (_, new_name) = old.split("."), new.split(".")
        if name in d.get(sec, {}) and new_name not in d[sec]:
            d[sec][new_name] = d[sec].pop(name)
    return d


def load_preset(name: str) -> HarnessConfig:
    """A preset by name: a path (``../x``, ``/tmp/x``) would load any file as if it were one of configs/."""
    if NAME_PATTERN.fullmatch(name) is None:
        raise ConfigError(f"--preset {name!r} is not a preset name (known: {', '.join(preset_names())}; "
                          "use --config for a file)")
    path = CONFIG_DIR / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(preset_names())})")
    return load_config(path)


def override(cfg: HarnessConfig, **sections: dict) -> HarnessConfig:
    """Return ``cfg`` with fields replaced per section, e.g. ``override(cfg, parallel={"sp": 2})``."""
    changes = {}
    for section, fields in sections.items():
        fields = {k: v for k, v in fields.items() if v is not None}
        if fields:
            try:
                changes[section] = msgspec.structs.replace(getattr(cfg, section), **fields)
            except TypeError as e:
                raise ConfigError(f"bad override for [{section}]: {e}") from None
    return validate(msgspec.structs.replace(cfg, **changes))


def apply_sets(cfg: HarnessConfig, sets: list[str] | tuple[str, ...]) -> HarnessConfig:
    """``--set section.field=value`` overrides (value as a TOML literal, else a bare string),
    e.g. ``model.num_layers=4`` for a full-width, shallow model in a quick GPU check. The result
    is decoded and validated like a config file, so a wrong type is refused with one line."""
    if not sets:
        return cfg
    d = to_dict(cfg)
    for item in sets:
        key, eq, text = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not eq or not dot or not name:
            raise ConfigError(f"--set expects SECTION.FIELD=VALUE, got {item!r}")
        if not isinstance(d.get(section), dict) or name not in d[section]:
            raise ConfigError(f"--set {item!r}: {renamed_hint(section, name) or f'the config has no field {section}.{name}'}")
        try:
            d[section][name] = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            d[section][name] = text.strip()
        except RecursionError:  # tomllib recurses per nesting level
            raise ConfigError(f"--set {key.strip()}: the value is nested too deeply") from None
    try:
        return validate(msgspec.convert(d, HarnessConfig))
    except msgspec.ValidationError as e:
        raise ConfigError(f"--set: {e}") from None


def to_dict(cfg: HarnessConfig) -> dict:
    return msgspec.to_builtins(cfg)
