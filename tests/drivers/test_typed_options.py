"""Settings travel typed: ``--hooks`` is parsed once, where the command line is read, into a
``HookSet`` that reaches every rank whole (no strings parsed again on the way), and the serve
options are one frozen record, copied with ``dataclasses.replace``."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from harness.drivers import launcher, ray_launcher
from harness.drivers.serve_run import ServeOptions, serve
from harness.hooks import HookSet, parse_hooks
from harness.workers.common import WorkerSpec

from helpers.presets import tiny


def test_serve_options_are_frozen_and_copied_whole():
    opts = ServeOptions(out="x", hooks=parse_hooks("trace,nvtx"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.out = "y"  # type: ignore[misc]
    copy = dataclasses.replace(opts, protocol={"name": "other"})
    assert copy.hooks is opts.hooks and copy.out == "x" and opts.protocol == {"name": "timing"}


def test_hooks_given_as_strings_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(TypeError, match="HookSet"):
        serve(tiny(sessions=1), ServeOptions(out=str(tmp_path / "run"), progress=False, hooks=("trace",)))
    assert not (tmp_path / "run").exists()


def test_every_stop_on_the_way_to_a_rank_holds_a_hookset():
    assert ServeOptions().hooks == HookSet()
    for record in (launcher.LocalLauncher, ray_launcher.RayLauncher):
        assert {f.name: f.type for f in dataclasses.fields(record)}["hooks"] in (HookSet, "HookSet")
    spec_fields = {f.name: f.type for f in msgspec.structs.fields(WorkerSpec)}
    assert spec_fields["hooks"] is HookSet
    hooks = parse_hooks("dispatch=summary,trace")
    spec = WorkerSpec(role="dit", rank=0, cfg=tiny(), device="cpu", hooks=hooks)
    assert msgspec.structs.replace(spec, rank=1).hooks is hooks


def test_candidates_are_resolved_once_and_reach_the_ranks_as_records():
    from harness.candidates import Chosen, EnginePatches, chosen, get, resolve
    from harness.drivers.serve_run import make_launcher

    cfg = tiny()
    picked = chosen(resolve(["H2a", "H1b:math", "H3b"], cfg))  # apply order; H3b's default argument filled in
    assert picked == (Chosen("H1b", "math"), Chosen("H2a"), Chosen("H3b", "bf16"))
    assert [str(c) for c in picked] == ["H1b:math", "H2a", "H3b:bf16"]
    spec_fields = {f.name: f.type for f in msgspec.structs.fields(WorkerSpec)}
    assert spec_fields["candidates"] == tuple[Chosen, ...]
    lnch = make_launcher(ServeOptions(candidates=("H2a", "H1b:math", "H3b")), cfg, "", {}, picked)
    assert lnch.candidates is picked  # what the ranks get: the resolved records, not the user's strings
    # a rank's container takes the records as they are: no parsing, no default filled in again
    assert EnginePatches([Chosen("H3b", "fp16")]).chosen == [(get("H3b"), "fp16")]
    assert msgspec.json.decode(msgspec.json.encode(picked), type=tuple[Chosen, ...]) == picked
