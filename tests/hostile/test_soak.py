"""The soak, short (issue 28): 21 sessions through one real ``serve --listen`` (tiny preset), every
way of leaving three times — none, before the start, right after it, mid-chunk, between chunks,
after the last chunk's header, a cancel. Every session is recorded with its true outcome and the
stopped server leaves nothing behind. The long run (≥ 200 sessions, resident memory drift) is
``scripts/soak.py``; this one does not judge memory (21 samples on a shared box are noise)."""

from __future__ import annotations

import pytest

from harness.experiments import soak
from harness.experiments.scenario import ServerProcess


@pytest.fixture(scope="module")
def soaked(tmp_path_factory):
    srv = ServerProcess(["--preset", "tiny", "--warmup-chunks", "0"], tmp_path_factory.mktemp("soak") / "run")
    try:
        yield soak.run(srv, sessions=3 * len(soak.KINDS), chunks=2)
    finally:
        if srv.proc.poll() is None:
            srv.stop()


def test_every_session_is_recorded_with_its_true_outcome(soaked):
    problems = [p for p in soaked.problems if not p.startswith("resident memory")]
    assert not problems, problems
    assert [s.kind for s in soaked.sessions] == soak.plan(3 * len(soak.KINDS))
    assert sum(s.outcome == "disconnected" for s in soaked.sessions) == 3 * 4


def test_the_plan_and_the_drift_figure():
    assert soak.plan(9) == [*soak.KINDS, *soak.KINDS[:2]]
    assert [soak.expected_cancelled(k) for k in soak.KINDS] == [False, None, True, True, True, True, True]
    first, last, drift = soak.rss_drift([100, 100, 300, 300, 101, 101])
    assert (first, last) == (100, 101) and drift == pytest.approx(0.01)
