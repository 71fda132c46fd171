"""The command line itself: parsing is cheap, the commands' modules load when they run."""

import os
import subprocess
import sys

import pytest

from harness import cli
from harness.drivers.procwatch import children


@pytest.mark.parametrize("code", [
    # parsing (and refusing a bad option) must not wait for torch: commands are imported when they run
    "from harness.cli import build_parser; build_parser()",
    # the viewer runs on machines without the model: it needs the protocol, not the server's stack
    "import harness.serving.client",
])
def test_no_torch_where_none_is_needed(code):
    probe = f"import sys; {code}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


# (argv, what the one line must say): refused before a run directory, a server or a connection exists
BAD_LOAD = [
    (["load", "--arrivals", "poisson:0", "--sessions", "2"], "must be positive"),
    (["load", "--arrivals", "burst:3", "--sessions", "2"], "burst:N@PERIOD"),
    (["load", "--arrivals", "poisson:3"], "bound it with --duration"),
    (["load", "--arrivals", "trace:/nonexistent/t.csv"], "cannot read the trace"),
    (["load", "--arrivals", "poisson:3", "--sessions", "2", "--slo", "ttfc=1"], "give both"),
    (["load", "--arrivals", "poisson:3", "--sessions", "2", "--early-stop", "1.5"], "--early-stop"),
    (["load", "--arrivals", "poisson:3", "--sessions", "2", "--slice", "sessions:0"], "--slice"),
    (["load", "--arrivals", "poisson:3", "--sessions", "0"], "--sessions must be ≥ 1"),
    (["load", "--arrivals", "poisson:3", "--sessions", "2", "--max-concurrency", "0"], "--max-concurrency"),
    (["load", "--arrivals", "poisson:3", "--sessions", "2", "--connect", "127.0.0.1:9", "--set", "video.fps=8"],
     "already configured"),
    (["load", "--arrivals", "poisson:3", "--sessions", "2", "--serve-args=--no-such-flag"], "serve options"),
    (["load", "--arrivals", "poisson:3", "--sessions", "2", "--connect", "nowhere"], "HOST:PORT"),
    (["sweep", "--sessions", "2"], "--rates"),
    (["sweep", "--rates", "1,-2", "--sessions", "2"], "positive"),
    (["sweep", "--rates", "1", "--sessions", "2", "--size", "big"], "WIDTHxHEIGHT"),
    (["sweep", "--rates", "1", "--sessions", "2", "--connect", "127.0.0.1:9", "--size", "64x32"], "not with --connect"),
    (["sweep", "--rates", "1"], "bound it with --duration"),
]


@pytest.mark.parametrize("argv, why", BAD_LOAD, ids=[" ".join(a)[:50] for a, _ in BAD_LOAD])
def test_bad_load_and_sweep_options_are_one_line_exit_2_before_anything_starts(argv, why, tmp_path, capsys):
    out = tmp_path / "run"
    kids = set(children(os.getpid()))
    assert cli.main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and why in err and "\n" not in err, err
    assert not out.exists() and set(children(os.getpid())) <= kids
