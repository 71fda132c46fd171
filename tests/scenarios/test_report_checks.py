"""A scenario report: every broken invariant fails the scenario; rate comparisons are set apart
so tests on a loaded box can judge only what does not depend on the machine's speed."""

from harness.experiments.scenario import Report
from harness.experiments.scenario.slow_consumer import consumer_fps


def test_rate_checks_fail_the_scenario_but_not_correctness():
    r = Report("slow-consumer", "inprocess")
    r.check("every frame delivered exactly once", True)
    r.check("full rate restored", False, "P50 1660 ms", rate=True)
    assert not r.ok and r.failures == ["full rate restored: P50 1660 ms"]
    assert r.correctness_failures == [] and r.rate_checks == {"full rate restored"}
    assert "[FAIL] full rate restored (rate) — P50 1660 ms" in r.text()
    r.check("ring bounded", False, "3 of 2 slots")
    assert r.correctness_failures == ["ring bounded: 3 of 2 slots"]
    assert not Report("x", "y").ok  # no checks at all is not a pass


def test_the_slow_consumer_is_throttled_against_what_this_machine_produced():
    # DESIGN §7: a fraction of the production rate, so a slow machine still has a slower consumer
    assert consumer_fps(0.5, reference_fps=6.0, nominal_fps=16) == 3.0
    assert consumer_fps(0.25, reference_fps=40.0, nominal_fps=16) == 10.0
    assert consumer_fps(0.5, reference_fps=None, nominal_fps=16) == 8.0  # reference too short to measure
