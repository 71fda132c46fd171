"""What ``python -m harness serve`` prints (``experiments.serve.main``): the absolute run
directory before any process starts, the setting and headline, and a ``next:`` line whose command
works; no progress-bar noise when stderr is not a terminal."""

from __future__ import annotations

import json
import os
import shlex

from helpers.presets import tiny

from harness.cli import main
from harness.drivers.serve_run import cpu_sharing_note
from harness.drivers.procwatch import workers_of
from harness.experiments import serve


def test_serve_prints_its_run_directory_first_and_a_next_line_that_works(tmp_path, capsys, monkeypatch):
    seen: dict = {}
    announce = serve.announce

    def watching(run_dir):  # the moment serve announces, nothing of the run has started yet
        seen.update(workers=workers_of(os.getpid(), recursive=True), events=(run_dir / "events.jsonl").exists(),
                    status=json.loads((run_dir / "manifest.json").read_text())["status"])
        announce(run_dir)

    monkeypatch.setattr(serve, "announce", watching)
    monkeypatch.chdir(tmp_path)
    assert main(["serve", "--sessions", "2", "--chunks", "2", "--out", "run"]) == 0  # a relative --out
    out, err = capsys.readouterr()
    lines = out.splitlines()
    run = (tmp_path / "run").resolve()
    assert lines[0] == f"run directory: {run}" and seen == {"workers": [], "events": False, "status": "running"}
    assert lines[1].startswith("setting: preset tiny · device cpu · mode eager · case-d") and "hooks none" in lines[1]
    assert "\r" not in err  # stderr is not a terminal here: no progress bar
    nxt = lines[-1]
    assert nxt.startswith("next: python -m harness report ")
    argv = shlex.split(nxt.removeprefix("next: ").split("   (")[0])
    assert argv[:3] == ["python", "-m", "harness"] and argv[4] == str(run)
    assert main(argv[3:]) == 0  # the command it points to works on the finished run
    assert (run / "report.md").is_file() and f"wrote {run / 'report.md'}" in capsys.readouterr().out


def test_case_e_on_cpu_gets_the_shared_cores_note():
    note = cpu_sharing_note(tiny(scheduler="case-e", device="cpu"))
    assert note.startswith("note: Case E on CPU") and f"{os.cpu_count()} cores" in note
    assert cpu_sharing_note(tiny(scheduler="case-d", device="cpu")) is None
