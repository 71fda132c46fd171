"""A hostile config, command line or output path (issue: the second hostile pass, rows 7-10): every
value that would fail after launch is refused before anything starts (one line, exit 2); a config
cannot steer the run directory outside ``runs/``; odd files and paths get a clear line, not a
traceback or a hang; two runs that claim one ``--out`` at the same instant cannot both win."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

import pytest

from harness import cli
from harness.config import CONFIG_DIR, apply_sets, load_config, load_preset
from harness.drivers.procwatch import children
from harness.drivers.rundir import new_run_dir
from harness.drivers.runstate import release_claim
from harness.errors import ConfigError, HarnessError, report

from helpers import REPO
from helpers.procs import run_segments

TINY = REPO / "configs" / "tiny.toml"

# (argv after "serve", what the one line must say): each passed the up-front checks and failed
# only after launch (40-65 s on the CI box, some with a rank's traceback)
LATE_FAILURES = [
    (["--set", "schedule.flow_shift=0.0"], "schedule.flow_shift = 0.0"),
    (["--set", "schedule.flow_shift=-2.0"], "schedule.flow_shift = -2.0"),
    (["--set", "schedule.flow_shift=nan"], "schedule.flow_shift = nan"),
    (["--set", "schedule.flow_shift=inf"], "schedule.flow_shift = inf"),
    (["--seed", "-1"], "runtime.seed = -1"),
    (["--seed", "100000000000000000000000000"], "runtime.seed = 100000000000000000000000000"),
    (["--set", "runtime.rank_timeout_s=inf"], "runtime.rank_timeout_s = inf"),
    (["--set", "runtime.stall_report_s=nan"], "runtime.stall_report_s = nan"),
    (["--set", "model.eps=nan"], "model.eps = nan"),
    (["--sink", "throttled:1e-300"], "throttled needs"),
    (["--encoder", "nope"], "unknown encoder 'nope'"),
    (["--set", "runtime.attention=nope"], "nope"),
    (["--set", "vae.dim_mult=[1, 2, 4]", "--set", "vae.temporal_upsample=[true, true]"], "vae.dim_mult"),
    (["--set", "vae.z_dim=8"], "vae.z_dim = 8"),
    (["--set", "model.in_channels=8"], "model.in_channels = 8"),
    (["--set", "model.out_channels=8"], "model.out_channels = 8"),
    (["--set", "model.patch_size=[2, 2, 2]"], "model.patch_size[0] = 2"),
]


def _refused_before_anything(argv: list[str], why: str, out, capsys) -> str:
    kids, shm = set(children(os.getpid())), run_segments(os.getpid())
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and why in err and "\n" not in err, err
    assert out is None or not os.path.lexists(out)  # refused before the run directory
    assert set(children(os.getpid())) <= kids  # and before any process
    assert run_segments(os.getpid()) - shm == set()  # or ring segment
    return err


@pytest.mark.parametrize("argv, why", LATE_FAILURES, ids=[" ".join(a)[:40] for a, _ in LATE_FAILURES])
def test_values_that_failed_after_launch_are_refused_before_anything_starts(argv, why, tmp_path, capsys):
    out = tmp_path / "run"
    _refused_before_anything(["serve", "--out", str(out), *argv], why, out, capsys)


@pytest.mark.parametrize("sets, why", [
    (["schedule.flow_shift=0.0"], "schedule.flow_shift"), (["runtime.seed=-1"], "runtime.seed"),
    (["runtime.rank_timeout_s=inf"], "rank_timeout_s"), (["vae.z_dim=8"], "vae.z_dim"),
    (["model.patch_size=[2, 2, 2]"], "patch_size[0]"),
    (["vae.dim_mult=[1, 2, 4, 4, 4]", "vae.temporal_upsample=[true, true, false, false]"], "four stages"),
])
def test_config_validation_refuses_what_the_engine_cannot_run(sets, why):
    with pytest.raises(ConfigError, match=why.replace("[", r"\[")):
        apply_sets(load_preset("tiny"), sets)


# ---- row 9: the config's name and --preset are names, not paths ---------------------------------
def test_a_config_name_cannot_steer_the_run_directory_out_of_runs(tmp_path):
    bad = tmp_path / "escape.toml"
    bad.write_text(TINY.read_text().replace('name = "tiny"', 'name = "x/../../../../escaped"'))
    with pytest.raises(ConfigError, match="name 'x/../../../../escaped'") as e:
        load_config(bad)
    assert "\n" not in str(e.value)


def test_a_preset_is_a_name_not_a_path(tmp_path, capsys):
    outside = tmp_path / "outside.toml"
    outside.write_text(TINY.read_text())
    for spelled in (str(tmp_path / "outside"), os.path.relpath(tmp_path / "outside", CONFIG_DIR)):
        with pytest.raises(ConfigError, match="not a preset name"):
            load_preset(spelled)
    out = tmp_path / "run"
    _refused_before_anything(["serve", "--preset", "../tiny", "--out", str(out)], "not a preset name", out, capsys)


# ---- row 10: odd config files and --out paths ---------------------------------------------------
def test_a_deeply_nested_config_is_one_line_not_a_traceback(tmp_path, capsys):
    deep = tmp_path / "deep.toml"
    deep.write_text(TINY.read_text() + "\n[extra]\nx = " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(deep)
    _refused_before_anything(["serve", "--set", "model.patch_size=" + "[" * 50_000 + "]" * 50_000,
                              "--out", str(tmp_path / "run")], "nested too deeply", tmp_path / "run", capsys)


def test_a_config_that_is_not_a_regular_file_is_refused_at_once(tmp_path, capsys):
    fifo = tmp_path / "cfg.toml"
    os.mkfifo(fifo)  # nobody writes it: opening it for reading would wait forever
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(fifo)
    _refused_before_anything(["serve", "--config", str(fifo), "--out", str(tmp_path / "run")], "not a regular file",
                             tmp_path / "run", capsys)
    with pytest.raises(ConfigError, match="Is a directory"):
        load_config(tmp_path)


def test_an_empty_out_is_refused_not_read_as_the_default(tmp_path, capsys):
    err = _refused_before_anything(["serve", "--out", ""], "--out", None, capsys)
    assert "empty" in err
    with pytest.raises(HarnessError, match="empty"):
        new_run_dir("", "tiny")


def test_a_dangling_symlink_out_names_the_missing_target(tmp_path, capsys):
    link = tmp_path / "run"
    link.symlink_to(tmp_path / "gone")
    err = _refused_before_anything(["serve", "--out", str(link)], "symbolic link", None, capsys)
    assert str(tmp_path / "gone") in err and "File exists" not in err
    assert link.is_symlink() and not (tmp_path / "gone").exists()


# ---- row 7: one --out, claimed by several processes at the same instant --------------------------
def _claim(out: str, barrier, results) -> None:
    """One contender: wait for all, claim ``out``, report; the winner holds its claim until every
    contender has tried (as a live run would). Every mkdir here takes 50 ms more, as on a slow
    network filesystem: a check-then-create claim is then lost by all of them at once, not by
    2 in 20 trials; an atomic one is not affected."""
    sys.stderr = open(os.devnull, "w")  # report() prints the line; the test reads it from results
    mkdir = Path.mkdir

    def slow_mkdir(self, *a, **k):
        time.sleep(0.05)
        return mkdir(self, *a, **k)

    Path.mkdir = slow_mkdir  # this forked contender's only
    barrier.wait()
    try:
        new_run_dir(out, "tiny")
        results.put((os.getpid(), 0, ""))
    except HarnessError as e:
        results.put((os.getpid(), report(e), str(e)))
    barrier.wait()


def test_concurrent_claims_of_one_out_have_exactly_one_winner(tmp_path):
    ctx = multiprocessing.get_context("fork")  # the contenders start in milliseconds, imports done
    n, trials = 6, 3
    for t in range(trials):
        out = str(tmp_path / f"run{t}")
        barrier, results = ctx.Barrier(n), ctx.Queue()
        procs = [ctx.Process(target=_claim, args=(out, barrier, results)) for _ in range(n)]
        for p in procs:
            p.start()
        got = [results.get(timeout=60) for _ in range(n)]
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
        winners = [g for g in got if g[1] == 0]
        assert len(winners) == 1, f"trial {t}: {len(winners)} processes claimed {out}"
        for _pid, rc, msg in got:
            assert rc == 0 or (rc == 2 and msg and "\n" not in msg and out in msg), msg


def test_a_released_claim_can_be_overwritten_but_a_held_one_cannot(tmp_path):
    out = tmp_path / "run"
    first = new_run_dir(str(out), "tiny")
    with pytest.raises(HarnessError, match="claimed by another run"):
        new_run_dir(str(out), "tiny", overwrite=True)  # held by this very run: never cleared under it
    release_claim(first)
    with pytest.raises(HarnessError, match="already holds files"):
        new_run_dir(str(out), "tiny")  # not running, but a directory with files is never reused silently
