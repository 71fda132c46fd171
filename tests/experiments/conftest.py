"""One real comparison (``h5a_compare``: H5a vs Case D on the tiny preset, ``--until-resolved
--max-rounds 2``: 2 rounds, 3 sessions (1 warm-up) × 7 chunks per launch, SP 1 and one VAE rank)
shared by the compare and report tests — 4 serve launches, the costly part of this suite. The
hand-built event tables are the root conftest's ``tables``."""

from __future__ import annotations

import os

import pytest

from harness.cli import main

from helpers.presets import ONE_RANK_EACH
from helpers.procs import live_workers


@pytest.fixture(scope="session")
def h5a_compare(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "h5a"
    # --until-resolved with a budget of 2 rounds: one look, after round 2 (the sequential path, at no extra launch)
    rc = main(["compare", "--candidate", "H5a", "--until-resolved", "--max-rounds", "2", "--preset", "tiny", "--sessions", "3",
               "--chunks", "7", *ONE_RANK_EACH, "--out", str(out), "--no-progress"])
    return rc, out, live_workers(os.getpid())
