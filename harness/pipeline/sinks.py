"""Where encoded media goes: a file, nowhere (byte counting), memory fragments, or a rate-limited
wrapper around any of them.

A sink is a file-like object for the muxer (``write``; ``seek``/``tell`` when it is a real file)
plus ``commit(chunk, frames)``, which the encoder calls once all of a chunk's bytes have been
written. ``commit`` is the sink accepting the chunk: it flushes what it must and records
``time.monotonic_ns()`` — that record is the chunk's ``delivered`` boundary.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import msgspec

from harness.errors import HarnessError


class Delivery(msgspec.Struct, frozen=True):
    """One chunk accepted by a sink."""
    chunk: int
    frames: int
    bytes: int
    accepted_ns: int


def ensure_writable_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` if needed and prove a file can be created in it; else one-line HarnessError.

    A real create+delete rather than ``os.access``: root passes every access check, and read-only
    mounts, full disks and paths through a regular file only show up on an actual write."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise HarnessError(f"output directory {path} is not writable: {e.strerror or e}") from None
    return path


class Sink:
    name: ClassVar[str] = ""

    def __init__(self) -> None:
        self.records: list[Delivery] = []
        self.bytes_written = 0
        self.blocked_ns = 0  # time writers spent waiting on this sink (throttling: backpressure)
        self._blocked_taken = 0
        self._bytes_at_commit = 0
        self.closed = False

    @property
    def bytes_accepted(self) -> int:
        return self.bytes_written

    def take_blocked_ns(self) -> int:
        """Blocked time since the previous call (per-chunk accounting)."""
        taken, self._blocked_taken = self.blocked_ns - self._blocked_taken, self.blocked_ns
        return taken

    # -- file-like side, for the muxer ------------------------------------------------------
    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self._accept(data)
        self.bytes_written += n
        return n

    def _accept(self, data) -> None:
        raise NotImplementedError

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass

    # -- chunk side, for the encoder --------------------------------------------------------
    def commit(self, chunk: int, frames: int) -> int:
        """All bytes of ``chunk`` have been written: make them the consumer's and stamp it."""
        self._deliver(chunk)
        now = time.monotonic_ns()
        self.records.append(Delivery(chunk, frames, self.bytes_written - self._bytes_at_commit, now))
        self._bytes_at_commit = self.bytes_written
        return now

    def _deliver(self, chunk: int) -> None:
        pass

    @property
    def frames_committed(self) -> int:
        return sum(r.frames for r in self.records)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        """Stop without claiming the output is valid (cancel, crash)."""
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        self.abort() if exc_type else self.close()


class FileSink(Sink):
    """``<directory>/session{S}.mkv``. Bytes go to ``….mkv.part`` and the file is renamed into
    place on ``close``, so a file under its final name is always a finished container; ``abort``
    removes the partial file. ``commit`` flushes to the OS (page cache), not to the disk."""

    name = "file"

    def __init__(self, directory: str | os.PathLike | None = None, session: int = 0, *,
                 path: str | os.PathLike | None = None, fsync: bool = False, buffer_bytes: int = 1 << 20) -> None:
        super().__init__()
        if path is None and directory is None:
            raise HarnessError("file sink needs a directory (or an explicit path)")
        self.path = Path(path) if path is not None else Path(directory) / f"session{session}.mkv"
        ensure_writable_dir(self.path.parent)
        self.part_path = self.path.with_name(self.path.name + ".part")
        try:
            self._f = open(self.part_path, "wb", buffering=buffer_bytes)
        except OSError as e:
            raise HarnessError(f"cannot write {self.part_path}: {e.strerror}") from None
        self.fsync = fsync

    @contextlib.contextmanager
    def _or_abort(self):
        """A failed write (a full disk) removes the partial file: nothing half-written is left."""
        try:
            yield
        except OSError:
            self.abort()
            raise

    def _accept(self, data) -> None:
        with self._or_abort():
            self._f.write(data)

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        with self._or_abort():
            return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        with self._or_abort():
            self._f.flush()

    def _deliver(self, chunk: int) -> None:
        with self._or_abort():
            self._f.flush()
            if self.fsync:
                os.fsync(self._f.fileno())

    def close(self) -> None:
        if self.closed:
            return
        with self._or_abort():
            self._f.flush()  # the last buffered bytes can meet a full disk too
        super().close()
        self._f.close()
        os.replace(self.part_path, self.path)

    def abort(self) -> None:
        if self.closed:
            return
        super().abort()
        try:
            self._f.close()  # flushes what is buffered: on a full disk that fails too, and the file goes anyway
        except OSError:
            pass
        self.part_path.unlink(missing_ok=True)


