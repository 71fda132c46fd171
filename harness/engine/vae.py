"""Wan 2.1 VAE for the reference engine: causal 3-D convolutions with a streaming feature cache.

The topology (and every parameter name and shape) follows diffusers' ``AutoencoderKLWan`` with
``is_residual=False``, so a real Wan 2.1 VAE checkpoint in diffusers layout loads as is and the
full-size decoder runs the production convolution shapes.

Streaming: every causal convolution keeps the last ``CACHE_T`` frames of its (already padded)
input in a ``CausalCache``, so a session is decoded latent frame by latent frame and a chunk never
re-decodes earlier chunks. The session's first latent frame skips the temporal upsamplers (Wan's
"Rep" rule) and becomes one pixel frame; every later latent frame becomes four.

Width sharding is not this module's business: every spatial padding and the attention's key/value
gather go through a ``WidthOps`` object. ``LOCAL`` sees the whole width (zero padding at both
edges); ``harness.engine.vae_shard.WidthShard`` exchanges halo columns with neighbouring ranks.
The padded frames are what the cache keeps, so a strip's cache never needs its neighbours again.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from harness.config import VaeConfig
from harness.errors import HarnessError

#: Frames of history a causal 3-tap temporal convolution needs.
CACHE_T = 2

# Per-channel statistics of the Wan 2.1 latent space; the DiT works on (z - mean) / std. They
# belong to the checkpoint's config rather than its tensors, so they live here, not in the
# safetensors file. Only meaningful for z_dim == 16; other sizes get the identity transform.
WAN21_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)
WAN21_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)


# ---- width handling ----------------------------------------------------------------------------
class WidthOps:
    """The whole width is local: spatial padding is zeros on every side, gathering is a no-op."""

    rank = 0
    size = 1

    def pad2d(self, x: torch.Tensor, ph: int, pw: int) -> torch.Tensor:
        """Pad the last two dims (H by ``ph`` zeros, W by ``pw`` columns) on both sides."""
        return F.pad(x, (pw, pw, ph, ph)) if ph or pw else x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x`` with its last dim extended to the full width, in global column order."""
        return x


LOCAL = WidthOps()


# ---- streaming state ---------------------------------------------------------------------------
class CausalCache:
    """One session's decoder (or encoder) state: a slot per causal convolution.

    A slot holds the last ``CACHE_T`` padded input frames of its convolution, ``None`` meaning
    "zeros before the start of the session", which is exactly the causal zero padding.
    """

    def __init__(self, slots: int):
        self.slots: list[torch.Tensor | None] = [None] * slots
        self.steps = 0  # coder forwards run so far
        # Whether no forward has run yet. A flag of its own, not ``steps == 0``: a compiled decoder
        # step (H3a) specialises on what it reads, and a bool has two values, a counter one per frame.
        self.first = True

    def advance(self) -> None:
        self.steps += 1
        self.first = False

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slots if t is not None)

    def copy(self) -> "CausalCache":
        """A snapshot: the convolutions replace their slot's tensor rather than write into it, so
        sharing the tensors is enough to keep this state while the copy's owner runs on."""
        out = CausalCache(len(self.slots))
        out.slots, out.steps, out.first = list(self.slots), self.steps, self.first
        return out

    def same_state(self, other: "CausalCache") -> bool:
        """Bit for bit the same history in every slot (the first-frame flag included)."""
        return self.first == other.first and len(self.slots) == len(other.slots) and all(
            (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape and torch.equal(a, b))
            for a, b in zip(self.slots, other.slots))


