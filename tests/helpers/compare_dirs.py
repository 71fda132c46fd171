"""Synthetic ``compare`` directories with a known truth: ``round{r}-{A|B}/`` run directories whose
every steady interval of a launch is that launch's given value, H5a on the tiny preset's config as
the candidate (B's config is what H5a makes of A's), and one identical saved chunk per arm so the
exact gate passes. ``compare --reanalyze`` reads them as it reads a real comparison."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import msgspec
import numpy as np

from harness.config import load_preset, to_dict
from harness.experiments.compare import expected_candidate_config
from harness.measure.events import EVENTS_FILE, SESSIONS_FILE, write_events, write_sessions
from harness.measure.gates import save_chunk_outputs, write_hashes

from helpers.events import MS, make_run

SESSIONS, CHUNKS = 2, 10  # measured sessions per launch (after one warm-up), chunks per session
WINDOW = {"first_chunk": 5, "last_chunk": 8, "warmup_epochs": 1}


def _configs() -> tuple[dict, dict]:
    a = msgspec.json.decode(msgspec.json.encode(to_dict(load_preset("tiny"))))
    return a, expected_candidate_config(a, ["H5a"])


def write_rounds(out: Path, ms_a: Sequence[float], ms_b: Sequence[float]) -> Path:
    """Round r: launch A with every interval ``ms_a[r]`` ms, launch B with ``ms_b[r]``."""
    conf_a, conf_b = _configs()
    latent, pixels = np.zeros((16, 1, 2, 2), np.float32), np.zeros((1, 2, 2, 3), np.uint8)
    for r, (a, b) in enumerate(zip(ms_a, ms_b, strict=True)):
        for arm, ms, conf, cands in (("A", a, conf_a, []), ("B", b, conf_b, ["H5a"])):
            d = out / f"round{r}-{arm}"
            d.mkdir(parents=True)
            events, starts = make_run(SESSIONS + 1, period=round(ms * MS), n_chunks=CHUNKS)
            write_events(d / EVENTS_FILE, events)
            write_sessions(d / SESSIONS_FILE, starts)
            write_hashes(d, [save_chunk_outputs(d, 1, 0, latent, pixels, session=1)])
            protocol = {"name": "timing", "sessions": SESSIONS + 1, "chunks_per_session": CHUNKS, "window": WINDOW}
            (d / "manifest.json").write_text(json.dumps({"status": "complete", "config": conf, "candidates": cands,
                                                         "mode": "eager", "preset": "tiny", "protocol": protocol}))
            (d / "summary.json").write_text(json.dumps({"status": "complete", "window": WINDOW, "hooks": []}))
    return out
