"""vLLM-Omni's LingBot-World DiT behind the harness's DiT session API.

The transformer, its K/V cache (sink + sliding window, request-local) and the DMD block runner
(four probes, x0 = x_t − σ·v, re-noise, the clean commit pass) are vLLM-Omni's own; the harness
supplies what its engine supplies to its own DiT, so runs of the two engines are comparable
chunk by chunk: the session's text embedding, image condition, camera rays (production's
conventions, harness/engine/camera.py), the timesteps and σ of the schedule, and the noise
generator (harness/engine/noise.py). The chunk's initial noise is drawn from it as production's
pipeline draws it, the re-noise by the DMD runner itself; under the default ``session-stream``
convention the generator is the session's one stream, as in production, under ``per-chunk-step``
it is re-seeded to (seed, chunk, step) before each draw.

Weights are the reference engine's: a checkpoint directory written by ``save_weights`` (or a real
one), or the seeded random init, loaded through vLLM-Omni's own ``load_weights`` (which fuses the
separate q/k/v on load). Engine-patching candidates do not apply to this model and are refused by
the worker; SP > 1 is refused (see ``compat.init_distributed``).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import Tensor

from harness.config import LATENT_CHANNELS, HarnessConfig
from harness.engine import camera, schedule
from harness.engine.conditions import (ImageCondition, SessionConditions, image_condition, session_image,
                                       session_text_embedding)
from harness.engine.dit import build_model
from harness.engine.dit_engine import Hook, chunk_camera
from harness.engine.groups import RankGroup
from harness.engine.noise import SessionNoise
from harness.engine.omni import compat
from harness.engine.weights import init_value
from harness.errors import HarnessError
from harness.hooks import context as hctx

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(eq=False)
class OmniSession:
    sid: int
    seed: int
    cache: object  # vLLM-Omni's LingBotTransformerCache (self- and cross-attention K/V)
    text: Tensor  # (1, text_len, text_dim)
    image: ImageCondition | None
    noise: SessionNoise
    chunk: int = 0
    pose_state: camera.CameraState = field(default_factory=camera.CameraState.start)
    closed: bool = False


def checkpoint_tensors(cfg: HarnessConfig, seed: int, weights_dir: str | None) -> Iterator[tuple[str, Tensor]]:
    """(name, fp32 tensor) of every checkpoint tensor: from ``weights_dir``'s safetensors files, or
    the reference engine's seeded init by the reference model's names and shapes."""
    if weights_dir:
        files = sorted(Path(weights_dir).glob("*.safetensors")) if Path(weights_dir).is_dir() else [Path(weights_dir)]
        if not files or not all(f.is_file() for f in files):
            raise HarnessError(f"no *.safetensors weights at {weights_dir}")
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                for k in h.keys():
                    yield k, h.get_tensor(k)
        return
    ref = build_model(cfg.model, device=torch.device("meta"), dtype=torch.float32)
    for name, t in ref.state_dict().items():
        yield name, init_value(name, tuple(t.shape), seed)


class OmniDitEngine:
    name = "vllm-omni"

    def __init__(self, cfg: HarnessConfig, *, group: RankGroup, device: torch.device, seed: int = 0,
                 weights_dir: str | None = None):
        m, v = cfg.model, cfg.video
        if group.size != 1 or cfg.parallel.sp != 1:
            raise HarnessError("the vllm-omni engine runs with sp=1 here: vLLM-Omni's sequence parallelism needs NCCL on GPUs, "
                               "which this integration has not been run on (use --sp 1)")
        if torch.device(device).type != "cpu":
            raise HarnessError("the vllm-omni engine is verified on CPU only (--device cpu)")
        self.cfg, self.group, self.device = cfg, group, torch.device(device)
        self.dtype = _DTYPES[cfg.runtime.dtype]
        self.frames, self.latent_hw = v.frames_per_chunk, (v.latent_h, v.latent_w)
        lb = compat.import_lingbot()
        compat.init_distributed()
        with compat.vllm_config():
            self.model = lb.transformer.CausalLingBotWorldTransformer3DModel(
                patch_size=tuple(m.patch_size), num_attention_heads=m.num_heads, attention_head_dim=m.head_dim,
                in_channels=m.in_channels, out_channels=m.out_channels, text_dim=m.text_dim, freq_dim=m.freq_dim,
                ffn_dim=m.ffn_dim, num_layers=m.num_layers, eps=m.eps, sink_size=cfg.cache.sink_frames,
                num_frames_per_block=v.frames_per_chunk, sliding_window_num_frames=cfg.cache.window_frames)
        compat.fix_rotary(self.model)
        try:
            loaded = self.model.load_weights(checkpoint_tensors(cfg, seed, weights_dir or cfg.engine.dit_weights or None))
        except (KeyError, ValueError, RuntimeError) as e:  # its loader's refusals: a name or shape it does not know
            raise HarnessError(f"vllm-omni transformer cannot load the weights: {e}") from None
        missing = sorted(set(dict(self.model.named_parameters())) - loaded)
        if missing:
            raise HarnessError(f"vllm-omni transformer: no checkpoint tensor for {missing[0]!r} ({len(missing)} missing)")
        self.model.to(device=self.device, dtype=self.dtype).eval()
        self.runner = lb.dmd_block.LingBotDMDBlockRunner(self.model, device=self.device, enforce_eager=True)
        self._modulation_cache = lb.transformer.CameraModulationCache
        sig = schedule.sigmas(cfg.schedule)
        self.steps = list(zip(schedule.model_timesteps(cfg.schedule)[: len(sig)], sig))
        self.phases = schedule.phases(cfg.schedule)
        self.rays = camera.CameraRays(v.height, v.width, self.device)
        self._sessions = itertools.count()
        self._open: dict[int, OmniSession] = {}
        self.hooks: list[Hook] = []
        #: every forward's flow prediction of the last chunk (equivalence tests read it)
        self.last_flows: list[Tensor] = []

    def attention_description(self) -> str:
        return "vllm-omni:" + self.model.blocks[0].self_attn.attn.attn_backend.get_name()

    # ---- session API (as harness.engine.dit_engine.DitEngine) ------------------------------------
    @torch.inference_mode()
    def start_session(self, conditions: SessionConditions) -> OmniSession:
        m, (h, w) = self.cfg.model, self.latent_hw
        image = session_image(conditions, self.frames, h, w, self.device)
        text = session_text_embedding(conditions, m.text_len, m.text_dim).to(self.device, self.dtype)[None]
        cache = self.model.allocate_cache(batch_size=1, latent_height=h, latent_width=w, device=self.device, dtype=self.dtype)
        s = OmniSession(sid=next(self._sessions), seed=int(conditions.seed), cache=cache, text=text, image=image,
                        noise=SessionNoise(self.cfg.schedule.noise, conditions.seed, self.device))
        self._open[s.sid] = s
        self._emit("session_start", session=s.sid)
        return s

    @torch.inference_mode()
    def generate_chunk(self, session: OmniSession, actions: list | None = None, *, poses=None) -> Tensor:
        if session.closed:
            raise HarnessError(f"session {session.sid} has ended")
        with hctx.phase(stage="dit"):
            return self._run_chunk(session, actions, poses)

    def _run_chunk(self, session: OmniSession, actions, poses) -> Tensor:
        (h, w), f = self.latent_hw, self.frames
        first = session.chunk * f
        rel, moved = chunk_camera(session.pose_state, actions, poses, f)
        cam = self.rays(rel.to(self.device))[None].to(self.dtype)
        y = image_condition(session.image, session.chunk, f, h, w, device=self.device, dtype=self.dtype)[None]
        session.noise.begin_chunk()
        x = session.noise.draw(session.chunk, 0, (1, LATENT_CHANNELS, f, h, w))
        args = dict(condition=y, camera=cam, prompt_embeds=session.text, cache=session.cache, ar=None,
                    start_frame=first, camera_cache=self._modulation_cache())
        self._emit("chunk_start", session=session.sid, chunk=session.chunk)
        self.last_flows = []
        for i, (t, sigma) in enumerate(self.steps):
            with self._step(session, i, t):
                flow = self.runner.probe_step(current_latents=x, timestep_value=t, step_index=i, **args)
            self.last_flows.append(flow[0].float())
            last = i + 1 == len(self.steps)
            # the runner draws the re-noise of step i + 1 from this generator
            x = self.runner.apply_transition(x, flow, sigma, next_sigma=None if last else self.steps[i + 1][1],
                                             generator=session.noise.generator_for(session.chunk, i + 1))
        with self._step(session, len(self.steps), 0.0):
            self.runner.commit_block_kv(latents=x, **args)
        session.pose_state = moved
        session.noise.commit_chunk()
        self._emit("chunk_end", session=session.sid, chunk=session.chunk)
        session.chunk += 1
        return x[0]

    @contextlib.contextmanager
    def _step(self, session: OmniSession, step: int, timestep: float):
        """One forward's hook scope: step_start / step_end events around ``hctx.phase(step=…)``."""
        phase = self.phases[step]
        self._emit("step_start", session=session.sid, chunk=session.chunk, phase=phase, step=step, timestep=timestep)
        with hctx.phase(step=step):
            yield
        self._emit("step_end", session=session.sid, chunk=session.chunk, phase=phase, step=step)

    def end_session(self, session: OmniSession) -> None:
        if session.closed:
            return
        self._open.pop(session.sid, None)
        session.cache = None
        session.closed = True
        self._emit("session_end", session=session.sid)

    def kv_stats(self) -> dict:
        """Latent frames of K/V held by open sessions (vLLM-Omni's request-local cache has no
        block pool; a frame stands in for a block so that 'nothing held after the end' reads the same)."""
        tpf = self.cfg.tokens_per_frame
        used = sum(s.cache.self_attention[0].end // tpf for s in self._open.values() if s.cache is not None)
        return {"blocks_used": int(used), "sessions_open": len(self._open)}

    def _emit(self, event: str, **info) -> None:
        for hook in self.hooks:
            hook(event, info)

