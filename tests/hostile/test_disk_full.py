"""A run whose disk fills (issue 28 row 4), on a real full filesystem: a small tmpfs that the test
mounts as ``--out``'s filesystem (root needed; skipped, saying so, where mounting is refused). The
manifest must say ``failed`` with the reason, not stay ``running``; no truncated
``chunkNN.pixels.npy.tmp``, no ``session*.mkv.part`` and no space reserve is left behind."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from harness.config import load_preset, override
from harness.drivers.rundir import RESERVE_NAME
from harness.drivers.serve_run import ServeOptions, serve
from harness.errors import HarnessError
from harness.measure.gates import save_pixels
from harness.pipeline.sinks import FileSink


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs: a run of the tiny preset fills it in its second or third chunk."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {got.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_run_that_fills_its_disk_ends_failed_with_the_reason_and_nothing_half_written(small_fs):
    out = small_fs / "run"
    cfg = override(load_preset("tiny"), runtime={"sessions": 1}, video={"chunks_per_session": 6})
    with pytest.raises(HarnessError, match="No space left on device"):
        serve(cfg, ServeOptions(out=str(out), progress=False, probes=False))
    man = json.loads((out / "manifest.json").read_text())
    assert man["status"] == "failed" and "No space left on device" in man["error"], man["error"]
    left = [p.name for p in out.rglob("*") if p.name.endswith((".tmp", ".part")) or p.name == RESERVE_NAME]
    assert left == [], f"half-written files left: {left}"
    assert (out / "outputs" / "epoch0" / "chunk00.pixels.npy").exists()  # it did run until the disk was full
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed"


def test_a_chunk_save_and_a_media_file_that_meet_a_full_disk_leave_nothing(small_fs):
    pixels = np.zeros((12, 64, 128, 3), np.uint8)  # 295 KB: four of them do not fit in 1 MiB
    with pytest.raises(OSError, match="No space left on device"):
        for chunk in range(4):
            save_pixels(small_fs, 0, chunk, pixels)
    assert not list(small_fs.rglob("*.tmp"))
    sink = FileSink(small_fs / "media", 0, buffer_bytes=0)
    with pytest.raises(OSError, match="No space left on device"):
        for _ in range(64):
            sink.write(b"\0" * 65536)
    assert not list(small_fs.rglob("*.part")) and not (small_fs / "media" / "session0.mkv").exists()
