"""A scenario report: every broken invariant fails the scenario; rate comparisons are set apart
so tests on a loaded box can judge only what does not depend on the machine's speed."""

from harness.experiments.scenarios import Report


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
