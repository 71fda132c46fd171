"""The VAE side of the reference engine: streaming, width-sharded decode sessions, image encode.

Every VAE rank builds the decoder and receives the full latent of a chunk; it decodes its own
width strip with the session's causal cache (per strip) and rank 0 gathers the strips.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch
import torch._dynamo.config as dcfg

from harness.config import VAE_SPATIAL, VAE_TEMPORAL, HarnessConfig
from harness.engine.groups import RankGroup
from harness.engine.image import encode_image
from harness.engine.vae import LOCAL, CausalCache, WanVAE, WidthOps, build_vae, cudnn_autotuned, parameter_count, tf32_allowed
from harness.engine.vae_shard import WidthShard
from harness.errors import HarnessError


@dataclass
class VaeSession:
    cache: CausalCache | None
    chunks: int = 0  # chunks decoded so far
    frames: int = 0  # pixel frames produced so far
    closed: bool = False


class VaeEngine:
    def __init__(
        self,
        cfg: HarnessConfig,
        *,
        group: RankGroup,
        device: torch.device,
        seed: int = 0,
        weights_dir: str | None = None,
    ):
        self.cfg = cfg
        self.group = group
        self.device = torch.device(device)
        self.dtype = getattr(torch, cfg.runtime.vae_dtype)
        #: the image encoder's dtype: the config's, whatever ``decode_in`` does to the decode (H3b)
        self.encode_dtype = self.dtype
        self.seed = seed
        self.weights_dir = weights_dir or cfg.engine.vae_weights or None
        self.latent_h, self.latent_w = cfg.video.latent_h, cfg.video.latent_w
        if self.latent_w % group.size or self.latent_w // group.size < 2:
            raise HarnessError(f"latent width {self.latent_w} cannot be split into {group.size} strips of ≥ 2 columns")
        self.width = WidthShard(group) if group.active else LOCAL
        self.model = build_vae(cfg.vae, encoder=False, decoder=True, seed=seed, weights=self.weights_dir,
                               device=self.device, dtype=self.dtype)
        self._encoder: WanVAE | None = None  # built on first encode_image
        self._eager_width = self.width
        #: TF32 for this engine's decodes: None leaves the process's setting, False turns it off
        #: around every decode (H3b:tf32-off), True turns it on.
        self.decode_tf32: bool | None = None
        #: latent frames a decoder forward takes after the session's first (0: the whole chunk);
        #: one is production's schedule, more give longer time axes per convolution (H3b:*-chunk)
        self.frames_per_step = 1
        #: cuDNN autotuning around each decode (None: as the process has it)
        self.decode_autotune: bool | None = None

    # -- compiled decoder (H3a) -------------------------------------------------------------------
    def compile_decoder(self, **options) -> None:
        """``torch.compile`` the decoder's per-frame step (``Decoder.compile_step``). With width
        sharding, the halo exchanges and gathers stay outside the graphs: they are collectives a
        tracer cannot follow, and their byte counter would be specialised on at every call."""
        if self.group.active:
            self.width = _Untraced(self._eager_width)
            # Each exchange splits the step into fragments that start inside a convolution, so
            # one fragment's code runs at every convolution's shape: allow a graph per shape
            # instead of dynamo's default 8, past which it would silently run eagerly.
            convs = sum(isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d)) for m in self.model.decoder.modules())
            limit = "recompile_limit" if hasattr(dcfg, "recompile_limit") else "cache_size_limit"
            setattr(dcfg, limit, max(getattr(dcfg, limit), convs + 8))
            dcfg.accumulated_recompile_limit = max(dcfg.accumulated_recompile_limit, 16 * convs)
        # static shapes: a size change must show up as a recompilation, not as a dynamic graph
        self.model.decoder.compile_step(**{"dynamic": False, **options})

    def uncompile_decoder(self) -> None:
        self.model.decoder.uncompile_step()
        self.width = self._eager_width

    @property
    def decoder_params(self) -> int:
        return parameter_count(self.model)

    # -- decode precision (H3b) --------------------------------------------------------------------
    def decode_in(self, dtype: torch.dtype, *, tf32: bool | None = None, frames_per_step: int = 1,
                  autotune: bool | None = None) -> Callable[[], None]:
        """Decode in ``dtype`` (with TF32 ``tf32`` and cuDNN autotuning ``autotune``, None: as the
        process has them; ``frames_per_step`` latent frames a forward, 0 the whole chunk) from the
        next session on; returns the revert. The decoder is cast in place (a compiled step, H3a,
        recompiles for the new dtype) after its weights are copied to the host, and the revert
        loads that copy back, so the original decode returns bit for bit. A session already open
        keeps caches of the old dtype: switch between sessions only."""
        model, old = self.model, (self.dtype, self.decode_tf32, self.frames_per_step, self.decode_autotune)
        # parameters and buffers alike: the latent statistics are buffers outside the state dict
        saved = {k: v.detach().to("cpu", copy=True) for k, v in _tensors(model)} if dtype != old[0] else None
        if saved is not None:
            model.to(dtype=dtype)
        self.dtype, self.decode_tf32, self.frames_per_step, self.decode_autotune = dtype, tf32, frames_per_step, autotune

        def revert() -> None:
            if saved is not None:
                model.to(dtype=old[0])
                for k, v in _tensors(model):
                    v.copy_(saved[k])
            self.dtype, self.decode_tf32, self.frames_per_step, self.decode_autotune = old

        return revert

    @property
    def conv_tf32(self) -> bool:
        """Whether cuDNN may run this engine's convolutions in TF32 (for the run manifest)."""
        allowed = torch.backends.cudnn.allow_tf32 if self.decode_tf32 is None else self.decode_tf32
        return self.device.type == "cuda" and self.dtype == torch.float32 and allowed

    # -- sessions ---------------------------------------------------------------------------------
    def start_session(self) -> VaeSession:
        return VaeSession(self.model.new_decode_cache())

    def decode_chunk(self, session: VaeSession, latent: torch.Tensor) -> torch.Tensor | None:
        """Decode the next chunk of a session. ``latent``: the full (z, F, h, w) normalised latent.

        Returns (3, T, H, W) float32 in [-1, 1] on group rank 0, None elsewhere, with
        T = 1 + 4(F-1) for the session's first chunk and 4F afterwards.
        """
        if session.closed or session.cache is None:
            raise HarnessError("decode_chunk on a VAE session that has ended")
        z = self.model.z_dim
        if latent.dim() != 4 or latent.shape[0] != z or tuple(latent.shape[2:]) != (self.latent_h, self.latent_w) or latent.shape[1] < 1:
            raise HarnessError(
                f"VAE latent must be ({z}, F, {self.latent_h}, {self.latent_w}), got {tuple(latent.shape)}"
            )
        strip = self.width.strip(latent) if self.group.active else latent
        strip = strip.to(device=self.device, dtype=self.dtype)[None]
        with torch.inference_mode(), tf32_allowed(self.decode_tf32), cudnn_autotuned(self.decode_autotune):
            pixels = self.model.decode(strip, session.cache, self.width, frames_per_step=self.frames_per_step)[0]
            out = self.width.gather_to_root(pixels) if self.group.active else pixels
        session.chunks += 1
        session.frames += pixels.shape[1]
        return None if out is None else out.float()

    def end_session(self, session: VaeSession) -> None:
        session.cache = None
        session.closed = True

    # -- conditioning image -----------------------------------------------------------------------
    def encode_image(self, image_uint8_hwc: np.ndarray | torch.Tensor) -> torch.Tensor:
        """(H, W, 3) uint8 RGB → (z, 1, H/8, W/8) float32 normalised latent, on this rank alone."""
        img = torch.as_tensor(image_uint8_hwc)
        if img.dtype != torch.uint8 or img.dim() != 3 or img.shape[2] != 3:
            raise HarnessError(f"encode_image wants an (H, W, 3) uint8 image, got {tuple(img.shape)} {img.dtype}")
        if img.shape[0] % VAE_SPATIAL or img.shape[1] % VAE_SPATIAL:
            raise HarnessError(f"image {img.shape[0]}x{img.shape[1]} is not a multiple of {VAE_SPATIAL}")
        if self._encoder is None:
            self._encoder = build_vae(self.cfg.vae, encoder=True, decoder=False, seed=self.seed,
                                      weights=self.weights_dir, device=self.device, dtype=self.encode_dtype)
        return encode_image(self._encoder, img, self.device, self.encode_dtype)

    @staticmethod
    def frames_for(latent_frames: int, first: bool) -> int:
        return 1 + VAE_TEMPORAL * (latent_frames - 1) if first else VAE_TEMPORAL * latent_frames


def _tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


class _Untraced(WidthOps):
    """The engine's width object, with its communication outside compiled code (a graph break at
    each halo exchange and gather; a pad with no width halo stays traced)."""

    def __init__(self, inner: WidthOps):
        self.inner, self.rank, self.size = inner, inner.rank, inner.size

    def pad2d(self, x: torch.Tensor, ph: int, pw: int) -> torch.Tensor:
        return self._exchange(x, ph, pw) if pw else self.inner.pad2d(x, ph, pw)

    @torch.compiler.disable
    def _exchange(self, x: torch.Tensor, ph: int, pw: int) -> torch.Tensor:
        return self.inner.pad2d(x, ph, pw)

    @torch.compiler.disable
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.gather(x)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)
