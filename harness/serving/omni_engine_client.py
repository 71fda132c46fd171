"""The harness's engine behind vLLM-Omni's own realtime video handler.

vLLM-Omni's ``OmniStreamingVideoOutputHandler`` (``WS /v1/realtime/video``) talks to its engine
through a small surface: ``generate`` (an async stream of request outputs, one per generated
chunk), ``abort``, ``submit_interaction_async``, ``default_sampling_params_list`` and
``stage_configs``; it encodes the media itself. ``HarnessEngineClient`` is that surface over the
harness's DiT and VAE engines, run in this process on one rank (SP 1, one VAE rank), so a user can
mount production's handler over the harness's engine (``omni_app``) and measure it with
``client --api vllm-omni``.

What a request means here (production's LingBot-World conventions):

- ``width``/``height`` must be the preset's; ``num_frames`` = (chunks·F − 1)·4 + 1 for F latent
  frames per chunk (a whole number of chunks), default the preset's session;
- ``seed`` seeds the session; ``extra_params.camera_action_script`` holds one list of F
  per-latent-frame key lists per chunk (absent: no motion); ``flow_shift``, when given, must be the
  preset's (the schedule is the preset's, not a request's);
- the image (``image_reference``) is VAE-encoded as the first frame's condition, and must be the
  preset's size.

Interactions are queued as they arrive and applied at the next chunk boundary, all of those queued
by then, in arrival order: an ``event.prompt`` replaces the session's text condition; an
``event.multi_modal_data.camera = {"keys": [...]}`` (the harness's camera event,
``omni_protocol.CameraInput``; production's SE(3) camera payload is not understood and refused)
holds those keys on every latent frame from the applying chunk on, instead of the script, until
the next camera event. Each chunk's stream metadata names the event ids it applied
(``started_event_ids`` and ``completed_event_ids``: an event is applied whole within one chunk).

Each chunk is computed in a worker thread, so the handler's event loop keeps answering pings and
interactions while the engine runs; one session runs at a time (a second waits for the engine).
Every generated chunk's uint8 frames are kept per request id (``generated``) so a test can compare
what the client decoded with what was generated.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import numpy as np
import torch

from harness.config import VAE_TEMPORAL, HarnessConfig, override
from harness.engine import camera
from harness.engine.conditions import SessionConditions, session_text_embedding
from harness.engine.convert import to_uint8
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup
from harness.engine.omni import compat
from harness.engine.vae_engine import VaeEngine
from harness.errors import HarnessError

#: the one stage production's handler looks for: a diffusion stage whose final output is video
STAGE_CONFIGS = ({"stage_id": 0, "stage_type": "diffusion", "final_output": True, "final_output_type": "video"},)


def session_num_frames(chunks: int, latent_per_chunk: int) -> int:
    """Pixel frames of a session of ``chunks`` chunks: (chunks·F − 1)·4 + 1."""
    return (chunks * latent_per_chunk - 1) * VAE_TEMPORAL + 1


def chunks_for(num_frames: int, latent_per_chunk: int) -> int:
    """The chunks ``num_frames`` pixel frames make; refused unless it is a whole number of chunks."""
    latent, rem = divmod(num_frames - 1, VAE_TEMPORAL)
    chunks, rem2 = divmod(latent + 1, latent_per_chunk)
    if num_frames < 1 or rem or rem2 or chunks < 1:
        raise HarnessError(f"num_frames {num_frames} is not a whole number of chunks: expected (chunks·{latent_per_chunk} − 1)·"
                           f"{VAE_TEMPORAL} + 1, e.g. {session_num_frames(1, latent_per_chunk)}, "
                           f"{session_num_frames(2, latent_per_chunk)}, …")
    return chunks


def camera_script(extra: dict, chunks: int, frames: int) -> list[list[str]]:
    """The session's per-chunk actions from ``extra_params.camera_action_script`` (none: no motion)."""
    script = extra.get("camera_action_script")
    if script is None:
        return [[""] * frames for _ in range(chunks)]
    if not isinstance(script, (list, tuple)) or len(script) < chunks:
        raise HarnessError(f"camera_action_script must hold one list of {frames} per-latent-frame key lists per chunk "
                           f"({chunks} chunks)")
    return [camera.validate_actions(list(c) if isinstance(c, tuple) else c, frames) for c in script[:chunks]]


