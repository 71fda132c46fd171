"""The websocket way in: ``python -m harness serve --listen 127.0.0.1:0`` as a subprocess, for the
scenarios and tests. Light on purpose (no torch): tests of other packages start servers with it."""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness.config import REPO_ROOT, load_config
from harness.drivers.procwatch import shm_names, start_time, wait_gone, workers_of
from harness.errors import RunFailed
from harness.experiments.scenario.findings import Report


def _stop_with_parent() -> None:
    """In the server child before exec: SIGTERM it (a graceful stop) if this process dies first,
    so a scenario stopped by a signal leaves no server behind."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerDidNotStart(RunFailed, RuntimeError):
    """The server exited, or never printed its ``listening on`` line in time (a failed run: one
    ``error:`` line and exit 1 where nothing catches it)."""


def error_line(stderr: str) -> str:
    """What a failed server said: its last ``error:`` line (the CLI's one-line refusal or a rank's
    failure), else the tail of its stderr."""
    errors = [line.strip() for line in stderr.splitlines() if line.startswith("error:")]
    return errors[-1] if errors else stderr.strip()[-500:]


class ServerProcess:
    """``python -m harness serve --listen 127.0.0.1:0`` as a subprocess, for the scenarios and tests."""

    #: pid of every server this process started: whose ring segments a leak check may call ours
    started: list[int] = []

    def __init__(self, serve_args: list[str], out: Path, extra: list[str] | None = None, start_timeout_s: float = 300.0):
        self.out = Path(out)
        self.argv = [sys.executable, "-m", "harness", "serve", "--listen", "127.0.0.1:0", "--out", str(self.out),
                     *serve_args, *(extra or [])]
        self.stderr_path = self.out.parent / (self.out.name + ".server.err")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._err = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(self.argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=self._err,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_stop_with_parent)
        ServerProcess.started.append(self.proc.pid)
        self.stdout_lines: list[str] = []
        self.url = self._await_listening(start_timeout_s)
        if self.url is None:
            self.proc.kill()
            self.proc.wait()
            raise ServerDidNotStart(f"server did not start: {error_line(self.stderr())}")
        self._drain = threading.Thread(target=self._read_rest, daemon=True)
        self._drain.start()

    def _await_listening(self, timeout_s: float) -> str | None:
        """The URL of the server's ``listening on`` line (None: it exited or took too long)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().decode()
            if not line:
                return None
            self.stdout_lines.append(line.rstrip())
            if line.startswith("listening on "):
                return line.split()[-1]
        return None

    def _read_rest(self) -> None:
        for line in iter(self.proc.stdout.readline, b""):
            self.stdout_lines.append(line.decode().rstrip())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.stderr_path.read_text(errors="replace")

    def workers(self) -> list[int]:
        return workers_of(self.pid, recursive=True)

    def operator_token(self) -> str:
        """The token that lets this process (the server's operator) read any session's outcome."""
        try:
            return (self.out / "operator.token").read_text().strip()
        except OSError:
            return ""

    def encoder_pid(self) -> int:
        """The launcher starts the encoder stage last."""
        return max(self.workers(), key=lambda p: (start_time(p), p))

    def shm_left(self) -> list[str]:
        return sorted(shm_names(f"harness-{self.pid}-"))

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def wait(self, timeout_s: float) -> int:
        rc = self.proc.wait(timeout=timeout_s)
        self._drain.join(5)
        self._err.close()
        return rc


def check_stopped_cleanly(report: Report, server: ServerProcess, workers: list[int], rc: int, label: str = "") -> None:
    """After ``server.stop()`` returned ``rc``: exit 0, its workers reaped, its ring segments gone
    (``label``: which of several servers, prefixed to the check's name)."""
    left = wait_gone(workers, 10.0)
    shm = server.shm_left()
    report.check(f"{label}: " * bool(label) + "server stops cleanly: no leaked processes or shared memory", rc == 0 and not left and not shm,
                 f"rc {rc}, {len(workers)} workers reaped" + (f"; alive {left}" if left else "") + (f"; shm {shm}" if shm else ""))


def serve_argv(args: argparse.Namespace) -> list[str]:
    """The serve options of a scenario's command line, for the server subprocess."""
    out = []
    for flag, name in (("--config", "config"), ("--preset", "preset"), ("--scheduler", "scheduler"), ("--mode", "mode"),
                       ("--chunks", "chunks"), ("--seed", "seed"), ("--hooks", "hooks"), ("--sp", "sp"),
                       ("--vae-ranks", "vae_ranks"), ("--device", "device"), ("--encoder", "encoder"),
                       ("--ring-slots", "ring_slots"), ("--dit-gpus", "dit_gpus"), ("--vae-gpus", "vae_gpus"),
                       ("--telemetry", "telemetry"), ("--engine", "engine"), ("--dit-weights", "dit_weights"),
                       ("--vae-weights", "vae_weights")):
        v = getattr(args, name, None)
        if isinstance(v, (tuple, list)):
            v = ",".join(map(str, v))
        if v not in (None, ""):
            out += [flag, str(v)]
    for c in getattr(args, "candidate", []) or []:
        out += ["--candidate", c]
    for kv in getattr(args, "set", []) or []:
        out += ["--set", kv]
    if getattr(args, "window", None):
        out += ["--window", str(args.window)]
    return out


def preset_of(serve_args: list[str]) -> str:
    """The preset a server started with ``serve_args`` serves."""
    if "--preset" in serve_args:
        return serve_args[serve_args.index("--preset") + 1]
    if "--config" in serve_args:
        return load_config(serve_args[serve_args.index("--config") + 1]).name
    return "tiny"
