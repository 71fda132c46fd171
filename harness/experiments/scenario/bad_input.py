"""bad-input, in process: command lines a user can get wrong, invalid actions and poses against the
engine, and a NaN latent reaching the VAE. Each gets a clear one-line error and a non-zero exit
before anything is allocated or started, and nothing half-written claims to be valid."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from harness.config import override
from harness.drivers.launcher import RankFailed
from harness.engine.conditions import SessionConditions
from harness.engine.dit_engine import DitEngine
from harness.engine.groups import RankGroup
from harness.errors import HarnessError, report
from harness.experiments.serve import main as serve_main
from harness.experiments.scenario.params import Params
from harness.experiments.scenario.findings import Findings, Report
from harness.experiments.scenario.server_process import REPO_ROOT
from harness.experiments.scenario.topology import serve_watched
from harness.pipeline import messages as M
from harness.serving.client import main as client_main
from harness.serving.cli_options import add_client_arguments, add_serve_command


@dataclass
class CliCase:
    name: str
    argv: list[str]
    expect: str  # a piece of the one-line error
    rc: int = 2


def _without(argv: list[str], *flags: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


def _bad_configs(work: Path) -> tuple[Path, Path, Path, Path]:
    """A malformed TOML, one with an unknown key, one with a value of the wrong type, and a plain
    file to put an output directory under."""
    files = {"malformed.toml": 'name = "x"\n[model\ndim = 64\n', "unknown-key.toml": 'name = "x"\n[model]\nbogus_key = 1\n',
             "wrong-type.toml": 'name = "x"\n[video]\nfps = "fast"\n', "a-file": ""}
    for name, text in files.items():
        (work / name).write_text(text)
    return tuple(work / name for name in files)


def cli_cases(work: Path, serve_args: list[str]) -> list[CliCase]:
    work.mkdir(parents=True, exist_ok=True)
    bad_toml, unknown, wrong, blocker = _bad_configs(work)
    base = _without(serve_args, "--sp", "--vae-ranks", "--device")
    out = lambda name: ["--out", str(work / name), "--no-progress"]  # noqa: E731
    cases = [
        CliCase("malformed TOML", ["serve", "--config", str(bad_toml), *out("c1")], "invalid config"),
        CliCase("unknown config key", ["serve", "--config", str(unknown), *out("c2")], "bogus_key"),
        CliCase("wrong value type", ["serve", "--config", str(wrong), *out("c3")], "Expected `int`"),
        CliCase("unknown preset", ["serve", "--preset", "no-such-preset", *out("c4")], "unknown preset"),
        CliCase("heads/tokens not divisible by SP (--sp 3)", ["serve", *base, "--sp", "3", *out("c5")], "not divisible by sp=3"),
        CliCase("latent width not divisible by VAE ranks (--vae-ranks 3)", ["serve", *base, "--vae-ranks", "3", *out("c6")],
                "not divisible by vae_ranks=3"),
        CliCase("unknown candidate", ["serve", *base, "--candidate", "H9z", *out("c7")], "unknown candidate"),
        CliCase("conflicting candidates (one switch set twice)", ["serve", *base, "--candidate", "H1b:flash", "--candidate",
                                                                  "H1b:math", *out("c8")], "given twice"),
        CliCase("bad candidate argument", ["serve", *base, "--candidate", "H1b:turbo", *out("c9")], "takes one of"),
        CliCase("candidate that needs CUDA, on CPU", ["serve", *base, "--candidate", "H1b:cudnn", "--device", "cpu", *out("c10")],
                "needs cuda"),
        CliCase("zero sessions", ["serve", *base, "--sessions", "0", *out("c11")], "must be ≥ 1"),
        CliCase("bad sink spec", ["serve", *base, "--sink", "throttled:0", *out("c12")], "throttled needs a frames/s in"),
        CliCase("unwritable output directory", ["serve", *base, "--out", str(blocker / "run"), "--no-progress"], "cannot be created"),
        CliCase("--listen on a public address without --allow-remote", ["serve", *base, "--listen", "0.0.0.0:8765", *out("c14")],
                "not a loopback address"),
        CliCase("--listen with a bad port", ["serve", *base, "--listen", "127.0.0.1:http", *out("c15")], "is not a number"),
        CliCase("client: bad --connect", ["client", "--connect", "nowhere"], "expected HOST:PORT"),
        CliCase("client: nobody listening", ["client", "--connect", "127.0.0.1:9"], "cannot reach"),
    ]
    if not torch.cuda.is_available():
        cases.append(CliCase("--device cuda without a GPU", ["serve", *base, "--device", "cuda", *out("c16")], "no CUDA device"))
    return cases


# ---- running a command line: as a subprocess, or here through the layer below the command line -----
def _run_cli(case: CliCase) -> tuple[int, str, float]:
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "harness", *case.argv], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return p.returncode, p.stderr, time.monotonic() - t


#: the commands the cases run: their options and their main
_COMMANDS = {"serve": (add_serve_command, serve_main), "client": (add_client_arguments, client_main)}


def _command_here(argv: list[str]) -> int:
    """``python -m harness ARGV`` in this process: the command's options, its main, and the command
    line's error path (a HarnessError is one ``error:`` line; exit 1 when the run failed, else 2)."""
    add_options, run = _COMMANDS[argv[0]]
    parser = argparse.ArgumentParser(prog=f"python -m harness {argv[0]}")
    add_options(parser)
    args = parser.parse_args(argv[1:])
    try:
        return int(run(args) or 0)
    except HarnessError as e:
        return report(e)