# ---- building blocks ---------------------------------------------------------------------------
class CausalConv3d(nn.Conv3d):
    """3-D convolution, causal in time (history from the cache), spatial padding via WidthOps."""

    def __init__(self, cin: int, cout: int, kernel, stride=1, padding=0):
        super().__init__(cin, cout, kernel, stride=stride, padding=0)
        pt, ph, pw = (padding,) * 3 if isinstance(padding, int) else tuple(padding)
        # Symmetric temporal padding p becomes 2p frames of history: the output at t sees t-2p..t.
        self.history = 2 * pt
        self.pad_h, self.pad_w = ph, pw
        self.slot = -1  # index into CausalCache.slots, assigned by the owning coder
        self.onednn_on_cpu = False  # set by the encoder (see Encoder.__init__)

    def forward(self, x: torch.Tensor, cache: CausalCache, width: WidthOps = LOCAL) -> torch.Tensor:
        x = width.pad2d(x, self.pad_h, self.pad_w)
        if self.history:
            past = cache.slots[self.slot]
            if past is None:
                past = x.new_zeros(x.shape[:2] + (self.history,) + x.shape[3:])
            x = torch.cat([past, x], dim=2)
            # clone: a view would keep the whole concatenation alive between frames
            cache.slots[self.slot] = x[:, :, -self.history:].clone()
        # (a compiled step traces F.conv3d: inductor picks the CPU kernel itself, and the direct
        # oneDNN call has no fake-tensor rule to trace it with)
        if (not torch.compiler.is_compiling() and self.onednn_on_cpu and x.device.type == "cpu" and x.dtype == torch.float32
                and torch.backends.mkldnn.is_available()):
            return torch.mkldnn_convolution(x, self.weight, self.bias, [0, 0, 0], list(self.stride), [1, 1, 1], 1)
        return F.conv3d(x, self.weight, self.bias, self.stride)


class RMSNorm(nn.Module):
    """Wan's RMS norm over channels (dim 1); gamma keeps the checkpoint's broadcast shape."""

    def __init__(self, dim: int, images: bool = False):
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones((dim, 1, 1) if images else (dim, 1, 1, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=1) * self.scale * self.gamma


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1 = RMSNorm(cin)
        self.conv1 = CausalConv3d(cin, cout, 3, padding=1)
        self.norm2 = RMSNorm(cout)
        self.conv2 = CausalConv3d(cout, cout, 3, padding=1)
        self.conv_shortcut = CausalConv3d(cin, cout, 1) if cin != cout else None

    def forward(self, x, cache: CausalCache, width: WidthOps = LOCAL):
        h = x if self.conv_shortcut is None else self.conv_shortcut(x, cache, width)
        x = self.conv1(F.silu(self.norm1(x)), cache, width)
        x = self.conv2(F.silu(self.norm2(x)), cache, width)
        return x + h


class AttentionBlock(nn.Module):
    """Single-head self-attention over the H×W positions of each frame (no attention in time).

    Queries stay on the local strip; keys and values are gathered over the full width, so a
    sharded block does 1/M of the attention work and is still exactly the global attention.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim, images=True)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x, cache: CausalCache, width: WidthOps = LOCAL):
        b, c, t, h, w = x.shape
        identity = x
        x = x.transpose(1, 2).reshape(b * t, c, h, w)
        qkv = self.to_qkv(self.norm(x))
        q = qkv[:, :c].flatten(2).transpose(1, 2).unsqueeze(1)  # (bt, 1, h*w_local, c)
        kv = width.gather(qkv[:, c:])  # (bt, 2c, h, W)
        k, v = kv.flatten(2).transpose(1, 2).unsqueeze(1).chunk(2, dim=-1)
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.squeeze(1).transpose(1, 2).reshape(b * t, c, h, w)
        x = self.proj(x)
        return x.view(b, t, c, h, w).transpose(1, 2) + identity


class Upsample2x(nn.Module):
    """Nearest-exact ×2 in H and W. Parameter-free; a module only to keep checkpoint indices."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=2.0, mode="nearest-exact")


class Resample(nn.Module):
    """Spatial ×2 up/down sampling, optionally with a causal temporal ×2 (``time_conv``).

    Modes as in Wan: upsample2d, upsample3d, downsample2d, downsample3d.
    """

    def __init__(self, dim: int, mode: str, out_dim: int | None = None):
        super().__init__()
        self.mode = mode
        if mode.startswith("upsample"):
            out_dim = dim // 2 if out_dim is None else out_dim
            # padding is applied by hand (halo exchange at the resolution the conv runs at)
            self.resample = nn.Sequential(Upsample2x(), nn.Conv2d(dim, out_dim, 3))
            self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0)) if mode == "upsample3d" else None
        elif mode.startswith("downsample"):
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))
            self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1)) if mode == "downsample3d" else None
        else:
            raise ValueError(f"unknown resample mode {mode!r}")

    def forward(self, x, cache: CausalCache, width: WidthOps = LOCAL):
        # Wan's "Rep" rule: the session's first latent frame is the conditioning image and stays
        # one frame, so it skips the temporal ×2; later frames see zeros as its history. Those
        # zeros are stored now rather than left to the empty slot, so that the second frame's
        # cache looks like every later frame's (one compiled graph serves them all, H3a).
        if self.mode == "upsample3d" and cache.first:
            cache.slots[self.time_conv.slot] = x.new_zeros(x.shape[:2] + (self.time_conv.history,) + x.shape[3:])
        elif self.mode == "upsample3d":
            # the time_conv emits both output phases as channel halves; interleave them in time
            b, c, t, h, w = x.shape
            x = self.time_conv(x, cache, width).view(b, 2, c, t, h, w)
            x = x.permute(0, 2, 3, 1, 4, 5).reshape(b, c, t * 2, h, w)
        b, c, t, h, w = x.shape
        x = x.transpose(1, 2).reshape(b * t, c, h, w)
        if self.mode.startswith("upsample"):
            up, conv = self.resample
            x = conv(width.pad2d(up(x), 1, 1))
        else:
            if width.size != 1:
                raise HarnessError("the VAE encoder does not support width sharding")
            x = self.resample(x)
        x = x.view(b, t, *x.shape[1:]).transpose(1, 2)
        if self.mode == "downsample3d":
            # Stride-2 causal time conv over (last frame of the previous call, this call); the
            # session's first frame passes through untouched.
            prev = cache.slots[self.time_conv.slot]
            cache.slots[self.time_conv.slot] = x[:, :, -1:].clone()
            if prev is not None:
                x = self.time_conv(torch.cat([prev, x], dim=2), cache, width)
        return x


class MidBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x, cache, width=LOCAL):
        x = self.resnets[0](x, cache, width)
        x = self.attentions[0](x, cache, width)
        return self.resnets[1](x, cache, width)


class UpBlock(nn.Module):
    def __init__(self, cin: int, cout: int, num_res_blocks: int, upsample_mode: str | None):
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResidualBlock(cin if i == 0 else cout, cout) for i in range(num_res_blocks + 1)]
        )
        self.upsamplers = nn.ModuleList([Resample(cout, upsample_mode)]) if upsample_mode else None

    def forward(self, x, cache, width=LOCAL):
        for resnet in self.resnets:
            x = resnet(x, cache, width)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, cache, width)
        return x


def _assign_slots(coder: nn.Module) -> int:
    n = 0
    for m in coder.modules():
        if isinstance(m, CausalConv3d):
            m.slot = n
            n += 1
    return n


class _CompiledStep:
    """A coder whose per-call ``step`` may be ``torch.compile``d (H3a: the decoder; H3c's
    ``-compile`` modes: the encoder). A session's first call runs eagerly: its empty cache slots and
    the first frame's own path would be a graph of their own used once per session. Cache slots are
    graph inputs and the slots a step stores graph outputs, so one graph per input shape serves every
    later call of every session; ``CausalCache.advance`` stays outside (a counter would be a guard)."""

    compiled_step = None

    def _step_for(self, cache: CausalCache):
        return self.step if cache.first or self.compiled_step is None else self.compiled_step

    def compile_step(self, **options) -> None:
        self.compiled_step = torch.compile(self.step, **options)

    def uncompile_step(self) -> None:
        self.compiled_step = None


