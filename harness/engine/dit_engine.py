"""The DiT session API the serving workers call: start a session, generate chunks, end it.

A chunk is 5 forwards of the DiT on the chunk's latent frames: 4 DMD denoise steps
(phases "denoise0".."denoise3") and the "commit" pass at t = 0 on the clean x0 that leaves the
chunk's final K/V in the cache for later chunks. Every rank of the SP group calls the same methods
in the same order; each holds the full (small) latent, draws the same noise from its own copy of
the session's noise (``schedule.noise``, harness/engine/noise.py: by default production's one
stream per session, seeded with the session's seed), runs its token slice through the blocks and
all-gathers the velocity, so the returned latent is identical on every rank.

Inside a chunk nothing waits on the host: timestep embeddings and RoPE tables are precomputed on
the device, and the only host → device traffic is once per chunk (the block table and the F×4×4
camera poses, from pinned memory on GPU).

On the meta device the engine allocates nothing (weights, KV pools and activations are shapes
only) but still runs sessions and chunks, so a dispatch recorder can count the full-size model's
FLOPs on a laptop; its latents are meta tensors.

Execution mode (``cfg.runtime.mode``): "eager" is the numerical reference. "compiled" compiles
every DiT block with ``torch.compile`` (inductor; on CUDA mode ``reduce-overhead``, i.e. CUDA
graphs through cudagraph trees, overridable with ``compile_mode=`` or ``HARNESS_COMPILE_MODE``).
The attention cores stay outside the graphs (``dit.attend_cache``), so the K length that grows
until the window saturates and the block tables never reach a compiled graph (with H1f the KV
write does, as a store by a block-id tensor of the chunk's fixed size, in place into pools that
are static addresses): the graphs see the same shapes in every chunk and every layer without
padding the block table to a fixed maximum. One set of graphs, traced in the first forward,
serves every chunk and every layer; under CUDA graphs each (layer, fragment) position is recorded
once, in the second chunk, and replayed after. A chunk is one cudagraph "generation"
(``cudagraph_mark_step_begin``): tensors of the chunk's forwards (the H2a camera cache) stay valid
through the chunk.
Inductor runs with ``emulate_precision_casts`` so fused elementwise code rounds where eager rounds.

The commit pass (``runtime.commit``): "inline" runs it before ``generate_chunk`` returns the
chunk's latent; "deferred" (H5b) returns the latent after the 4 denoising passes and runs the commit
at the engine's next call (``settle``) — the session's next chunk, another session's chunk or a new
session — so a chunk's latent reaches the decoder one forward sooner and a session's last commit,
which no chunk reads, never runs. The engine's sequence of forwards, and so every value, is the
same; the commit still belongs to its own chunk's CUDA-graph generation (it runs before the next
``cudagraph_mark_step_begin``), and a session that ends drops its pending commit with its blocks.
A session's chunk-0 image condition (``runtime.condition_start``): "chunk" encodes it inside chunk
0's DiT, when the chunk asks for it; "session" (H5c) launches that encoder pass in
``start_session``, before the text conditions are made on the host, so the device encodes while
the host works and chunk 0's DiT finds the latents made. Same passes, same values.
"deterministic" is compiled plus inductor's ``deterministic`` (no on-device autotuning) and the
process-wide flags set by the worker. ``compile_stats()`` counts what dynamo compiled, per chunk,
and the CUDA graphs recorded and skipped, so a recompilation or re-recording after warm-up shows.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch._inductor
import torch._inductor.config
from torch import Tensor
from torch._dynamo.utils import counters, get_compilation_metrics

from harness.config import LATENT_CHANNELS, HarnessConfig
from harness.engine import attn_norm, camera, ffn_norm, graph_inputs, qk_norm_rope, schedule
from harness.engine.attention import AttentionChoice, OutputBuffers
from harness.engine.conditions import (ImageCondition, SessionConditions, image_condition, model_input, session_image,
                                       session_text_embedding)
from harness.engine.dit import CameraModulation, ForwardContext, RopeTables, TokenLayout, WanDiT, build_model, sinusoidal
from harness.engine.groups import RankGroup
from harness.engine.kvcache import PagedKVCache, SessionKV
from harness.engine.noise import SessionNoise
from harness.engine.static_inputs import StaticInputs
from harness.engine.ulysses import token_range
from harness.engine.weights import init_weights, load_weights
from harness.errors import HarnessError
from harness.hooks import context as hctx

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
PAGED_STEP_FRAMES = 6

#: hook(event, info): events "session_start", "chunk_start", "step_start", "step_end",
#: "chunk_end", "session_end"; info carries session/chunk/phase/timestep/kv_tokens/q_tokens.
Hook = Callable[[str, dict], None]


@dataclass(eq=False)
class DitSession:
    sid: int
    seed: int
    kv: SessionKV
    text_kv: list[tuple[Tensor, Tensor]]
    image: ImageCondition | None
    noise: SessionNoise | None  # None on the meta device: shapes only
    chunk: int = 0
    pose_state: camera.CameraState = field(default_factory=camera.CameraState.start)  # after the last committed chunk
    kv_tokens: list[int] = field(default_factory=list)  # effective self-attention K length per chunk
    closed: bool = False


@dataclass(eq=False)
class DenoisedChunk:
    """A chunk whose clean latent exists but whose commit pass (the forward at t = 0 that leaves
    its final K/V in the cache) has not run: everything that pass and the bookkeeping after it need."""

    session: DitSession
    ctx: ForwardContext
    x0: Tensor
    y: Tensor
    cam: Tensor
    moved: camera.CameraState  # the camera state after the chunk, applied once it has committed


class DitEngine:
    def __init__(self, cfg: HarnessConfig, *, group: RankGroup, device: torch.device, seed: int = 0,
                 weights_dir: str | None = None, compile_mode: str | None = None):
        m, v = cfg.model, cfg.video
        if group.size != cfg.parallel.sp:
            raise HarnessError(f"DiT group has {group.size} ranks but parallel.sp = {cfg.parallel.sp}")
        if m.num_heads % group.size or cfg.tokens_per_chunk % group.size:
            raise HarnessError(f"sp={group.size} must divide {m.num_heads} heads and {cfg.tokens_per_chunk} tokens per chunk")
        if m.patch_size[0] != 1:
            raise HarnessError(f"temporal patch size {m.patch_size[0]} is not supported (latent frames map 1:1 to token frames)")
        self.cfg, self.group, self.device = cfg, group, torch.device(device)
        self.dtype = _DTYPES[cfg.runtime.dtype]
        self.frames = v.frames_per_chunk
        self.latent_hw = (v.latent_h, v.latent_w)
        self.grid = (self.frames, v.latent_h // m.patch_size[1], v.latent_w // m.patch_size[2])
        self.meta = self.device.type == "meta"

        self.model: WanDiT = build_model(m, device=self.device, dtype=self.dtype)
        weights_dir = weights_dir or cfg.engine.dit_weights or None
        if not self.meta:
            if weights_dir:
                load_weights(self.model, weights_dir)
            else:
                init_weights(self.model, seed)
        self.attention_choice = AttentionChoice(kv_path=cfg.runtime.kv_path, dense=cfg.runtime.attention)
        #: where a new session's KV blocks go (kvcache.LAYOUTS); read when a session opens
        self.kv_layout = cfg.runtime.kv_layout
        #: where the attention cores leave their results (attention.OutputBuffers, H1d); read per chunk
        self.outputs: OutputBuffers | None = None
        #: the engine's one OutputBuffers and StaticInputs, kept while switched to "fresh": switched
        #: off and on again (ab-engine and ab-arms switch per session), new buffers would be new
        #: static addresses, and every CUDA graph reading them would be recorded again
        self._static_outputs, self._static_inputs = OutputBuffers(), StaticInputs()
        #: who writes the chunk's K/V into the cache: "copy" (the attention core) or "append" (the
        #: attention kernel, where it has an appending form: H1e); read per chunk
        self.kv_write = cfg.runtime.kv_write
        #: the residual stream's dtype: "float32" or "runtime" (the runtime dtype, H2b); read per chunk
        self.residual = cfg.runtime.residual
        #: where a block's last residual add runs: "own" or "next" (H2c); read per chunk
        self.ffn_residual = cfg.runtime.ffn_residual
        #: static-address homes of the blocks' host-made inputs (H1g), or None; read per chunk
        self.inputs: StaticInputs | None = None
        self.block_inputs = cfg.runtime.block_inputs
        self.attention_out = cfg.runtime.attention_out
        self._qk, self._qk_tuned = "ops", False
        self._ffn_norm, self._attn_norm, self._norms_tuned = "ops", "ops", False
        #: the chunk whose commit pass waits for the engine's next call ("deferred" commit, H5b)
        self._pending: DenoisedChunk | None = None
        self._commit_when = "inline"
        self.commit = cfg.runtime.commit
        #: when a session's chunk-0 image condition is encoded: "chunk" or "session" (H5c); read per session
        self.condition_start = cfg.runtime.condition_start

        self.cache = PagedKVCache.from_config(cfg, sp=group.size, dtype=self.dtype, device=self.device)
        self.layout = TokenLayout(self.frames, cfg.tokens_per_frame, *token_range(cfg.tokens_per_chunk, group))
        # The paged path walks the cache six latent frames at a time (3 steps over a full window):
        # fewer, larger steps run faster (H200, 480×832: 5.6 ms vs 10.9 ms at one frame a step), and
        # the K/V copied per step stays a third of the window.
        self.group_blocks = self.cache.blocks_per_frame * PAGED_STEP_FRAMES
        self.sigmas = schedule.sigmas(cfg.schedule)
        self.phases = schedule.phases(cfg.schedule)
        self.timesteps = schedule.model_timesteps(cfg.schedule)
        self.hooks: list[Hook] = []
        self._sessions = itertools.count()
        self.rope = RopeTables(m.head_dim, self.grid, self.layout, self.device)
        self.qk_norm_rope = cfg.runtime.qk_norm_rope
        self.ffn_norm = cfg.runtime.ffn_norm
        self.attn_norm = cfg.runtime.attn_norm
        self.t_freq = sinusoidal(self.timesteps, m.freq_dim).to(self.device)  # (phases, freq_dim)
        self.rays = camera.CameraRays(v.height, v.width, self.device)
        #: Makes each chunk's ``CameraModulation`` (the seam H2a's camera cache installs into).
        self.camera_modulation: Callable[[], CameraModulation] = CameraModulation
        self.mode = cfg.runtime.mode
        self.compile_options: dict = {}
        self._compile_base: dict[str, int] = {}
        self._compiles_per_chunk: list[int] = []
        self._seen_compiles: set[str] = set()
        self._recompiles: list[str] = []  # first line of each guard failure that caused one
        self.cudagraphs = False
        self._tuning = cfg.runtime.inductor_tuning
        inductor_tuning(self._tuning, self.mode)  # refused before anything compiles
        #: per ``inductor_tuning`` setting, its compiled blocks and their options (H2e switches sets)
        self._compiled_sets: dict[str, tuple] = {}
        if self.mode != "eager" and not self.meta:
            self.compile(compile_mode)

    # ---- runtime switches (a candidate may flip these between forwards) --------------------------
    @property
    def attention_choice(self) -> AttentionChoice:
        return self.model.attention_choice

    @attention_choice.setter
    def attention_choice(self, choice: AttentionChoice) -> None:
        self.model.attention_choice = choice

    @property
    def kv_path(self) -> str:
        return self.attention_choice.kv_path

    @kv_path.setter
    def kv_path(self, name: str) -> None:
        self.attention_choice = replace(self.attention_choice, kv_path=name)

    @property
    def attention(self) -> str:
        return self.attention_choice.dense

    @attention.setter
    def attention(self, name: str) -> None:
        self.attention_choice = replace(self.attention_choice, dense=name)

    @property
    def attention_out(self) -> str:
        """Where the attention cores leave their results: "static" in ``self.outputs`` (H1d), or
        "fresh" tensors."""
        return "fresh" if self.outputs is None else "static"

    @attention_out.setter
    def attention_out(self, how: str) -> None:
        if how not in ("fresh", "static"):
            raise HarnessError(f"attention_out must be fresh or static, got {how!r}")
        if how != self.attention_out:
            self.outputs = self._static_outputs if how == "static" else None

    @property
    def block_inputs(self) -> str:
        """Where the blocks' host-made inputs (RoPE table, modulation, camera tokens) are handed on:
        "static" through ``self.inputs`` (H1g), or "fresh" tensors."""
        return "fresh" if self.inputs is None else "static"

    @block_inputs.setter
    def block_inputs(self, how: str) -> None:
        if how not in ("fresh", "static"):
            raise HarnessError(f"block_inputs must be fresh or static, got {how!r}")
        if how != self.block_inputs:
            self.inputs = self._static_inputs if how == "static" else None

    @property
    def inductor_tuning(self) -> str:
        """How inductor chose the compiled blocks' kernels (``runtime.inductor_tuning``, H2e): each
        setting is its own set of compiled blocks, compiled at its first use and kept."""
        return self._tuning

    @inductor_tuning.setter
    def inductor_tuning(self, how: str) -> None:
        inductor_tuning(how, self.mode)
        if how != self._tuning and self.model.compiled_blocks is None and not self.meta:
            raise HarnessError(f"inductor_tuning {how!r} tunes compiled kernels: this engine runs eager")
        if self.model.compiled_blocks is not None:
            self._compile_set(how)
        self._tuning = how

    @property
    def qk_norm_rope(self) -> str:
        """How the self-attention's q/k norms + RoPE (and H1f's K/V store) run: "ops", the module's
        own (compiled: Inductor's kernels), or "kernel", one op (``qk_norm_rope``, H2d)."""
        return self._qk

    @qk_norm_rope.setter
    def qk_norm_rope(self, how: str) -> None:
        if how not in ("ops", "kernel"):
            raise HarnessError(f"qk_norm_rope must be ops or kernel, got {how!r}")
        if how == "kernel" and not self._qk_tuned and not self.meta:  # the Triton autotuning, outside any capture
            m = self.cfg.model
            qk_norm_rope.tune(self.layout.n, m.dim, m.num_heads, self.cache.block_size, self.device)
            self._qk_tuned = True
        self._qk = how

    @property
    def ffn_norm(self) -> str:
        """How a block's FFN input (norm, modulation, rounding, FP8 quantisation) is made: "ops",
        the module's own (compiled: Inductor's kernel), or "kernel", one op (``ffn_norm``, H2f)."""
        return self._ffn_norm

    @ffn_norm.setter
    def ffn_norm(self, how: str) -> None:
        self._tune_norms("ffn_norm", how)
        self._ffn_norm = how

    @property
    def attn_norm(self) -> str:
        """How a block's self-attention input (the carried FFN add, norm, modulation, rounding) is
        made: "ops", the module's own (compiled: Inductor's kernel), or "kernel", one op (``attn_norm``, H2g)."""
        return self._attn_norm

    @attn_norm.setter
    def attn_norm(self, how: str) -> None:
        self._tune_norms("attn_norm", how)
        self._attn_norm = how

    def _tune_norms(self, switch: str, how: str) -> None:
        """Checks a norm switch's setting; the first "kernel" runs the Triton autotuning of every
        norm kernel (``fused_norm.tune``), outside any capture."""
        if how not in ("ops", "kernel"):
            raise HarnessError(f"{switch} must be ops or kernel, got {how!r}")
        if how == "kernel" and not self._norms_tuned and not self.meta:
            ffn_norm.tune(self.layout.n, self.cfg.model.dim, self.frames, self.device)
            self._norms_tuned = True

    @property
    def commit(self) -> str:
        """When a chunk's commit pass runs: "inline" (before its latent is returned) or
        "deferred" (at the engine's next call, H5b)."""
        return self._commit_when

    @commit.setter
    def commit(self, when: str) -> None:
        if when not in ("inline", "deferred"):
            raise HarnessError(f"commit must be inline or deferred, got {when!r}")
        if when != self._commit_when:
            self.settle()  # a pending commit runs before the switch, whatever the new setting
        self._commit_when = when

    def attention_description(self) -> str:
        layout = "" if self.kv_layout == "paged" else f"{self.kv_layout}:"
        return f"{layout}{self.kv_path}+{self.attention}"

    # ---- compiled mode ---------------------------------------------------------------------------
    def compile(self, compile_mode: str | None = None, extra: dict | None = None) -> None:
        """Compile the blocks (see the module docstring); the graphs are traced lazily, in the
        first forward. ``extra``: more inductor config for this compilation (experiments)."""
        mode = compile_mode or os.environ.get("HARNESS_COMPILE_MODE")
        if mode is None:
            mode = "reduce-overhead" if self.device.type == "cuda" else "default"
        options = dict(torch._inductor.list_mode_options(mode)) if mode != "default" else {}
        if self.device.type != "cuda":
            options.pop("triton.cudagraphs", None)  # CPU tensors: nothing to graph
        if hasattr(torch._inductor.config, "emulate_precision_casts"):
            options["emulate_precision_casts"] = True
        if self.mode == "deterministic" and hasattr(torch._inductor.config, "deterministic"):
            # no on-device benchmarking of kernel variants: the choice (and so the summation order)
            # would depend on timing noise and differ between launches
            options["deterministic"] = True
        options.update(extra or {})
        self.cudagraphs = bool(options.get("triton.cudagraphs"))
        # static shapes: a size change must show up as a recompilation, not as a silent dynamic graph
        self._compile_base_options = {"mode": mode, "dynamic": False, "options": options}
        self._compile_base = _dynamo_counts()
        self._note_compiles()
        self._recompiles, self._compiles_per_chunk = [], []
        self._compiled_sets = {}
        self._compile_set(self._tuning)

    def _compile_set(self, tuning: str) -> None:
        """The blocks compiled with ``tuning``'s inductor options on top of ``compile``'s (traced
        lazily, at their first forward), or the set compiled before for it, made current."""
        if tuning not in self._compiled_sets:
            base = self._compile_base_options
            options = {**base["options"], **inductor_tuning(tuning, self.mode)}
            self.model.compile_blocks(dynamic=False, options=options)
            self._compiled_sets[tuning] = (self.model.compiled_blocks, self.model.last_add,
                                           {"mode": base["mode"], "dynamic": False, "options": options})
        self.model.compiled_blocks, self.model.last_add, self.compile_options = self._compiled_sets[tuning]

    def compile_stats(self) -> dict:
        """What dynamo compiled since ``compile`` (process-wide counters): ``frames`` compiled
        (every graph fragment and every recompilation), ``graphs``, ``graph_breaks``,
        ``recompiles`` (frames compiled again after a guard failed, with the last reasons), and
        ``compiles_per_chunk`` — all zeros after the first chunk when nothing recompiles. Under
        CUDA graphs also the graphs recorded and ``cudagraph_input_copies``: the inputs copied
        into the recorded graphs at every replay, named by source line (``graph_inputs``)."""
        if self.model.compiled_blocks is None:
            return {"mode": self.mode, "compiled": False}
        self._note_compiles()
        now = _dynamo_counts()
        out = {"mode": self.mode, "compiled": True, "options": dict(self.compile_options)}
        out.update({k: now[k] - self._compile_base.get(k, 0) for k in now})
        out["recompiles"] = len(self._recompiles)
        out["recompile_reasons"] = self._recompiles[-5:]
        out["compiles_per_chunk"] = list(self._compiles_per_chunk)
        out["cudagraphs"] = self.cudagraphs
        if self.cudagraphs:
            out.update(graph_inputs.report(self.device))
        return out

    def _note_compiles(self) -> None:
        # dynamo keeps metrics of its last 64 compilations only; a chunk compiles far fewer, so
        # looking after every chunk that compiled anything misses none
        for m in get_compilation_metrics():
            cid = str(m.compile_id)
            if cid not in self._seen_compiles:
                self._seen_compiles.add(cid)
                if reason := getattr(m, "recompile_reason", None):
                    self._recompiles.append(reason.splitlines()[0].strip())

    # ---- session API -----------------------------------------------------------------------------
    @torch.inference_mode()
    def start_session(self, conditions: SessionConditions) -> DitSession:
        self.settle()  # before anything else touches the device or the cache
        m = self.cfg.model
        image = session_image(conditions, self.frames, *self.latent_hw, self.device)
        if image is not None and self.condition_start == "session" and not self.meta:
            # launched before the text is made on the host: the device encodes meanwhile, and chunk
            # 0 asks for the same latents again (ImageCondition hands the last chunk's back)
            with hctx.phase(stage="dit", chunk=0):
                image.latents(0)
        text = session_text_embedding(conditions, m.text_len, m.text_dim).to(self.device, self.dtype)
        noise = None if self.meta else SessionNoise(self.cfg.schedule.noise, conditions.seed, self.device)
        kv = self.cache.open(self.kv_layout)
        s = DitSession(sid=next(self._sessions), seed=int(conditions.seed), kv=kv,
                       text_kv=self.model.text_kv(text), image=image, noise=noise)
        self._emit("session_start", session=s.sid)
        return s

    @torch.inference_mode()
    def generate_chunk(self, session: DitSession, actions: list[str] | None = None, *, poses=None) -> Tensor:
        """The next chunk's clean latent (16, frames_per_chunk, h, w), fp32, identical on every rank.
        ``poses`` (frames, 4, 4) camera-to-world matrices may replace ``actions``."""
        if session.closed:
            raise HarnessError(f"session {session.sid} has ended")
        with hctx.phase(stage="dit"):
            return self._generate_chunk(session, actions, poses)

    def _generate_chunk(self, session: DitSession, actions: list[str] | None, poses) -> Tensor:
        if self.model.compiled_blocks is None:
            self.settle()
            return self._run_chunk(session, actions, poses)
        before = _dynamo_counts()["frames"]
        try:
            self.settle()  # in the generation of the chunk it belongs to, so before the next one begins
            if self.cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            return self._run_chunk(session, actions, poses)
        finally:
            compiled = _dynamo_counts()["frames"] - before
            self._compiles_per_chunk.append(compiled)
            if compiled:
                self._note_compiles()

    def _run_chunk(self, session: DitSession, actions: list[str] | None, poses) -> Tensor:
        done = self._denoise(session, actions, poses)
        if self.commit == "deferred":
            self._pending = done
        else:
            self._commit(done)
        return done.x0

    def _denoise(self, session: DitSession, actions: list[str] | None, poses) -> DenoisedChunk:
        first = session.kv.next_frame
        rel, moved = chunk_camera(session.pose_state, actions, poses, self.frames)
        rays = self.rays(_to_device(rel, self.device))
        cam = self.model.camera_tokens(rays, self.layout).to(self.dtype)
        y = image_condition(session.image, session.chunk, self.frames, *self.latent_hw, device=self.device, dtype=self.dtype)
        self.cache.begin_chunk(session.kv, self.frames)
        session.kv_tokens.append(self.cache.visible_tokens(session.kv))
        rope = self.rope.for_chunk(first)
        if self.inputs is not None:
            rope = self.inputs.hold("rope", rope)
        ctx = ForwardContext(group=self.group, layout=self.layout, grid=self.grid, rope=rope,
                             cache=self.cache, kv=session.kv, text_kv=session.text_kv, group_blocks=self.group_blocks,
                             camera=self.camera_modulation(), outputs=self.outputs, kv_write=self.kv_write,
                             residual=self.dtype if self.residual == "runtime" else torch.float32,
                             ffn_residual=self.ffn_residual, inputs=self.inputs,
                             qk=qk_norm_rope.fused_qk if self._qk == "kernel" else None,
                             ffn_in=ffn_norm.fused_ffn if self._ffn_norm == "kernel" else None,
                             attn_in=attn_norm.fused_attn_in if self._attn_norm == "kernel" else None)
        if self.hooks:
            self._emit("chunk_start", session=session.sid, chunk=session.chunk, kv_tokens=session.kv_tokens[-1])

        if session.noise is not None:
            session.noise.begin_chunk()
        x = self._noise(session, 0)
        x0 = x
        steps = len(self.sigmas)
        for i in range(steps):
            v = self._forward(session, ctx, x, y, cam, i)
            x0 = schedule.predict_x0(x, v, self.sigmas[i])
            if i + 1 < steps:
                x = schedule.renoise(x0, self._noise(session, i + 1), self.sigmas[i + 1])
        return DenoisedChunk(session, ctx, x0, y, cam, moved)

    def _commit(self, done: DenoisedChunk) -> None:
        session = done.session
        self._forward(session, done.ctx, done.x0, done.y, done.cam, len(self.sigmas))  # K/V of the clean chunk
        done.ctx.camera.end_chunk()  # what it kept lives for one chunk: the next one has new poses
        self.cache.commit(session.kv)
        # only once the chunk committed: a failed chunk retries from the same place
        session.pose_state = done.moved
        if session.noise is not None:
            session.noise.commit_chunk()
        if self.hooks:
            self._emit("chunk_end", session=session.sid, chunk=session.chunk)
        session.chunk += 1

    def settle(self) -> None:
        """Run the pending commit pass, if a deferred one waits (no-op otherwise). It stays pending
        until it has run through: a commit that fails runs again at the next call."""
        if self._pending is not None:
            with torch.inference_mode(), hctx.phase(stage="dit"):  # also when a new session's start settles it
                self._commit(self._pending)
            self._pending = None

    @property
    def pending_commit(self) -> DitSession | None:
        """The session whose last chunk waits for its commit pass, if one does."""
        return None if self._pending is None else self._pending.session

    def _forward(self, session: DitSession, ctx: ForwardContext, x: Tensor, y: Tensor, cam: Tensor, step: int) -> Tensor:
        phase = self.phases[step]
        if self.hooks:
            self._emit("step_start", session=session.sid, chunk=session.chunk, phase=phase, step=step,
                       timestep=self.timesteps[step], kv_tokens=session.kv_tokens[-1],
                       q_tokens=self.cfg.tokens_per_chunk)
        t = self.t_freq[step].expand(self.frames, -1)  # one timestep per latent frame
        with hctx.phase(step=step):  # 0..3 denoise, 4 commit (the name is self.phases[step])
            v = self.model(model_input(x, y), t, cam, ctx)
        if self.hooks:
            self._emit("step_end", session=session.sid, chunk=session.chunk, phase=phase, step=step)
        return v

    def advance_without_compute(self, session: DitSession) -> None:
        """Meta device only: move a session's KV bookkeeping past one chunk without running it, so
        FLOP counting reaches the saturated window without executing the warm-up chunks (on meta
        there are no values to keep, only block tables)."""
        if self.device.type != "meta":
            raise HarnessError("advance_without_compute is for FLOP counting on the meta device")
        self.settle()
        self.cache.begin_chunk(session.kv, self.frames)
        self.cache.commit(session.kv)
        session.chunk += 1

    def end_session(self, session: DitSession) -> None:
        if session.closed:
            return
        if self.pending_commit is session:  # no later chunk will read what it would write
            self._pending = None
        self.cache.free_session(session.kv)
        session.text_kv = []
        session.image = session.noise = None
        session.closed = True
        if self.hooks:
            self._emit("session_end", session=session.sid)

    def kv_stats(self) -> dict:
        return self.cache.stats()

    # ---- internals -------------------------------------------------------------------------------
    def _noise(self, session: DitSession, step: int) -> Tensor:
        shape = (LATENT_CHANNELS, self.frames, *self.latent_hw)
        if session.noise is None:  # meta: shapes only
            return torch.empty(shape, device=self.device)
        return session.noise.draw(session.chunk, step, shape)

    def _emit(self, event: str, **info) -> None:
        for h in self.hooks:
            h(event, info)


def chunk_camera(state: camera.CameraState, actions: list | None, poses, frames: int) -> tuple[Tensor, camera.CameraState]:
    """A chunk's framewise camera poses (frames, 4, 4) fp32 on the host, and the camera state
    after it (applied by the caller once the chunk has committed)."""
    if poses is not None:
        world, pitch, scale = camera.validate_poses(poses, frames), state.pitch, camera.TRANSLATE_STEP
    elif actions is not None:
        world, pitch = camera.integrate_actions(camera.validate_actions(actions, frames), state)
        scale = None
    else:
        raise HarnessError("generate_chunk needs actions (one per latent frame) or poses")
    return camera.framewise_poses(state.pose, world, scale), camera.CameraState(world[-1].copy(), pitch)


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


#: H2e's inductor options per ``runtime.inductor_tuning`` (both timed on the device as they compile)
INDUCTOR_TUNING: dict[str, dict] = {
    "": {},
    "multi-kernel": {"triton.multi_kernel": 1},
    "coordinate-descent": {"coordinate_descent_tuning": True},
    "both": {"triton.multi_kernel": 1, "coordinate_descent_tuning": True},
}


def inductor_tuning(how: str, mode: str) -> dict:
    """The inductor options of ``runtime.inductor_tuning``; refused in the deterministic mode, whose
    point is that nothing is chosen by timing (a kernel chosen by timing noise sums in another
    order from one launch to the next)."""
    if how not in INDUCTOR_TUNING:
        raise HarnessError(f"runtime.inductor_tuning must be one of {sorted(INDUCTOR_TUNING)}, got {how!r}")
    if how and mode == "deterministic":
        raise HarnessError(f"runtime.inductor_tuning {how!r} picks kernels by timing them: not in the deterministic mode")
    return dict(INDUCTOR_TUNING[how])


def _dynamo_counts() -> dict[str, int]:
    # cudagraph_skips: graphs inductor declined to record as CUDA graphs (they run without)
    return {"frames": counters["frames"]["ok"], "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}
