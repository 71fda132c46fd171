"""Read a video back into (N, H, W, 3) uint8 RGB with its frame timestamps, two independent ways:
PyAV in-process, and the ffmpeg binary (rawvideo rgb24 on stdout, frame times from ``framecrc``).
Used by the tests and by serve's acceptance check that media decodes to the exact frames."""

from __future__ import annotations

import re
import subprocess
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple

import numpy as np

from harness.errors import HarnessError


class Decoded(NamedTuple):
    frames: np.ndarray  # (N, H, W, 3) uint8
    pts: np.ndarray  # (N,) int64, in time_base units
    time_base: Fraction

    @property
    def seconds(self) -> np.ndarray:
        return self.pts * float(self.time_base)


def ffmpeg_exe() -> str:
    import imageio_ffmpeg  # on use: a reader with only PyAV (or only ffmpeg) imports this module too

    return imageio_ffmpeg.get_ffmpeg_exe()


def decode_pyav(path: str | Path) -> Decoded:
    import av  # on use: a reader with only PyAV (or only ffmpeg) imports this module too

    frames, pts = [], []
    try:
        with av.open(str(path)) as c:
            stream = c.streams.video[0]
            tb = Fraction(stream.time_base)
            for f in c.decode(stream):
                frames.append(f.to_ndarray(format="rgb24"))
                pts.append(f.pts)
    except (av.error.FFmpegError, IndexError) as e:
        raise HarnessError(f"cannot decode {path} with PyAV: {e}") from None
    return Decoded(_stack(frames), np.asarray(pts, np.int64), tb)


def _run(args: list[str], what: str) -> bytes:
    p = subprocess.run([ffmpeg_exe(), "-hide_banner", "-nostdin", "-loglevel", "error", *args],
                       capture_output=True)
    if p.returncode:
        raise HarnessError(f"ffmpeg could not {what}: {p.stderr.decode(errors='replace').strip()[-300:]}")
    return p.stdout


def decode_ffmpeg(path: str | Path) -> Decoded:
    """Two runs of the binary: ``framecrc`` (geometry, pts per decoded frame in the container's
    own time base), then the pixels as rawvideo rgb24; passthrough frame timing so nothing is
    duplicated or dropped."""
    path = str(path)
    crc = _run(["-i", path, "-map", "0:v:0", "-fps_mode", "passthrough", "-enc_time_base", "demux",
                "-f", "framecrc", "-"],
               f"read frame times of {path}").decode()
    tb = re.search(r"^#tb 0: (\d+)/(\d+)", crc, re.M)
    dims = re.search(r"^#dimensions 0: (\d+)x(\d+)", crc, re.M)
    if not (tb and dims):
        raise HarnessError(f"ffmpeg framecrc of {path} has no video stream header")
    w, h = int(dims[1]), int(dims[2])
    pts = [int(line.split(",")[2]) for line in crc.splitlines() if line and not line.startswith("#")]
    raw = _run(["-i", path, "-map", "0:v:0", "-fps_mode", "passthrough", "-f", "rawvideo",
                "-pix_fmt", "rgb24", "-"], f"decode {path}")
    frame_bytes = w * h * 3
    if len(raw) % frame_bytes:
        raise HarnessError(f"ffmpeg decoded {len(raw)} bytes, not a whole number of {w}x{h} frames")
    frames = np.frombuffer(raw, np.uint8).reshape(-1, h, w, 3)
    if len(frames) != len(pts):
        raise HarnessError(f"ffmpeg decoded {len(frames)} frames but listed {len(pts)}")
    return Decoded(frames, np.asarray(pts, np.int64), Fraction(int(tb[1]), int(tb[2])))


def _stack(frames: list[np.ndarray]) -> np.ndarray:
    return np.stack(frames) if frames else np.zeros((0, 0, 0, 3), np.uint8)
