"""Production's side of the vLLM-Omni equivalence tests: a LingBot-World session from its request
(seed, prompt, image, per-chunk actions) through vLLM-Omni's own modules, in the order its
stepwise pipeline runs them.

vLLM-Omni's pipeline module (``lingbot_world/pipeline.py``) cannot be imported here: it imports
``vllm_omni.diffusion.models.wan2_2``, whose ``__init__`` imports torchvision, and torchvision's
PyPI build needs a CUDA torch (the CPU box has none; the ``vllm`` extra's install removes it).
So the pipeline's glue between its modules is restated from its reading, and everything that
computes is theirs or diffusers':

* noise: the runner's ``torch.Generator`` on the worker's device (the CPU here), seeded with the
  request's seed (``DiffusionModelRunner._initialize_generator``); ``LingBotDMDBlockRunner.
  generate_block`` draws each block's initial noise from it and its ``apply_transition`` the
  re-noise, in order, for the session's whole life (``_prepare_next_chunk`` / ``step_scheduler``);
* image condition (``_prepare_condition_chunk``): diffusers' ``AutoencoderKLWan`` encoder run per
  latent frame with one feature cache kept across chunks, the image as the session's first pixel
  frame (scaled ÷ 255 × 2 − 1, ``_prepare_image_tensor``), four zero pixel frames per later latent
  frame; ``quant_conv``, the mean half, normalised by latents_mean/std; a mask of ones on the
  session's first latent frame. (Production stops encoding at the encoder's fixed point and reuses
  the last condition, which is the same tensor by construction; here it encodes every chunk.)
* camera (``_prepare_camera`` for a ``camera_action_script``): ``integrate_lingbot_camera_actions``
  from the previous chunk's last pose and pitch, ``build_plucker_embedding`` over [anchor, poses]
  (identity anchor for the first chunk), the anchor's rays dropped, pixel-unshuffled by 8;
* the DiT and the DMD block (four probes, re-noise, the clean commit): the transformer and
  ``LingBotDMDBlockRunner.generate_block`` themselves, on a request-local K/V cache (the paged AR
  state needs production's own runner processes).

The text condition is not production's: it has no UMT5 checkpoint here, so both sides take the
harness's synthetic embedding of the prompt.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from harness.config import LATENT_CHANNELS, MASK_CHANNELS, VAE_TEMPORAL


def production_rays(lingbot, chunks, *, height: int, width: int, poses_per_chunk=None) -> list[torch.Tensor]:
    """Production's folded (384, F, h, w) camera map per chunk, for key actions (its action path)
    or for absolute poses (its pose-stream path, translations divided by the 0.05 step)."""
    A, C = lingbot.actions, lingbot.camera
    tail, pitch, out = None, 0.0, []
    for c in range(len(chunks if poses_per_chunk is None else poses_per_chunk)):
        if poses_per_chunk is None:
            frames = [list(a) if isinstance(a, str) else a for a in chunks[c]]
            traj, pitch = A.integrate_lingbot_camera_actions(
                frames, width=width, height=height, initial_pose=None if tail is None else tail.poses[-1],
                initial_pitch=pitch)
            scale = None
        else:
            traj = A.camera_trajectory_from_absolute_pose(torch.from_numpy(poses_per_chunk[c]), width=width, height=height)
            scale = A.LINGBOT_CONTROLLER_TRANSLATION_UNIT
        anchor = tail if tail is not None else C.CameraTrajectory(
            poses=torch.eye(4, dtype=traj.poses.dtype)[None], intrinsics=traj.intrinsics[:1])
        full = C.CameraTrajectory(poses=torch.cat((anchor.poses, traj.poses)),
                                  intrinsics=torch.cat((anchor.intrinsics, traj.intrinsics)))
        emb = C.build_plucker_embedding(full, height=height, width=width, target_height=height, target_width=width,
                                        device=torch.device("cpu"), dtype=torch.float32, translation_scale=scale)[1:]
        tail = C.CameraTrajectory(poses=traj.poses[-1:].clone(), intrinsics=traj.intrinsics[-1:].clone())
        out.append(F.pixel_unshuffle(emb, 8).permute(1, 0, 2, 3))
    return out


def diffusers_vae(vae_cfg, state_dict, latents_mean, latents_std):
    """diffusers' AutoencoderKLWan (Wan 2.1 layout) holding the harness VAE's weights, by name."""
    from diffusers import AutoencoderKLWan  # the vllm extra's dependency: imported by the tests that have it

    vae = AutoencoderKLWan(base_dim=vae_cfg.base_dim, z_dim=vae_cfg.z_dim, dim_mult=list(vae_cfg.dim_mult),
                           num_res_blocks=vae_cfg.num_res_blocks,
                           temperal_downsample=list(reversed(vae_cfg.temporal_upsample)),
                           latents_mean=list(latents_mean), latents_std=list(latents_std)).eval()
    missing, unexpected = vae.load_state_dict(state_dict, strict=False)
    if missing or unexpected:
        raise AssertionError(f"diffusers' VAE does not take the harness's weights: {missing[:3]} {unexpected[:3]}")
    return vae


class ProductionCondition:
    """The (1, 20, F, h, w) image condition of each chunk in turn, as ``_prepare_condition_chunk``."""

    def __init__(self, vae, image_uint8_hwc: np.ndarray, frames: int):
        self.vae, self.frames = vae, frames
        img = torch.from_numpy(np.asarray(image_uint8_hwc, dtype=np.float32).copy()).permute(2, 0, 1)[None] / 255.0
        self.image = (img * 2.0 - 1.0).unsqueeze(2)
        self.zeros = torch.zeros(1, 3, VAE_TEMPORAL, *img.shape[-2:])
        self.cache = None
        self.chunk = 0

    @torch.no_grad()
    def next(self) -> torch.Tensor:
        pending = [None] * int(self.vae._cached_conv_counts["encoder"]) if self.cache is None else list(self.cache)
        parts = [self.vae.encoder(self.image if self.chunk == 0 and i == 0 else self.zeros, feat_cache=pending, feat_idx=[0])
                 for i in range(self.frames)]
        mu = self.vae.quant_conv(torch.cat(parts, dim=2)).chunk(2, dim=1)[0]
        shape = (1, -1, 1, 1, 1)
        mean = torch.as_tensor(self.vae.config.latents_mean, dtype=mu.dtype).view(*shape)
        std = torch.as_tensor(self.vae.config.latents_std, dtype=mu.dtype).view(*shape)
        latent = (mu - mean) / std
        mask = latent.new_zeros(1, MASK_CHANNELS, *latent.shape[2:])
        if self.chunk == 0:
            mask[:, :, 0] = 1
        self.cache, self.chunk = pending, self.chunk + 1
        assert latent.shape[1] == LATENT_CHANNELS
        return torch.cat((mask, latent), dim=1)


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass


def production_session(transformer, runner, *, seed: int, text: torch.Tensor, condition: ProductionCondition,
                       rays: list[torch.Tensor], schedule, latent_hw: tuple[int, int]) -> list[torch.Tensor]:
    """Every chunk's committed latent (16, F, h, w) of a session, production's way (module docstring).
    ``text``: (1, text_len, text_dim); ``rays``: one (384, F, h, w) map per chunk."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    h, w = latent_hw
    cache = transformer.allocate_cache(batch_size=1, latent_height=h, latent_width=w, device=torch.device("cpu"),
                                       dtype=torch.float32)
    out = []
    with torch.inference_mode():
        for c, cam in enumerate(rays):  # generate_block opens the block's camera-modulation cache itself
            out.append(runner.generate_block(condition=condition.next(), camera=cam[None], prompt_embeds=text, cache=cache,
                                             ar=None, start_frame=c * condition.frames, schedule=tuple(schedule),
                                             generator=generator, progress_bar=_NoProgress())[0].float())
    return out