def _run_here(case: CliCase) -> tuple[int, str, float]:
    t = time.monotonic()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = _command_here(case.argv)
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 2
        except BaseException:  # noqa: BLE001 — an escaping exception is the finding
            traceback.print_exc(file=err)
            rc = -1
    return rc, err.getvalue(), time.monotonic() - t


def _claimed_valid(path: Path) -> list[str]:
    """Files under a failed run's directory that would pass for finished output."""
    out = []
    man = path / "manifest.json"
    if man.exists():
        try:
            if json.loads(man.read_text()).get("status") == "complete":
                out.append("manifest says complete")
        except ValueError:
            out.append("manifest.json unreadable")
    out += [p.name for p in path.glob("media/*.mkv")]
    return out


def _judge_cli(case: CliCase, rc: int, err: str) -> tuple[str, list[str]]:
    """The error line a case printed (or its last line) and what is wrong with how it failed."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("error:")]
    why = []
    if rc != case.rc:
        why.append(f"exit {rc}, expected {case.rc}")
    if len(errs) != 1 or not lines or lines[-1] != errs[0]:
        why.append(f"not one error line: {lines[-3:]}")
    elif case.expect not in errs[0]:
        why.append(f"{errs[0]!r} does not say {case.expect!r}")
    if "Traceback" in err:
        why.append("traceback printed")
    if "--out" in case.argv:
        d = Path(case.argv[case.argv.index("--out") + 1])
        claimed = _claimed_valid(d) if d.is_dir() else []
        if claimed:
            why.append(f"half-written output looks valid: {claimed}")
    return (errs[0] if errs else (lines[-1] if lines else "")), why


def bad_input_cli(p: Params, serve_args: list[str]) -> Findings:
    """Every ``p.subprocess_every``-th case as a subprocess (a few at a time), the others here."""
    work = Path(tempfile.mkdtemp(prefix="bad-input-", dir=p.workdir))
    cases = cli_cases(work, serve_args)
    sub = [c for i, c in enumerate(cases) if i % max(1, p.subprocess_every) == 0]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(4, (os.cpu_count() or 2)))) as pool:
        done = dict(zip((c.name for c in sub), pool.map(_run_cli, sub)))
    found = Findings()
    for case in cases:
        rc, err, secs = done[case.name] if case.name in done else _run_here(case)
        line, why = _judge_cli(case, rc, err)
        found.add([case.name, "subprocess" if case.name in done else "in process", rc, line[:90], f"{secs:.1f}",
                   "ok" if not why else "FAIL"], f"{case.name}: {'; '.join(why)}" if why else None)
    shutil.rmtree(work, ignore_errors=True)
    return found


# ---- the engine and the VAE ----------------------------------------------------------------------
def _bad_poses(f: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rigid poses for ``f`` frames, and copies sheared, with a NaN, and mirrored."""
    rigid = np.tile(np.eye(4), (f, 1, 1))
    shear, nan, mirror = rigid.copy(), rigid.copy(), rigid.copy()
    shear[0, 0, 1] = 0.5
    nan[1, 2, 3] = np.nan
    mirror[2, 0, 0] = -1
    return rigid, shear, nan, mirror


