"""The run directory: where a run's manifest, events, summary, outputs and media live.

Files are written whole or not at all (temp file + rename), so a run that fails half-way never
leaves a truncated ``summary.json`` that looks valid; ``manifest.json`` records the status.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy
import torch

from harness.config import REPO_ROOT, to_dict
from harness.drivers.runstate import claim_out, release_claim
from harness.errors import HarnessError


def new_run_dir(out: str | None, name: str, overwrite: bool = False) -> Path:
    """A fresh run directory: an existing non-empty one is refused unless ``overwrite`` (runstate.claim_out)."""
    if out is not None and not out.strip():  # not the default directory: the user named one, and it is empty
        raise HarnessError(f"--out {out!r} is empty; name a directory, or leave --out out for runs/<run_id>")
    if out:
        path = Path(out)
    else:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = REPO_ROOT / "runs" / f"{stamp}-{name}-{os.getpid()}"
    claim_out(path, overwrite)
    try:
        (path / "media").mkdir(exist_ok=True)
        (path / "outputs").mkdir(exist_ok=True)
        _reserve(path)  # also the proof that a file can be written there
    except OSError as e:
        release_claim(path)
        raise HarnessError(f"output directory {path} is not writable: {e.strerror}") from None
    return path


#: space held in the run directory from its claim to the run's end, then freed for the last
#: files (summary, manifest): a disk that fills during the run still gets told how the run ended
RESERVE_NAME, RESERVE_BYTES = ".space-reserve", 256 << 10


def _reserve(path: Path) -> None:
    fd = os.open(path / RESERVE_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without fallocate: write it
                raise
            os.write(fd, bytes(RESERVE_BYTES))
    except OSError:
        os.close(fd)
        (path / RESERVE_NAME).unlink(missing_ok=True)
        raise
    os.close(fd)


def release_reserve(run_dir: Path) -> None:
    """Free the run directory's reserved space, just before its last files are written."""
    (Path(run_dir) / RESERVE_NAME).unlink(missing_ok=True)


def write_json(path: Path, obj) -> None:
    data = msgspec.json.format(msgspec.json.encode(obj), indent=2) + b"\n"
    with _replacing(path) as f:
        f.write(data)


def write_jsonl(path: Path, rows) -> None:
    enc = msgspec.json.Encoder()
    with _replacing(path) as f:
        for r in rows:
            f.write(enc.encode(r) + b"\n")


@contextlib.contextmanager
def _replacing(path: Path):
    """Write ``path`` whole or not at all: a temp file renamed over it, removed when the write
    fails (a full disk leaves no 0-byte ``.tmp`` that looks like a file being written)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def git_state() -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    commit = git("rev-parse", "HEAD")
    return {"commit": commit or None, "dirty": bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None}


def versions() -> dict:
    v = {
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
        "numpy": numpy.__version__,
        "msgspec": msgspec.__version__,
        "harness_git": git_state(),
        "platform": platform.platform(),
    }
    try:
        import av  # optional here: recorded when installed (a GPU host that encodes nothing may lack it)

        v["av"] = av.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        v["cudnn"] = torch.backends.cudnn.version()
        v["tf32_conv"] = bool(torch.backends.cudnn.allow_tf32)
        v["tf32_matmul"] = bool(torch.backends.cuda.matmul.allow_tf32)
    return v


def command_line(argv: list[str]) -> list[str]:
    """The command as a user would type it again: ``python -m harness …`` rather than the path of
    this checkout's ``__main__.py`` (a run directory must not carry the machine's layout)."""
    if not argv:
        return []
    head = argv[0].replace(os.sep, "/")
    if head.endswith("harness/__main__.py"):
        return ["python", "-m", "harness", *argv[1:]]
    return [os.path.basename(head), *argv[1:]]


def manifest(cfg, *, candidates, hooks, placement, devices, extra=None) -> dict:
    cfg_d = to_dict(cfg)
    return {
        "command": command_line(sys.argv),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "config": cfg_d,
        "config_sha256": hashlib.sha256(json.dumps(cfg_d, sort_keys=True).encode()).hexdigest(),
        "preset": cfg.name,
        "mode": cfg.runtime.mode,
        "scheduler": cfg.runtime.scheduler,
        "candidates": list(candidates),
        "hooks": list(hooks),
        "placement": placement,
        "devices": devices,
        # what a seed stands for: the noise convention (schedule.noise, harness/engine/noise.py)
        "seeds": {"run": cfg.runtime.seed, "sessions": "seed + session index", "noise": cfg.schedule.noise},
        "protocol": {
            "sessions": cfg.runtime.sessions,
            "warmup_epochs": 1,
            "chunks_per_session": cfg.video.chunks_per_session,
            # what a reader counting frames in the media sees (the config counts latent frames)
            "pixel_frames": {"first_chunk": cfg.video.pixel_frames(0), "later_chunks": cfg.video.pixel_frames(1),
                             "session": cfg.video.session_frames()},
            "saved_epochs": list(cfg.runtime.save_epochs),
        },
        "versions": versions(),
        **(extra or {}),
    }


def host_load() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (None where the platform has none): a busy host
    slows every stage, so the setting line shows it beside the figures."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
