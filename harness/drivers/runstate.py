"""Who owns a run directory, how its run ended, and what a dead run left in ``/dev/shm``.

A run directory is never reused silently: an existing non-empty ``--out`` is refused, and
``--overwrite`` clears it first (only when it is a run directory whose owner is gone). The
manifest records its owner (pid, the pid's start time, boot id), so a manifest that still says
``running`` after its owner died — SIGKILL, a full disk, a power cut — reads as ``abandoned``
rather than running forever.

Ring segments are named ``<prefix>-<owner pid>-<hex>-{ctl,data}`` (pipeline/ring.py), so a later
start can tell whose they are and unlink those whose owner is gone (``reap_dead_rings``): the
resource tracker cleans up after a SIGKILLed owner, but not when the whole process group died.
Owner pids are read in this process's PID namespace: hosts whose containers share ``/dev/shm``
but not their PID namespace must give each container its own ``/dev/shm``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
from pathlib import Path

from harness.drivers.procwatch import SHM, alive, start_time
from harness.errors import HarnessError

#: statuses a finished run can end with; "running" is the only live one
ENDED = ("complete", "failed", "interrupted")
_RING_NAME = re.compile(r"^harness-.*-(\d+)-[0-9a-f]{8}-(ctl|data)$")


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def owner_record(pid: int | None = None) -> dict:
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "start_ticks": start_time(pid), "boot_id": _boot_id(), "host": socket.gethostname()}


def owner_alive(owner: dict | None) -> bool:
    """True when the recorded owner is this very process instance still running (same boot,
    same pid, same start time: a reused pid is not the owner). Another host's owner counts as alive."""
    if not owner:
        return False
    if owner.get("host") != socket.gethostname():
        return True  # cannot tell from here; never call someone else's run abandoned
    if owner.get("boot_id") != _boot_id():
        return False
    pid = int(owner.get("pid", 0))
    return pid > 0 and alive(pid) and start_time(pid) == owner.get("start_ticks")


def read_manifest(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def _status(man: dict | None) -> str:
    if man is None:
        return "unknown"
    status = man.get("status", "unknown")
    if status == "running" and not owner_alive(man.get("owner")):
        return "abandoned"
    return status


def run_status(run_dir: Path) -> str:
    """How the run in ``run_dir`` ended: complete/failed/interrupted, ``running`` (owner alive),
    ``abandoned`` (says running, owner gone), or ``unknown`` (no readable manifest)."""
    return _status(read_manifest(run_dir))


def refuse_unfinished(run_dir: str | Path, allow_running: bool = False) -> None:
    """One line instead of reading a run that never ended (``abandoned``) as if it were valid;
    a live one too unless ``allow_running`` (a report of a run in progress)."""
    man = read_manifest(Path(run_dir))
    status = _status(man)
    if status == "abandoned":
        pid = man.get("owner", {}).get("pid", "?")
        raise HarnessError(f"{run_dir} is an abandoned run: its manifest says running but its owner (pid {pid}) "
                           "is gone, so its files cover an unknown part of the run")
    if status == "running" and not allow_running:
        raise HarnessError(f"{run_dir} is still running; wait for it to end")


#: run directories this process has claimed: path → the open descriptor that holds its lock
_CLAIMS: dict[str, int] = {}


def claim_out(path: Path, overwrite: bool) -> None:
    """Claim ``path`` for one run, atomically: create it if need be and take its lock (held until
    ``release_claim`` or this process ends), then refuse an existing non-empty directory, or clear it
    first when ``overwrite`` is given and it is a run directory nobody is running in. Two runs that
    claim one directory at the same instant cannot both pass the check: the lock orders them."""
    if path.is_symlink() and not path.exists():
        raise HarnessError(f"--out {path} is a symbolic link to {os.readlink(path)}, which does not exist")
    if path.exists() and not path.is_dir():
        raise HarnessError(f"--out {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HarnessError(f"output directory {path} cannot be created: {e.strerror}") from None
    _lock(path)
    try:
        _refuse_or_clear(path, overwrite)
    except BaseException:
        release_claim(path)
        raise


def _lock(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise HarnessError(f"--out {path} is claimed by another run (it holds the directory's lock); "
                               "choose a new directory") from None
        raise HarnessError(f"--out {path}: cannot lock the directory: {e.strerror}") from None
    _CLAIMS[str(path.resolve())] = fd


def release_claim(path: Path) -> None:
    """Let another run claim ``path`` (after this run's last write to it)."""
    fd = _CLAIMS.pop(str(Path(path).resolve()), None)
    if fd is not None:
        os.close(fd)


def _refuse_or_clear(path: Path, overwrite: bool) -> None:
    if not any(path.iterdir()):
        return
    man = read_manifest(path)
    status = _status(man)
    if not overwrite:
        raise HarnessError(f"--out {path} already holds files (a run that is {status}); choose a new directory "
                           "or pass --overwrite to clear it first")
    if status == "unknown":
        raise HarnessError(f"--out {path} is not a run directory (no manifest.json); --overwrite clears only run directories")
    if status == "running":
        raise HarnessError(f"--out {path} is in use by a running run (pid {man['owner']['pid']})")
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def ring_owner(name: str) -> int | None:
    m = _RING_NAME.match(name)
    return int(m.group(1)) if m else None


def reap_dead_rings() -> list[str]:
    """Unlink ``/dev/shm`` ring segments whose owner pid is gone; returns the names removed."""
    removed = []
    try:
        names = [p.name for p in SHM.iterdir()]
    except OSError:
        return removed
    for name in names:
        pid = ring_owner(name)
        if pid is None or alive(pid):
            continue
        try:
            (SHM / name).unlink()
            removed.append(name)
        except OSError:  # another start reaped it first, or not ours to remove
            pass
    return removed
