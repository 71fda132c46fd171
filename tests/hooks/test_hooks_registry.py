"""--hooks parsing, errors, activation in a process, and the profiler window."""

import json

import pytest
import torch

from harness.errors import HarnessError
from harness.hooks import HookSet, parse_hooks
from harness.hooks.active import activate
from harness.hooks import context as hctx


def test_parse_full_string():
    h = parse_hooks("nvtx,dispatch,trace,profile=5:7")
    assert h == HookSet(nvtx=True, dispatch="full", trace=True, profile=(5, 7))
    assert h.items() == ("nvtx", "dispatch", "trace", "profile=5:7")
    assert str(h) == "nvtx,dispatch,trace,profile=5:7"
    assert parse_hooks(h.items()) == h  # worker specs carry the items
    assert parse_hooks(("nvtx", "trace")) == HookSet(nvtx=True, trace=True)
    assert h.to_dict() == {"nvtx": True, "dispatch": "full", "trace": True, "profile": [5, 7]}


def test_the_hooks_option_parses_to_the_items_a_serve_takes():
    """``--hooks`` as argparse hands it over (default "", spaces allowed) → the ``HookSet`` that
    ``ServeOptions.hooks`` holds; its items are what the manifest records."""
    assert parse_hooks("").items() == ()
    assert parse_hooks(" nvtx , dispatch=full,trace ").items() == ("nvtx", "dispatch", "trace")


@pytest.mark.parametrize("spec,expected", [
    ("", HookSet()),
    (None, HookSet()),
    (" nvtx , ,TRACE ", HookSet(nvtx=True, trace=True)),
    ("dispatch=summary", HookSet(dispatch="summary")),
    ("dispatch=full", HookSet(dispatch="full")),
    ("profile", HookSet(profile=(5, 5))),
    ("profile=6", HookSet(profile=(6, 6))),
    ("profile=5:8@2", HookSet(profile=(5, 8), profile_epoch=2)),
])
def test_parse_forms(spec, expected):
    h = parse_hooks(spec)
    assert h == expected
    assert parse_hooks(str(h)) == h
    assert h.any == bool(h.items())


@pytest.mark.parametrize("spec,msg", [
    ("nvtx,flops", "unknown hook 'flops'"),
    ("nvtx,nvtx", "more than once"),
    ("nvtx=1", "takes no value"),
    ("dispatch=everything", "dispatch mode"),
    ("profile=7:5", "ends before it starts"),
    ("profile=a:b", "bad number"),
    ("profile=-1", "negative"),
    ("profile=5:7@x", "bad number"),
])
def test_parse_errors_are_one_line_harness_errors(spec, msg):
    with pytest.raises(HarnessError) as e:
        parse_hooks(spec)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_activate_dispatch_summary_mode(tmp_path):
    with activate("dispatch=summary", out_dir=tmp_path, label="dit0") as active:
        assert hctx.ACTIVE
        with hctx.phase(chunk=0):
            torch.mm(torch.randn(4, 8), torch.randn(8, 2))
    assert not hctx.ACTIVE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dispatch_summary.dit0.json"]
    summary = json.loads((tmp_path / "dispatch_summary.dit0.json").read_text())
    assert summary["total_flops"] == 2 * 4 * 8 * 2 and summary["process"] == "dit0"
    rep = active.report()
    assert rep["requested"] == ["dispatch=summary"]
    assert rep["dispatch"]["total_flops"] == 2 * 4 * 8 * 2 and rep["dispatch"]["records"] is None
    # the files it wrote, with their sizes, and what recording cost in the run
    assert rep["files"] == {"dispatch_summary.dit0.json": (tmp_path / "dispatch_summary.dit0.json").stat().st_size}
    assert rep["dispatch"]["record_ms"] > 0 and rep["overhead_ms"]["dispatch_in_run"] == rep["dispatch"]["record_ms"]
    assert rep["overhead_ms"]["start"] > 0 and rep["overhead_ms"]["close"] > 0


def test_activate_dispatch_full_writes_records(tmp_path):
    with activate("dispatch", out_dir=tmp_path):
        torch.mm(torch.randn(4, 8), torch.randn(8, 2))
    assert (tmp_path / "dispatch.jsonl").read_text().count("\n") >= 3
    assert (tmp_path / "dispatch_summary.json").exists()


def test_trace_only_runs_nothing_in_the_process(tmp_path):
    with activate("trace", out_dir=tmp_path) as active:
        assert not hctx.ACTIVE
        assert hctx.phase(chunk=1) is hctx.phase(chunk=2)
    assert list(tmp_path.iterdir()) == []
    rep = active.report()  # nothing ran here, and the report says where the trace comes from
    assert rep["requested"] == ["trace"] and "files" not in rep and "hooks.driver.json" in rep["elsewhere"]["trace"]


def _session(epoch, chunks=4):
    with hctx.phase(session=epoch, epoch=epoch):
        for c in range(chunks):
            with hctx.phase(chunk=c, stage="dit"):
                with hctx.phase(step=0):
                    torch.mm(torch.randn(8, 8), torch.randn(8, 8))


def test_profile_window_covers_the_chosen_chunks_of_the_first_measured_session(tmp_path):
    with activate("profile=1:2", out_dir=tmp_path, label="dit0") as active:
        _session(0)  # warm-up epoch: not profiled
        assert active.profile.state == "waiting"
        _session(1)
        assert active.profile.state == "done"
        _session(2)
    status = active.report()["profile"]
    assert status["complete"] and status["window"] == [1, 2]
    trace = json.loads((tmp_path / "profile.dit0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"chunk 1 dit", "chunk 2 dit", "step 0"} <= names
    assert "chunk 0 dit" not in names and "chunk 3 dit" not in names
    assert any(n and "mm" in n for n in names)


def test_profile_window_cut_short_still_exports(tmp_path):
    with activate("profile=2:9", out_dir=tmp_path) as active:
        _session(1, chunks=4)
    st = active.report()["profile"]
    assert st["state"] == "done" and not st["complete"]
    assert (tmp_path / "profile.json").exists()


@pytest.mark.parametrize("command", [["serve"], ["compare", "--candidate", "H2a"]])
def test_a_bad_hooks_option_is_one_line_and_exit_2_before_anything_starts(tmp_path, capsys, command):
    from harness.cli import main

    out = tmp_path / "run"
    assert main([*command, "--hooks", "nvtx,flops", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: unknown hook 'flops' in --hooks (known: nvtx, dispatch, trace, profile, capture)"
    assert not out.exists()