def bad_input_engine(cfg) -> Findings:
    """Invalid actions and poses against the engine itself (a one-rank tiny DiT in this process):
    each a one-line HarnessError, and the session's state untouched (the next valid chunk runs)."""
    cfg = override(cfg, parallel={"sp": 1, "vae_ranks": 1}, runtime={"device": "cpu", "dtype": "float32"})
    eng = DitEngine(cfg, group=RankGroup.single(), device=torch.device("cpu"), seed=0)
    s = eng.start_session(SessionConditions(prompt="bad input", seed=0))
    f = cfg.video.frames_per_chunk
    _, shear, nan, mirror = _bad_poses(f)
    cases = [
        ("actions: invalid key", dict(actions=["W", "X", ""]), "invalid key"),
        ("actions: wrong count", dict(actions=["W"]), f"expected {f} actions"),
        ("actions: not strings", dict(actions=[1, 2, 3]), "must be a string"),
        ("poses: wrong shape", dict(poses=np.eye(4)), "shape"),
        ("poses: not rigid (shear)", dict(poses=shear), "not orthonormal"),
        ("poses: NaN", dict(poses=nan), "non-finite"),
        ("poses: reflection", dict(poses=mirror), "reflection"),
    ]
    found = Findings()
    before = eng.kv_stats()["blocks_used"]
    for name, kw, expect in cases:
        try:
            eng.generate_chunk(s, **kw)
            msg, ok = "(accepted)", False
        except HarnessError as e:
            msg = str(e)
            ok = expect in msg and "\n" not in msg
        found.add([name, "engine", "-", msg[:90], "-", "ok" if ok else "FAIL"], None if ok else f"{name}: {msg!r}")
    state_ok = eng.kv_stats()["blocks_used"] == before and s.chunk == 0
    lat = eng.generate_chunk(s, ["W"] * f)
    found.add(["after the refusals: a valid chunk", "engine", "-", f"latent {tuple(lat.shape)}, finite={bool(torch.isfinite(lat).all())}",
               "-", "ok" if state_ok and torch.isfinite(lat).all() else "FAIL"],
              None if state_ok else "a refused chunk changed the session's KV/pose state")
    eng.end_session(s)
    return found


def _send_nan_latent(ctx) -> None:
    """Session runner: hand the VAE one latent with a NaN in it and wait for the VAE to refuse it."""
    L, v = ctx.launcher, ctx.cfg.video
    latent = np.zeros((16, v.frames_per_chunk, v.latent_h, v.latent_w), np.float32)
    latent[3, 1, 2, 5] = np.nan
    L.fanout("vae", M.StartSession(session=0, epoch=0, seed=0))
    L.fanout("vae", M.DecodeChunk(session=0, epoch=0, chunk=0, latent=M.Tensor.of(latent)))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        L.poll(1.0)  # raises RankFailed when the VAE refuses
    raise AssertionError("the VAE accepted a NaN latent")


def bad_input_nan(cfg, out: Path) -> Findings:
    """A NaN latent reaching the VAE: the VAE rank refuses it with a one-line error that names the
    session and chunk, the run fails (exit 1), everything is reaped and nothing claims validity."""
    run = serve_watched(cfg, out, _send_nan_latent, "scenario-bad-input")
    err, msg = run.error, run.message
    ok = isinstance(err, RankFailed) and "non-finite" in msg and "vae rank" in msg and "\n" not in str(err).strip()
    claimed = _claimed_valid(out)
    found = Findings()
    found.add(["NaN latent reaching the VAE", "topology", 1 if isinstance(err, RankFailed) else "?", msg[:90], "-",
               "ok" if ok and not run.left and not run.shm_left and not claimed else "FAIL"],
              None if ok else f"NaN latent: {msg or 'no error'}")
    if run.left or run.shm_left:
        found.problems.append(f"NaN latent: left processes {run.left} / shm {run.shm_left}")
    if claimed:
        found.problems.append(f"NaN latent: {claimed}")
    return found


def bad_input_inprocess(cfg, p: Params, serve_args: list[str], out_root: Path) -> Report:
    report = Report("bad-input", "inprocess")
    report.header = ["case", "run as", "exit", "error (one line)", "s", "ok"]
    cli = bad_input_cli(p, serve_args)
    report.check_none(f"{len(cli.rows)} command-line cases: one-line error, non-zero exit, nothing claimed valid", cli.problems)
    engine = bad_input_engine(cfg)
    report.check_none("invalid actions and poses refused by the engine, state untouched", engine.problems)
    nan = bad_input_nan(cfg, out_root / "nan-latent")
    report.check_none("NaN latents refused before decode", nan.problems)
    report.rows = cli.rows + engine.rows + nan.rows
    return report.done()
