"""The stall bound and the compile allowance (``drivers.driver.StallWatch``, ``stall_watch``): a
compiled warm-up's first chunks may compile without being called stalled; a stall past the
allowance, on a later chunk, in a measured epoch or in eager mode is still named. The clock is the
test's, so every wait below is exact rather than slept."""

from __future__ import annotations

import pytest
from helpers.presets import tiny

from harness.config import override
from harness.drivers.driver import stall_watch
from harness.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def watch(mode: str, epoch: int, sink: list, clock: Clock, commit: str = "inline"):
    cfg = tiny(mode=mode, stall_report_s=10.0, compile_allowance_s=60.0, compile_allowance_chunks=2, commit=commit)
    w = stall_watch(cfg, session=epoch, epoch=epoch, sink=sink)
    w.clock, w.since = clock, clock()  # the test's clock, from now
    return w


def wait(w, clock: Clock, stage: str, chunk: int, seconds: float) -> None:
    """``seconds`` of silence from ``stage`` owing ``chunk``, looked at every second, then a reply."""
    for _ in range(int(seconds)):
        clock.t += 1.0
        w.idle(stage, chunk)
    w.progress()


def test_a_compile_within_the_allowance_is_not_a_stall(capsys):
    sink, clock = [], Clock()
    w = watch("compiled", 0, sink, clock)
    wait(w, clock, "dit", 0, 45)  # chunk 0 of the warm-up compiles for 45 s: past the 10 s bound
    wait(w, clock, "vae", 1, 30)  # chunk 1 (another shape) decodes-and-compiles for 30 s
    assert sink == []
    err = capsys.readouterr().err
    assert "within the 60 s compile allowance" in err and "stall:" not in err


def test_a_real_stall_in_the_warm_up_is_still_named(capsys):
    sink, clock = [], Clock()
    w = watch("compiled", 0, sink, clock)
    wait(w, clock, "dit", 0, 75)  # past bound + allowance (70 s): stuck, not compiling
    wait(w, clock, "vae", 2, 12)  # chunk 2 gets no allowance: the plain 10 s bound
    wait(w, clock, "encoder", 0, 12)  # the encoder does not compile
    assert [(s["stage"], s["chunk"], s["bound_s"], s["compile_allowance_s"], s["lasted_s"]) for s in sink] == [
        ("dit", 0, 70.0, 60.0, 75.0), ("vae", 2, 10.0, 0.0, 12.0), ("encoder", 0, 10.0, 0.0, 12.0)]
    assert all(s["previous_check_s"] < s["bound_s"] <= s["reported_after_s"] for s in sink)
    assert capsys.readouterr().err.count("stall:") == 3


def test_a_deferred_commit_extends_the_allowance_by_one_chunk():
    """H5b runs chunk 1's commit pass (its first in the second shape) in chunk 2's call."""
    sink, clock = [], Clock()
    w = watch("compiled", 0, sink, clock, commit="deferred")
    wait(w, clock, "dit", 2, 45)
    wait(w, clock, "dit", 3, 12)
    assert [(s["chunk"], s["bound_s"]) for s in sink] == [(3, 10.0)]


@pytest.mark.parametrize("mode,epoch", [("compiled", 1), ("eager", 0)])
def test_no_allowance_in_a_measured_epoch_or_in_eager_mode(mode, epoch):
    sink, clock = [], Clock()
    w = watch(mode, epoch, sink, clock)
    wait(w, clock, "dit", 0, 12)
    assert [(s["chunk"], s["bound_s"]) for s in sink] == [(0, 10.0)]


def test_a_negative_allowance_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="compile_allowance_s"):
        override(tiny(), runtime={"compile_allowance_s": -1.0})
