"""A rank's host memory between sessions: what a long-lived server must not keep.

Two things made a worker's resident memory move from session to session although no Python object
outlived its session (a soak of ``serve --listen``, tracemalloc against glibc's ``mallinfo2``):

* glibc keeps the memory a chunk's temporaries freed (activations, halos, uint8 frames) in its
  arenas for reuse, in whatever holes the last session left: a tiny-preset VAE rank's resident
  size swung by up to 80 MiB between sessions with its in-use heap flat. ``trim_heap`` at a
  session's end hands the free pages back (``malloc_trim(0)``), so every session starts from the
  same heap.
* torch.distributed's flight recorder keeps a record of a process's last 2000 collectives (the
  tiny DiT's in-use heap grew ≈ 60 KiB a session, ≈ 3 MiB by the 50th, with the VAE's and the
  Python heap flat). It exists to be dumped after a hang; the harness never dumps it (a stalled
  stage is reported by the driver, with its rank), so ``flight_recorder_off`` turns it off unless
  the operator sized it (``TORCH_FR_BUFFER_SIZE``).
"""

from __future__ import annotations

import ctypes
import os
import sys

#: torch.distributed's flight-recorder size (entries); read when a process group is created
FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"


def _malloc_trim():
    """glibc's ``malloc_trim`` in this process, None elsewhere (another OS, or a libc without it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Give the allocator's free pages back to the kernel; True when it released any."""
    return bool(_TRIM(0)) if _TRIM is not None else False


def flight_recorder_off(env=os.environ) -> None:
    """Before the process group exists: no flight recorder, unless ``env`` sizes it already."""
    env.setdefault(FLIGHT_RECORDER_ENV, "0")