class Decoder(_CompiledStep, nn.Module):
    """Wan 2.1 decoder: latent (B, z, T, h, w) → pixels (B, 3, T', 8h, 8w), streaming."""

    def __init__(self, dim: int, z_dim: int, dim_mult, num_res_blocks: int, temporal_upsample, out_channels: int = 3):
        super().__init__()
        dims = [dim * u for u in (dim_mult[-1], *reversed(dim_mult))]
        self.conv_in = CausalConv3d(z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        self.up_blocks = nn.ModuleList()
        last = len(dim_mult) - 1
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            # every Wan 2.1 upsampler halves the channels, so later stages start at half width
            cin = cin // 2 if i > 0 else cin
            mode = None if i == last else ("upsample3d" if temporal_upsample[i] else "upsample2d")
            self.up_blocks.append(UpBlock(cin, cout, num_res_blocks, mode))
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], out_channels, 3, padding=1)
        self.num_slots = _assign_slots(self)

    def forward(self, x, cache: CausalCache, width: WidthOps = LOCAL):
        if cache.first and x.shape[2] != 1:
            raise HarnessError("a decode session must start with a single latent frame")
        # The session's first frame takes another path (no temporal upsampling) once per session:
        # it runs eagerly, so every compiled call sees the same kind of frame and cache.
        x = self._step_for(cache)(x, cache, width)
        cache.advance()
        return x

    def step(self, x, cache: CausalCache, width: WidthOps = LOCAL):
        """One streaming forward: reads every cache slot and stores its replacement."""
        x = self.conv_in(x, cache, width)
        x = self.mid_block(x, cache, width)
        for block in self.up_blocks:
            x = block(x, cache, width)
        return self.conv_out(F.silu(self.norm_out(x)), cache, width)


class Encoder(_CompiledStep, nn.Module):
    """Wan 2.1 encoder: pixels (B, 3, 1+4k, H, W) → (B, 2z, 1+k, H/8, W/8), streaming, unsharded."""

    def __init__(self, dim: int, z_dim: int, dim_mult, num_res_blocks: int, temporal_downsample, in_channels: int = 3):
        super().__init__()
        dims = [dim * u for u in (1, *dim_mult)]
        self.conv_in = CausalConv3d(in_channels, dims[0], 3, padding=1)
        self.down_blocks = nn.ModuleList()
        last = len(dim_mult) - 1
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(num_res_blocks):
                self.down_blocks.append(ResidualBlock(cin, cout))
                cin = cout
            if i != last:
                self.down_blocks.append(Resample(cout, "downsample3d" if temporal_downsample[i] else "downsample2d"))
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], z_dim, 3, padding=1)
        self.num_slots = _assign_slots(self)
        # The image condition runs the encoder every chunk until its fixed point (engine/image.py).
        # PyTorch's CPU heuristic sends a batch-1 3-D convolution with few channels to its slow
        # reference kernel (slow_conv3d: 12x oneDNN's time at the tiny preset's shapes), so the
        # encoder calls oneDNN itself; the decoder keeps F.conv3d (its sharded and unsharded runs
        # are compared bit for bit, tests/engine/test_vae_shard.py).
        for m in self.modules():
            if isinstance(m, CausalConv3d):
                m.onednn_on_cpu = True

    def forward(self, x, cache: CausalCache, width: WidthOps = LOCAL):
        x = self._step_for(cache)(x, cache, width)
        cache.advance()
        return x

    def step(self, x, cache: CausalCache, width: WidthOps = LOCAL):
        """One streaming forward: reads every cache slot and stores its replacement."""
        x = self.conv_in(x, cache, width)
        for layer in self.down_blocks:
            x = layer(x, cache, width)
        x = self.mid_block(x, cache, width)
        return self.conv_out(F.silu(self.norm_out(x)), cache, width)