@dataclass
class _Request:
    """One session's state as the adapter runs it."""

    request_id: str
    interactions: deque = field(default_factory=deque)  # (event_id, event) queued, not yet applied
    held: str | None = None  # the keys of the last camera event applied (None: the script's)
    aborted: bool = False


class HarnessEngineClient:
    """The engine-client surface of production's handler over the harness's engine (one rank)."""

    def __init__(self, cfg: HarnessConfig, *, keep_frames: bool = True) -> None:
        cfg = override(cfg, parallel={"sp": 1, "vae_ranks": 1}, runtime={"device": "cpu"})
        self.cfg = cfg
        self.frames = cfg.video.frames_per_chunk
        device = torch.device("cpu")
        self.dit = DitEngine(cfg, group=RankGroup.single(), device=device, seed=cfg.runtime.seed)
        self.vae = VaeEngine(cfg, group=RankGroup.single(), device=device, seed=cfg.runtime.seed)
        self.stage_configs = [dict(s) for s in STAGE_CONFIGS]
        self.keep_frames = keep_frames
        #: request id → the uint8 (T, H, W, 3) frames of every chunk generated, in order
        self.generated: dict[str, list[np.ndarray]] = {}
        #: request id → [(event_id, chunk that applied it)]
        self.applied: dict[str, list[tuple[str, int]]] = {}
        self._requests: dict[str, _Request] = {}
        self._engine_lock = asyncio.Lock()

    @property
    def default_sampling_params_list(self) -> list:
        # vllm-omni is the optional [vllm] extra: imported only when its handler asks
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        v = self.cfg.video
        return [OmniDiffusionSamplingParams(width=v.width, height=v.height, fps=v.fps, seed=self.cfg.runtime.seed,
                                            num_frames=session_num_frames(v.chunks_per_session, self.frames))]

    async def abort(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            req.aborted = True

    async def submit_interaction_async(self, request_id: str, interaction: dict) -> None:
        req = self._requests.get(request_id)
        if req is None:
            raise HarnessError(f"no running request {request_id!r}")
        event = interaction.get("event") or {}
        cam = (event.get("multi_modal_data") or {}).get("camera")
        if cam is not None:
            if not isinstance(cam, dict) or not isinstance(cam.get("keys"), list):
                raise HarnessError("camera interaction: expected multi_modal_data.camera.keys (a list of keys)")
            camera.normalize_action(cam["keys"])
        req.interactions.append((interaction["event_id"], event))

    async def generate(self, prompt: Any, request_id: str, sampling_params_list: list) -> AsyncIterator[Any]:
        """One output per chunk: its uint8 frames as ``multimodal_output["video"]`` and the stream
        metadata production's handler forwards (chunk index, event ids applied)."""
        # vllm-omni is the optional [vllm] extra: imported only when its handler asks
        from vllm_omni.outputs import OmniRequestOutput

        params = sampling_params_list[0]
        plan = self._plan(prompt, params)
        req = self._requests[request_id] = _Request(request_id)
        self.generated[request_id], self.applied[request_id] = [], []
        try:
            async with self._engine_lock:
                session, vs = await asyncio.to_thread(self._start, plan)
                try:
                    for k in range(plan["chunks"]):
                        if req.aborted:
                            return
                        applied, actions = self._take_interactions(req, session, plan["script"][k])
                        pixels = await asyncio.to_thread(self._chunk, session, vs, actions)
                        if self.keep_frames:
                            self.generated[request_id].append(pixels)
                        self.applied[request_id].extend((e, k) for e in applied)
                        stream = {"generation_chunk_index": k, "started_event_ids": applied,
                                  "active_event_ids": [], "completed_event_ids": applied}
                        yield OmniRequestOutput(request_id=request_id, final_output_type="video",
                                                finished=k == plan["chunks"] - 1,
                                                _multimodal_output={"video": pixels, "metadata": {"stream": stream}})
                finally:
                    self.dit.end_session(session)
                    self.vae.end_session(vs)
        finally:
            self._requests.pop(request_id, None)

    # ---- the engine, in a worker thread ------------------------------------------------------
    def _plan(self, prompt: Any, params) -> dict:
        """The request checked against the preset before anything runs."""
        v = self.cfg.video
        if (params.width, params.height) != (v.width, v.height):
            raise HarnessError(f"size {params.width}x{params.height}: this server's preset {self.cfg.name} is {v.width}x{v.height}")
        chunks = chunks_for(int(params.num_frames), self.frames)
        extra = dict(params.extra_args or {})
        shift = extra.get("flow_shift")
        if shift is not None and float(shift) != self.cfg.schedule.flow_shift:
            raise HarnessError(f"flow_shift {shift}: this server's schedule uses {self.cfg.schedule.flow_shift}")
        image = None
        if isinstance(prompt, dict):
            image = (prompt.get("multi_modal_data") or {}).get("image")
        text = prompt.get("prompt", "") if isinstance(prompt, dict) else str(prompt or "")
        seed = self.cfg.runtime.seed if params.seed is None else int(params.seed)
        return {"chunks": chunks, "script": camera_script(extra, chunks, self.frames), "image": image,
                "prompt": text, "seed": seed}

    def _start(self, plan: dict):
        latent = None
        if plan["image"] is not None:
            img = np.asarray(plan["image"].convert("RGB"), dtype=np.uint8)
            v = self.cfg.video
            if img.shape[:2] != (v.height, v.width):
                raise HarnessError(f"image is {img.shape[1]}x{img.shape[0]}; this server's preset is {v.width}x{v.height}")
            latent = self.vae.encode_image(img)
        cond = SessionConditions(prompt=plan["prompt"], seed=plan["seed"], image_latent=latent)
        return self.dit.start_session(cond), self.vae.start_session()

    def _take_interactions(self, req: _Request, session, scripted: list[str]) -> tuple[list[str], list[str]]:
        """Every interaction queued before this chunk boundary, applied in arrival order."""
        applied = []
        while req.interactions:
            event_id, event = req.interactions.popleft()
            if event.get("prompt"):
                m = self.cfg.model
                text = session_text_embedding(SessionConditions(prompt=event["prompt"], seed=session.seed), m.text_len, m.text_dim)
                session.text_kv = self.dit.model.text_kv(text.to(self.dit.device, self.dit.dtype))
            cam = (event.get("multi_modal_data") or {}).get("camera")
            if cam is not None:
                req.held = camera.normalize_action(cam["keys"])
            applied.append(event_id)
        return applied, scripted if req.held is None else [req.held] * self.frames

    def _chunk(self, session, vs, actions: list[str]) -> np.ndarray:
        latent = self.dit.generate_chunk(session, actions)
        return to_uint8(self.vae.decode_chunk(vs, latent)).numpy()


def frame_hashes(frames: list[np.ndarray]) -> list[str]:
    """SHA-256 of every frame's raw bytes, in order (chunks of (T, H, W, 3) frames)."""
    return [hashlib.sha256(np.ascontiguousarray(f).tobytes()).hexdigest() for c in frames for f in c]


def omni_app(engine: HarnessEngineClient, *, model_name: str | None = None, stall_timeout: float | None = None,
             start_timeout: float | None = None):
    """A FastAPI app that mounts vLLM-Omni's own handler at ``WS /v1/realtime/video`` over ``engine``."""
    # FastAPI comes with the optional [vllm] extra, as the handler does
    from fastapi import FastAPI, WebSocket

    OmniStreamingVideoOutputHandler = compat.import_video_handler()
    limits = {k: v for k, v in (("stall_timeout", stall_timeout), ("start_timeout", start_timeout)) if v is not None}
    handler = OmniStreamingVideoOutputHandler(engine, model_name=model_name, stage_configs=engine.stage_configs, **limits)
    app = FastAPI()

    async def realtime_video(websocket) -> None:
        await handler.handle_session(websocket)

    # FastAPI injects the socket by the parameter's type; this module's annotations are strings
    # (``from __future__``) naming a class imported in this function, which FastAPI cannot resolve
    realtime_video.__annotations__["websocket"] = WebSocket
    app.add_api_websocket_route("/v1/realtime/video", realtime_video)
    return app
