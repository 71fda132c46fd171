"""The one table of figure definitions: labels are unique, every definition names a real function,
every figure field of ``summary.json`` is in it, and the README reproduces it."""

from __future__ import annotations

import importlib

import msgspec
import pytest

from harness.measure import figures as F
from harness.measure import summary as SM
from harness.measure import tails as T

from helpers import REPO

README = REPO / "README.md"


def test_every_label_resolves_to_its_own_figure_and_nothing_else():
    for f in F.FIGURES.values():
        for label in F.labels_of(f):
            assert F.resolve(label) is f
    with pytest.raises(KeyError):
        F.resolve("steady FPS")  # the old, undefined headline label
    assert F.label("handoff_p50", "case-e") != F.label("handoff_p50") == F.label("handoff_p50", "case-d")


def test_every_definition_names_what_computes_it():
    for f in F.FIGURES.values():
        module, _, attr = f.where.partition(".")
        obj = importlib.import_module(f"harness.measure.{module}")
        for part in attr.split("."):
            obj = getattr(obj, part)  # AttributeError names a stale definition


def test_every_figure_field_of_the_summary_is_defined():
    structs = (SM.Dist, SM.BoundarySummary, SM.StageSummary, SM.GpuSummary, SM.BlockedSummary, SM.RolloutSummary,
               SM.Headline, T.TailSummary, T.BoundaryTail, T.TailPercentile, T.SlowSample, T.Excess)
    # records and what they are about (long_tail: its reference boundary and the text of its definition)
    nested = {"intervals", "durations", "time", "boundary", "start", "end", "boundaries", "stages", "percentiles",
              "slowest", "reference", "definition"}
    fields = {f.name for s in structs for f in msgspec.structs.fields(s)} - nested
    assert fields <= F.summary_keys(), fields - F.summary_keys()


def test_the_readme_reproduces_the_table():
    assert "\n".join(F.table_md()) in README.read_text()


def test_a_label_two_figures_share_is_ambiguous_not_the_first(monkeypatch):
    first = F._TABLE[1]
    twin = msgspec.structs.replace(first, name=first.name + "_twin", by_scheduler={})
    monkeypatch.setattr(F, "_TABLE", (*F._TABLE, twin))
    with pytest.raises(KeyError, match="ambiguous"):
        F.resolve(first.label)


def test_a_header_aligns_numbers_right_and_words_left():
    names = [n for n in F.FIGURES][:12]
    head, rule = F.header(names)
    assert head == "| " + " | ".join(F.label(n) for n in names) + " |"
    cells = rule.strip("|").split("|")
    assert len(cells) == len(names)
    assert cells == ["---" if F.define(n).unit == "—" else "---:" for n in names]
    assert {"---", "---:"} <= set(cells)  # both kinds occur in the columns tested


def test_a_console_table_aligns_its_header_over_its_columns():
    names = list(F.FIGURES)[:3]
    lines = F.console_table(names, [["a", "1.5", "22.25"], ["bbbbbbbbbbbbbbbbbbbbbb", "333.0", "4"]], indent="")
    heads = [F.label(n) for n in names]
    assert lines[1].startswith("a ") and lines[2].startswith("bbbbbbbbbbbbbbbbbbbbbb")  # the first column: left
    for line in lines:
        assert len(line) == len(lines[0])  # every column as wide as its widest cell or label
    # the other columns: right-aligned, their right edges under the labels' right edges
    right = [lines[0].index(h) + len(h) for h in heads[1:]]
    for line, (mid, last) in zip(lines[1:], (("1.5", "22.25"), ("333.0", "4"))):
        assert line[right[0] - len(mid):right[0]] == mid and line.endswith(last) and right[1] == len(line)