# ---- the autoencoder -----------------------------------------------------------------------------
class WanVAE(nn.Module):
    """Encoder and/or decoder with diffusers' top-level names (encoder., quant_conv.,
    post_quant_conv., decoder.) and the latent normalisation that sits between them and the DiT."""

    def __init__(self, cfg: VaeConfig, *, encoder: bool = True, decoder: bool = True):
        super().__init__()
        z = cfg.z_dim
        self.z_dim = z
        self.encoder = self.quant_conv = self.decoder = self.post_quant_conv = None
        if encoder:
            self.encoder = Encoder(cfg.base_dim, 2 * z, cfg.dim_mult, cfg.num_res_blocks, tuple(reversed(cfg.temporal_upsample)))
            self.quant_conv = CausalConv3d(2 * z, 2 * z, 1)
        if decoder:
            self.post_quant_conv = CausalConv3d(z, z, 1)
            self.decoder = Decoder(cfg.base_dim, z, cfg.dim_mult, cfg.num_res_blocks, cfg.temporal_upsample)
        mean, std = (WAN21_LATENTS_MEAN, WAN21_LATENTS_STD) if z == 16 else ((0.0,) * z, (1.0,) * z)
        self.register_buffer("latents_mean", torch.tensor(mean).view(1, z, 1, 1, 1), persistent=False)
        self.register_buffer("latents_std", torch.tensor(std).view(1, z, 1, 1, 1), persistent=False)

    def new_decode_cache(self) -> CausalCache:
        return CausalCache(self.decoder.num_slots)

    def decode(self, latent: torch.Tensor, cache: CausalCache, width: WidthOps = LOCAL, *, frames_per_step: int = 1) -> torch.Tensor:
        """Normalised latent (B, z, F, h, w) → pixels (B, 3, T, 8h, 8w) clamped to [-1, 1].

        ``frames_per_step`` latent frames go through the decoder per forward (0 = all at once);
        the session's first frame always goes alone. One per step is the production schedule
        (bounded activation memory); larger steps give the same result up to rounding.
        """
        x = latent * self.latents_std + self.latents_mean
        x = self.post_quant_conv(x, cache, width)  # 1×1×1: never touches the cache
        outs, i, n = [], 0, x.shape[2]
        while i < n:
            step = 1 if cache.first else (frames_per_step or n - i)
            outs.append(self.decoder(x[:, :, i : i + step], cache, width))
            i += step
        return torch.cat(outs, dim=2).clamp_(-1.0, 1.0)

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """Pixels (B, 3, 1+4k, H, W) in [-1, 1] → normalised latent mean (B, z, 1+k, H/8, W/8)."""
        if (video.shape[2] - 1) % 4:
            raise HarnessError(f"the encoder takes 1+4k frames, got {video.shape[2]}")
        groups = [video[:, :, :1]] + [video[:, :, i : i + 4] for i in range(1, video.shape[2], 4)]
        return self.encode_groups(groups, self.new_encode_cache())

    def new_encode_cache(self) -> CausalCache:
        return CausalCache(self.encoder.num_slots)

    def encode_groups(self, groups: list[torch.Tensor], cache: CausalCache, *, whole: bool = False) -> torch.Tensor:
        """Pixel groups, each one latent frame's worth (the session's first pixel frame alone, then
        4 frames at a time), continuing the encoder history in ``cache`` → normalised latent mean
        (B, z, len(groups), H/8, W/8). ``whole``: the groups after the session's first frame go
        through the encoder in one forward, not one a forward (production's schedule): the causal
        convolutions and the stride-2 time convolutions see the same frames either way, so the
        result is the same up to rounding, at more activation memory."""
        if whole and len(groups) > 1:
            first = groups[:1] if cache.first else []
            rest = groups[len(first):]
            groups = first + ([torch.cat(rest, dim=2)] if rest else [])
        parts = [self.encoder(g, cache) for g in groups]
        mu = self.quant_conv(torch.cat(parts, dim=2), cache)[:, : self.z_dim]
        return (mu - self.latents_mean) / self.latents_std


# ---- backend switches around a pass --------------------------------------------------------------
@contextlib.contextmanager
def _switched(value: bool | None, *switches: tuple[object, str]) -> Iterator[None]:
    """Process-wide backend switches (``(module, attribute)``) set to ``value`` for one pass of
    the model, then put back — a DiT in the same process must not see them changed; None leaves them."""
    if value is None:
        yield
        return
    old = [getattr(m, a) for m, a in switches]
    for m, a in switches:
        setattr(m, a, value)
    try:
        yield
    finally:
        for (m, a), v in zip(switches, old):
            setattr(m, a, v)