class NullSink(Sink):
    """Counts and discards: measures everything upstream of the sink."""

    name = "null"

    def _accept(self, data) -> None:
        pass


class MemorySink(Sink):
    """Collects each chunk's bytes as one fragment (the first also carries the container header):
    what a network endpoint sends per chunk. ``on_fragment(chunk, data)`` is called at commit;
    without it fragments are kept in ``fragments``."""

    name = "memory"

    def __init__(self, on_fragment: Callable[[int, bytes], None] | None = None) -> None:
        super().__init__()
        self._buf = bytearray()
        self.on_fragment = on_fragment
        self.fragments: list[tuple[int, bytes]] = []
        self.tail = b""  # bytes written after the last commit (container trailer, if any)

    def _accept(self, data) -> None:
        self._buf += data

    def _deliver(self, chunk: int) -> None:
        data, self._buf = bytes(self._buf), bytearray()
        if self.on_fragment is not None:
            self.on_fragment(chunk, data)
        else:
            self.fragments.append((chunk, data))

    def close(self) -> None:
        self.tail, self._buf = bytes(self._buf), bytearray()
        super().close()

    def getvalue(self) -> bytes:
        return b"".join(d for _, d in self.fragments) + bytes(self._buf) + self.tail


#: the slowest and fastest consumer a throttled sink plays: below a frame per 1000 s a chunk's pacing
#: overflows a timed wait (``throttled:1e-300``), above a million frames/s it throttles nothing
MIN_THROTTLE_FPS, MAX_THROTTLE_FPS = 1e-3, 1e6


def throttle_fps_ok(fps: float) -> bool:
    return MIN_THROTTLE_FPS <= fps <= MAX_THROTTLE_FPS  # nan fails both


class ThrottledSink(Sink):
    """Accepts at most ``bytes_per_s`` and/or ``frames_per_s`` by making the writer wait: the
    slow consumer of the backpressure scenarios. Pacing is a virtual clock (each unit of work
    finishes no earlier than the previous one's end plus its cost), so the long-run rate never
    exceeds the limit and an idle period does not build up a burst allowance."""

    name = "throttled"

    def __init__(self, inner: Sink, *, bytes_per_s: float | None = None, frames_per_s: float | None = None) -> None:
        if not bytes_per_s and not frames_per_s:
            raise HarnessError("throttled sink needs bytes_per_s or frames_per_s")
        if (bytes_per_s is not None and bytes_per_s <= 0) or (frames_per_s is not None and not throttle_fps_ok(frames_per_s)):
            raise HarnessError(f"throttled sink rates must be positive (frames/s in {MIN_THROTTLE_FPS:g}-{MAX_THROTTLE_FPS:g})")
        super().__init__()
        self.inner = inner
        self.bytes_per_s, self.frames_per_s = bytes_per_s, frames_per_s
        self._bytes_free_at = self._frames_free_at = 0

    def _pace(self, free_at: int, cost_s: float) -> int:
        now = time.monotonic_ns()
        done = max(now, free_at) + int(cost_s * 1e9)
        wait = done - now
        if wait > 0:
            time.sleep(wait / 1e9)
            self.blocked_ns += time.monotonic_ns() - now
        return done

    def _accept(self, data) -> None:
        if self.bytes_per_s:
            self._bytes_free_at = self._pace(self._bytes_free_at, memoryview(data).nbytes / self.bytes_per_s)
        self.inner.write(data)

    def seekable(self) -> bool:
        return self.inner.seekable()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.inner.seek(offset, whence)

    def tell(self) -> int:
        return self.inner.tell()

    def flush(self) -> None:
        self.inner.flush()

    def commit(self, chunk: int, frames: int) -> int:
        if self.frames_per_s:
            self._frames_free_at = self._pace(self._frames_free_at, frames / self.frames_per_s)
        now = self.inner.commit(chunk, frames)
        self.records.append(Delivery(chunk, frames, self.bytes_written - self._bytes_at_commit, now))
        self._bytes_at_commit = self.bytes_written
        return now

    def close(self) -> None:
        if not self.closed:
            super().close()
            self.inner.close()

    def abort(self) -> None:
        if not self.closed:
            super().abort()
            self.inner.abort()


SINKS: dict[str, type[Sink]] = {c.name: c for c in (FileSink, NullSink, MemorySink, ThrottledSink)}


def make_sink(name: str, **kwargs) -> Sink:
    """``make_sink("file", directory=run/"media", session=3)``, ``make_sink("null")``,
    ``make_sink("throttled", inner=make_sink("file", …), frames_per_s=4)``."""
    try:
        cls = SINKS[name]
    except KeyError:
        raise HarnessError(f"unknown sink {name!r} (known: {', '.join(sorted(SINKS))})") from None
    return cls(**kwargs)
