"""The in-process tiny capture shared by the capture and replay tests (see conftest.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from harness.config import load_preset, override
from harness.hooks import context as hctx

CHUNKS = 3  # K grows 96 → 192 → 288: three self-attention signatures per phase


def capture_run(out: Path, hooks: str, *, sessions: int = 2, chunks: int = CHUNKS) -> dict:
    from harness.engine.convert import to_uint8
    from harness.engine.dit_engine import DitEngine, SessionConditions
    from harness.engine.groups import RankGroup
    from harness.engine.vae_engine import VaeEngine
    from harness.hooks.active import activate

    cfg = override(load_preset("tiny"), parallel={"sp": 1, "vae_ranks": 1})
    cpu = torch.device("cpu")
    dit = DitEngine(cfg, group=RankGroup.single(), device=cpu, seed=0)
    vae = VaeEngine(cfg, group=RankGroup.single(), device=cpu, seed=0)
    kv_tokens = []
    with activate(hooks, out_dir=out, label="t0") as active:
        for sess in range(sessions):
            with hctx.phase(session=sess, epoch=sess):
                s = dit.start_session(SessionConditions(prompt="capture", seed=sess))
                vs = vae.start_session()
                for c in range(chunks):
                    with hctx.phase(chunk=c, stage="dit"):
                        lat = dit.generate_chunk(s, ["W"] * cfg.video.frames_per_chunk)
                    with hctx.phase(chunk=c, stage="decode"):
                        frames = vae.decode_chunk(vs, lat)
                    with hctx.phase(chunk=c, stage="convert"):
                        to_uint8(frames)
                kv_tokens.append(list(s.kv_tokens))
                dit.end_session(s)
                vae.end_session(vs)
    return {"dir": out, "report": active.report(), "kv_tokens": kv_tokens, "cfg": cfg}