def tf32_allowed(allowed: bool | None):
    """cuDNN's and cuBLAS's TF32 switches."""
    return _switched(allowed, (torch.backends.cudnn, "allow_tf32"), (torch.backends.cuda.matmul, "allow_tf32"))


def cudnn_autotuned(on: bool | None):
    """cuDNN's autotuning (``cudnn.benchmark``)."""
    return _switched(on, (torch.backends.cudnn, "benchmark"))


# ---- weights -------------------------------------------------------------------------------------
def init_random_(model: nn.Module, seed: int) -> nn.Module:
    """Deterministic random weights, drawn per parameter from (seed, parameter name).

    Keying on the name makes a decoder-only and a full model agree on the shared tensors, and
    makes the values independent of construction order and device. Convolution weights are
    N(0, 1/fan_in), so each RMS-normed, SiLU'd layer keeps activations O(1); gammas sit near 1 and
    biases are small but non-zero, so a wrong padding or halo shows up in the output.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            # CPU generators keep only 32 bits of a seed, so fold seed and name into one crc
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("gamma"):
                v = 1.0 + 0.1 * r
            elif name.endswith("bias"):
                v = 0.05 * r
            else:
                v = r / math.sqrt(p[0].numel())
            p.copy_(v)
    return model


def save_weights(model: nn.Module, path: str | Path) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": "pt", "model": "wan2.1-vae"})


#: Where a weights directory may keep the VAE, first match wins (own layout, then diffusers').
VAE_FILENAMES = ("vae.safetensors", "vae/diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors")
_VAE_PREFIXES = ("encoder.", "quant_conv.", "decoder.", "post_quant_conv.")


def find_weights(weights_dir: str | Path) -> Path:
    root = Path(weights_dir)
    for name in VAE_FILENAMES:
        if (root / name).is_file():
            return root / name
    raise HarnessError(f"no VAE weights in {root} (looked for {', '.join(VAE_FILENAMES)})")


def load_weights(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a safetensors file into ``model`` strictly, copying into the existing parameters.

    A file may hold more of the VAE than ``model`` built (a decoder-only model ignores encoder.*
    and quant_conv.*); anything else unexpected, anything missing, or a shape that does not
    match is a HarnessError naming the keys.
    """
    path = Path(path)
    if not path.exists():
        raise HarnessError(f"no VAE weights at {path}")
    if path.is_dir():
        path = find_weights(path)
    own = model.state_dict()
    built = {p for p in _VAE_PREFIXES if any(k.startswith(p) for k in own)}
    try:
        f = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise HarnessError(f"cannot read VAE weights {path}: {e}") from None
    with f:
        keys = set(f.keys())
        missing = sorted(own.keys() - keys)
        unexpected = sorted(k for k in keys - own.keys() if not k.startswith(_VAE_PREFIXES) or k.startswith(tuple(built)))
        if missing or unexpected:
            raise HarnessError(
                f"VAE weights {path.name} do not match the model: "
                f"missing {len(missing)} {missing[:4]}, unexpected {len(unexpected)} {unexpected[:4]}"
            )
        with torch.no_grad():
            for k, dst in own.items():
                src = f.get_tensor(k)
                if src.shape != dst.shape:
                    raise HarnessError(f"VAE weight {k} has shape {tuple(src.shape)}, the model wants {tuple(dst.shape)}")
                dst.copy_(src)
    return model


def build_vae(
    cfg: VaeConfig,
    *,
    encoder: bool,
    decoder: bool,
    seed: int = 0,
    weights: str | Path | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> WanVAE:
    """Build on CPU in fp32, fill (random from ``seed`` or from ``weights``), then move.

    On the meta device nothing is filled: that model exists to count shapes and FLOPs.
    """
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            model = WanVAE(cfg, encoder=encoder, decoder=decoder)
        return model.to(dtype=dtype).eval().requires_grad_(False)
    model = WanVAE(cfg, encoder=encoder, decoder=decoder)
    if weights is None:
        init_random_(model, seed)
    else:
        load_weights(model, weights)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
