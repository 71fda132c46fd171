"""``serve --listen --launcher ray --replicas 2`` (tiny preset, SP 1 and one VAE rank, CPU, a Ray
instance the server starts and shuts down, fractional CPUs on the small box): one placement group
per replica, two sessions at once each on its own replica, and nothing of Ray left once the server
stopped."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway local instance: no token
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
pytest.importorskip("ray", reason="ray is not installed (pip install 'harness[ray]')")

from harness.experiments.scenario import ServerProcess  # noqa: E402
from harness.measure.events import read_events  # noqa: E402
from harness.serving.client import run_session  # noqa: E402

from helpers.presets import ONE_RANK_EACH  # noqa: E402


def test_two_ray_replicas_serve_two_sessions_at_once(tmp_path):
    # three actors a replica instead of five: ranks over Ray have tests/drivers/test_ray_launcher.py
    srv = ServerProcess(["--preset", "tiny", "--launcher", "ray", "--replicas", "2", "--warmup-chunks", "0",
                         *ONE_RANK_EACH], tmp_path / "run")
    try:
        async def two():
            return await asyncio.gather(*(run_session(srv.url, preset="tiny", seed=s, chunks=2) for s in (1, 2)))

        reps = asyncio.run(two())
    finally:
        rc = srv.stop()
    assert rc == 0 and all(r.outcome == "complete" for r in reps), [r.error for r in reps]
    assert {r.started.replica for r in reps} == {0, 1}
    man = json.loads((tmp_path / "run" / "manifest.json").read_text())
    groups = [r["launcher"]["placement_group"] for r in man["replicas"]]
    assert [r["launcher"]["name"] for r in man["replicas"]] == ["ray", "ray"] and len(set(groups)) == 2
    events = read_events(tmp_path / "run" / "events.jsonl")
    for r in reps:
        assert {e.replica for e in events if e.session == r.started.session} == {r.started.replica}
    assert srv.shm_left() == []
