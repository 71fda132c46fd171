"""The soak, short (issue 28): 14 sessions through one real ``serve --listen`` (tiny preset), every
way of leaving twice — none, before the start, right after it, mid-chunk, between chunks, after
the last chunk's header, a cancel. Every session is recorded with its true outcome, every process
is sampled by name after every session, and the stopped server leaves nothing behind. The long
run (≥ 200 sessions, resident memory drift) is ``scripts/soak.py``; this one does not judge
memory (14 samples on a shared box are noise)."""

from __future__ import annotations

import pytest

from harness.experiments import soak
from harness.experiments.scenario import ServerProcess

SESSIONS = 2 * len(soak.KINDS)


@pytest.fixture(scope="module")
def soaked(tmp_path_factory):
    srv = ServerProcess(["--preset", "tiny", "--warmup-chunks", "0"], tmp_path_factory.mktemp("soak") / "run")
    try:
        yield soak.run(srv, sessions=SESSIONS, chunks=2)
    finally:
        if srv.proc.poll() is None:
            srv.stop()


def test_every_session_is_recorded_with_its_true_outcome(soaked):
    problems = [p for p in soaked.problems if not p.startswith("resident memory")]
    assert not problems, problems
    assert [s.kind for s in soaked.sessions] == soak.plan(SESSIONS)
    assert sum(s.outcome == "disconnected" for s in soaked.sessions) == 2 * 4


def test_every_process_is_sampled_by_name_after_every_session(soaked):
    names = ["server", "dit0", "dit1", "vae0", "vae1", "encoder"]  # the tiny preset: sp 2, 2 VAE ranks
    assert all(list(s.rss_by_process) == names for s in soaked.sessions)
    assert all(s.rss == sum(s.rss_by_process.values()) for s in soaked.sessions)
    assert list(soaked.processes) == names


def test_the_plan_and_the_drift_figure():
    assert soak.plan(9) == [*soak.KINDS, *soak.KINDS[:2]]
    assert [soak.expected_cancelled(k) for k in soak.KINDS] == [False, None, True, True, True, True, True]
    d = soak.rss_drift([100, 100, 300, 300, 101, 101])
    assert (d.first, d.last, d.low, d.high) == (100, 101, 100, 300) and d.drift == pytest.approx(0.01)
    # medians of the thirds: one sample caught mid-teardown in either third moves nothing
    d = soak.rss_drift([100, 160, 100, 300, 300, 300, 101, 101, 170])
    assert (d.first, d.last) == (100, 101)
