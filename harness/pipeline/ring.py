"""A shared-memory ring of fixed-size frame slots between processes of one host.

Pixels never travel through a pipe: the producer (VAE rank 0) acquires a slot, writes uint8
frames (T, H, W, 3) into it, publishes it, and sends only a ``SlotRef`` (slot, generation, shape,
session, chunk) over its control channel; the consumer (encoder stage) claims a zero-copy view
and releases the slot. The number of slots bounds memory, and ``acquire`` blocking when none is
free is the backpressure; the time it blocked is recorded.

Cross-process accounting (the free-list): a small control segment holds a FIFO of free slot ids
and one record per slot (state, generation, holder pid, session, chunk, bytes, times), all
int64, guarded by ``flock`` on the control segment's file plus a thread lock. flock is released
by the kernel when a holder dies, even by SIGKILL, so a dead producer can never wedge the lock;
the slot it held is recovered by ``reclaim`` (owner side), which frees slots held by dead pids
or belonging to a cancelled session. Any process can attach from the ``RingSpec`` alone (names
and sizes), so workers started by multiprocessing, subprocess or Ray all work. ``acquire`` waits
by polling with a short backoff (≤ 1 ms) rather than a cross-process condition variable: the
chunk period is hundreds of milliseconds, and polling survives any process dying.

Slot life: FREE → WRITING (producer pid) → READY (published; owned by the message in flight)
→ READING (consumer pid) → FREE. The generation, bumped on every acquire, makes a stale
``SlotRef`` (a slot reclaimed and reused meanwhile) fail loudly instead of reading new frames.

Lifetime: only the owner (``create``) unlinks. It registers the segments with multiprocessing's
resource tracker (which unlinks them if the owner itself is SIGKILLed) and a finalizer that runs
at interpreter exit or when the ring is garbage; ``close()`` unlinks first and unmaps second, so
names are gone even while a view is alive. A producer blocked in ``acquire`` gives up with
RingClosed when the owner closes the ring or its process disappears.
Attaching processes use plain ``mmap`` of /dev/shm and never register: otherwise Python 3.11's
tracker in an unrelated process would unlink the owner's ring when that process exits.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import threading
import time
import weakref
from multiprocessing import resource_tracker
from pathlib import Path

import msgspec
import numpy as np

from harness.errors import HarnessError

SHM_DIR = Path("/dev/shm")
MAGIC = 0x48524E47  # "HRNG"

FREE, WRITING, READY, READING = 0, 1, 2, 3
STATE_NAMES = {FREE: "free", WRITING: "writing", READY: "ready", READING: "reading"}

# Control segment, int64 words: header, then the free FIFO (slots entries), then slot records.
(H_MAGIC, H_SLOTS, H_SLOT_BYTES, H_HEAD, H_NFREE, H_GENERATION, H_ACQUIRES, H_RELEASES,
 H_HIGH_WATER, H_BLOCKED_NS, H_BLOCKED_N, H_CLOSED, H_RECLAIMED, H_OWNER_PID) = range(14)
HEADER_WORDS = 16
R_STATE, R_GEN, R_PID, R_SESSION, R_CHUNK, R_NBYTES, R_ACQUIRE_NS, R_READY_NS = range(8)
RECORD_WORDS = 8

_ALIGN = 4096  # slots start on page boundaries


class RingClosed(HarnessError):
    """The ring's owner closed it; no slot will become free again."""


class StaleSlot(HarnessError):
    """A SlotRef whose slot was reclaimed (and perhaps reused) since it was issued."""


class RingSpec(msgspec.Struct, frozen=True):
    """Everything another process needs to attach."""
    prefix: str
    data_name: str
    ctl_name: str
    slots: int
    slot_bytes: int


class SlotRef(msgspec.Struct, frozen=True):
    """The small message that stands for a slot's frames on the control channel."""
    slot: int
    generation: int
    session: int = -1
    chunk: int = -1
    shape: tuple[int, ...] = ()  # (T, H, W, 3) once published
    ready_ns: int = 0  # when the producer published it (cpu_ready)

    @property
    def frames(self) -> int:
        return self.shape[0] if self.shape else 0

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 0


class RingStats(msgspec.Struct, frozen=True):
    slots: int
    slot_bytes: int
    free: int
    writing: int
    ready: int
    reading: int
    acquires: int
    releases: int
    high_water: int  # most slots in use at once
    blocked_ns: int  # all producers' time blocked in acquire
    blocked_count: int
    reclaimed: int

    @property
    def in_use(self) -> int:
        return self.slots - self.free


def leftover_segments(prefix: str) -> list[str]:
    """Names under /dev/shm starting with ``prefix`` (the leak check of tests and scenarios)."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Segment:
    """One /dev/shm file mapped read-write (no resource-tracker involvement)."""

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.name = name
        path = SHM_DIR / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            self.fd = os.open(path, flags, 0o600)
        except OSError as e:
            verb = "create" if create else "attach"
            raise HarnessError(f"cannot {verb} shared memory {path}: {e.strerror}") from None
        try:
            if create:
                os.ftruncate(self.fd, size)
            elif os.fstat(self.fd).st_size < size:
                raise HarnessError(f"shared memory {path} is smaller than its spec says")
            self.mm = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            if create:
                path.unlink(missing_ok=True)
            raise

    def unmap(self) -> bool:
        """Close the mapping; False when numpy views are still alive (they keep it mapped)."""
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:
                return False
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        return True


def _track(name: str, register: bool) -> None:
    try:
        (resource_tracker.register if register else resource_tracker.unregister)("/" + name, "shared_memory")
    except Exception:  # the tracker is a safety net, not a requirement
        pass


def _unlink_names(names: tuple[str, ...]) -> None:
    for n in names:
        try:
            (SHM_DIR / n).unlink()
        except FileNotFoundError:
            pass


class _Made(msgspec.Struct):
    """A ring's segments as far as ``create`` got: their names, and those the resource tracker
    was told of (only those may be untold: the tracker fails on a name it does not know)."""

    names: tuple[str, ...]
    tracked: list[str] = []
    destroyed: bool = False


def _destroy(made: _Made, creator: int) -> None:
    # A forked child inherits the owner object (and this finalizer): only the creator unlinks.
    # Once only: ``create``'s own clean-up and the finalizer may both reach here.
    if os.getpid() != creator or made.destroyed:
        return
    made.destroyed = True
    _unlink_names(made.names)
    for n in made.tracked:
        _track(n, False)


class FrameRing:
    def __init__(self, spec: RingSpec, owner: bool) -> None:
        self.spec, self.owner = spec, owner
        ctl_bytes = 8 * (HEADER_WORDS + spec.slots + spec.slots * RECORD_WORDS)
        self._ctl = _Segment(spec.ctl_name, ctl_bytes, create=owner)
        try:
            self._data = _Segment(spec.data_name, spec.slots * spec.slot_bytes, create=owner)
        except BaseException:
            self._ctl.unmap()
            if owner:
                _unlink_names((spec.ctl_name,))
            raise
        words = np.frombuffer(self._ctl.mm, np.int64)
        self._h = words[:HEADER_WORDS]
        self._fifo = words[HEADER_WORDS:HEADER_WORDS + spec.slots]
        self._rec = words[HEADER_WORDS + spec.slots:].reshape(spec.slots, RECORD_WORDS)
        self._tlock = threading.Lock()
        self._pid = os.getpid()
        self.blocked_ns = 0  # this process's own acquire waits
        self._closed = False

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def create(cls, name_prefix: str, slots: int, slot_bytes: int, prefault: bool = True) -> FrameRing:
        if slots < 1 or slot_bytes < 1:
            raise HarnessError(f"frame ring needs slots ≥ 1 and slot_bytes ≥ 1, got {slots} × {slot_bytes}")
        if "/" in name_prefix:
            raise HarnessError(f"ring name prefix {name_prefix!r} must not contain '/'")
        slot_bytes = -(-slot_bytes // _ALIGN) * _ALIGN
        base = f"{name_prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        spec = RingSpec(name_prefix, f"{base}-data", f"{base}-ctl", slots, slot_bytes)
        made = _Made((spec.data_name, spec.ctl_name))
        try:
            ring = cls(spec, owner=True)
            for n in made.names:
                _track(n, True)
                made.tracked.append(n)
            # Runs once: on unlink(), when the ring is garbage, or at interpreter exit (finalize's
            # own atexit hook). It holds only names, so it cannot keep the ring alive.
            ring._finalizer = weakref.finalize(ring, _destroy, made, os.getpid())
        except BaseException:  # a signal's exception between the segments' creation and their finalizer
            _destroy(made, os.getpid())
            raise
        h = ring._h
        h[H_SLOTS], h[H_SLOT_BYTES], h[H_OWNER_PID] = slots, slot_bytes, os.getpid()
        ring._fifo[:] = np.arange(slots)
        h[H_HEAD], h[H_NFREE] = 0, slots
        h[H_MAGIC] = MAGIC  # last: an attacher seeing the magic sees a complete header
        if prefault:
            # Touch every page now, so the first chunks do not pay page faults inside timed copies.
            np.frombuffer(ring._data.mm, np.uint8)[::mmap.PAGESIZE] = 0
        return ring

    @classmethod
    def attach(cls, spec: RingSpec) -> FrameRing:
        ring = cls(spec, owner=False)
        if ring._h[H_MAGIC] != MAGIC or ring._h[H_SLOTS] != spec.slots or ring._h[H_SLOT_BYTES] != spec.slot_bytes:
            ring.close()
            raise HarnessError(f"shared memory {spec.ctl_name} is not the frame ring its spec describes")
        return ring

    # ---- locking --------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self):
        with self._tlock:  # flock is per open file, so threads of one process need their own lock
            fcntl.flock(self._ctl.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._ctl.fd, fcntl.LOCK_UN)

    def _check_open(self) -> None:
        if self._closed:
            raise RingClosed("frame ring is closed in this process")
        if self._h[H_CLOSED]:
            raise RingClosed("frame ring was closed by its owner")

    # ---- producer side ---------------------------------------------------------------------
    def try_acquire(self, session: int = -1, chunk: int = -1) -> SlotRef | None:
        self._check_open()
        with self._locked():
            h = self._h
            if h[H_NFREE] == 0:
                return None
            head = int(h[H_HEAD])
            slot = int(self._fifo[head])
            h[H_HEAD], h[H_NFREE] = (head + 1) % self.spec.slots, h[H_NFREE] - 1
            h[H_GENERATION] += 1
            gen = int(h[H_GENERATION])
            r = self._rec[slot]
            if r[R_STATE] != FREE:
                state = STATE_NAMES.get(int(r[R_STATE]))
                raise HarnessError(f"frame ring corrupt: slot {slot} on the free list is {state}")
            r[:] = (WRITING, gen, self._pid, session, chunk, 0, time.monotonic_ns(), 0)
            h[H_ACQUIRES] += 1
            h[H_HIGH_WATER] = max(h[H_HIGH_WATER], self.spec.slots - h[H_NFREE])
            return SlotRef(slot, gen, session, chunk)

    def acquire(self, session: int = -1, chunk: int = -1, timeout: float | None = None) -> SlotRef:
        """A free slot, now in state WRITING held by this process. Blocks while all slots are in
        use; raises TimeoutError after ``timeout`` s, RingClosed if the owner closes the ring."""
        ref = self.try_acquire(session, chunk)
        if ref is not None:
            return ref
        t0 = time.monotonic_ns()
        deadline = None if timeout is None else t0 + int(timeout * 1e9)
        pause, next_owner_check = 20e-6, t0
        try:
            while ref is None:
                now = time.monotonic_ns()
                if deadline is not None and now >= deadline:
                    raise TimeoutError(f"no free frame-ring slot within {timeout} s")
                if now >= next_owner_check:
                    # An owner killed outright never sets CLOSED; do not wait for it forever.
                    if not _pid_alive(int(self._h[H_OWNER_PID])):
                        raise RingClosed("frame ring owner process is gone")
                    next_owner_check = now + 100_000_000
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
                ref = self.try_acquire(session, chunk)
        finally:
            waited = time.monotonic_ns() - t0
            self.blocked_ns += waited
            if not self._closed and not self._h[H_CLOSED]:
                with self._locked():
                    self._h[H_BLOCKED_NS] += waited
                    self._h[H_BLOCKED_N] += 1
        return ref

    def buffer(self, ref: SlotRef, shape: tuple[int, ...]) -> np.ndarray:
        """Writable uint8 view of a WRITING slot, e.g. the destination of a device-to-host copy."""
        self._check_ref(ref, (WRITING,))
        n = int(np.prod(shape))
        if n > self.spec.slot_bytes:
            raise HarnessError(f"{shape} uint8 ({n} bytes) does not fit a {self.spec.slot_bytes}-byte ring slot")
        return np.frombuffer(self._data.mm, np.uint8, n, ref.slot * self.spec.slot_bytes).reshape(shape)

    def publish(self, ref: SlotRef, shape: tuple[int, ...]) -> SlotRef:
        """WRITING → READY: the frames are complete; returns the ref to send to the consumer."""
        now = time.monotonic_ns()
        with self._locked():
            r = self._check_ref(ref, (WRITING,))
            r[R_STATE], r[R_NBYTES], r[R_READY_NS] = READY, int(np.prod(shape)), now
        return msgspec.structs.replace(ref, shape=tuple(int(s) for s in shape), ready_ns=now)

    def put(self, frames: np.ndarray, session: int = -1, chunk: int = -1, timeout: float | None = None) -> SlotRef:
        """acquire + copy + publish, for producers whose frames are already in host memory."""
        if frames.dtype != np.uint8:
            raise HarnessError(f"frame ring carries uint8, got {frames.dtype}")
        ref = self.acquire(session, chunk, timeout)
        try:
            np.copyto(self.buffer(ref, frames.shape), frames)
        except BaseException:
            self.release(ref)
            raise
        return self.publish(ref, frames.shape)

    # ---- consumer side ---------------------------------------------------------------------
    def claim(self, ref: SlotRef) -> np.ndarray:
        """READY → READING by this process; a read-only zero-copy view valid until ``release``."""
        with self._locked():
            r = self._check_ref(ref, (READY,))
            r[R_STATE], r[R_PID] = READING, self._pid
        view = np.frombuffer(self._data.mm, np.uint8, ref.nbytes, ref.slot * self.spec.slot_bytes).reshape(ref.shape)
        view.flags.writeable = False
        return view

    def release(self, ref: SlotRef) -> None:
        """Back to the free list, from any state (a producer abandoning a slot, a consumer done,
        a cancelled chunk dropped unread). Releasing a stale ref raises StaleSlot."""
        with self._locked():
            self._check_ref(ref, (WRITING, READY, READING))
            self._free(ref.slot)

    def _free(self, slot: int) -> None:
        h, r = self._h, self._rec[slot]
        r[R_STATE], r[R_PID] = FREE, 0
        tail = (int(h[H_HEAD]) + int(h[H_NFREE])) % self.spec.slots
        self._fifo[tail] = slot
        h[H_NFREE] += 1
        h[H_RELEASES] += 1

    def _check_ref(self, ref: SlotRef, states: tuple[int, ...]) -> np.ndarray:
        self._check_open()
        if not 0 <= ref.slot < self.spec.slots:
            raise HarnessError(f"frame ring has no slot {ref.slot}")
        r = self._rec[ref.slot]
        if r[R_GEN] != ref.generation or r[R_STATE] == FREE:
            raise StaleSlot(f"slot {ref.slot} generation {ref.generation} is stale "
                            f"(now generation {int(r[R_GEN])}, {STATE_NAMES[int(r[R_STATE])]})")
        if r[R_STATE] not in states:
            raise HarnessError(f"slot {ref.slot} is {STATE_NAMES[int(r[R_STATE])]}, expected "
                               f"{' or '.join(STATE_NAMES[s] for s in states)}")
        return r

    # ---- recovery and accounting -----------------------------------------------------------
    def reclaim(self, session: int | None = None, dead: bool = True) -> list[int]:
        """Free slots held by processes that no longer exist (``dead``) and, given ``session``,
        every slot of that session whatever its state (cancel). Returns the slots freed; their
        outstanding SlotRefs become stale."""
        freed = []
        with self._locked():
            for slot in range(self.spec.slots):
                r = self._rec[slot]
                state = int(r[R_STATE])
                if state == FREE:
                    continue
                if (session is not None and r[R_SESSION] == session) or (
                        dead and state in (WRITING, READING) and not _pid_alive(int(r[R_PID]))):
                    self._free(slot)
                    freed.append(slot)
            self._h[H_RECLAIMED] += len(freed)
        return freed

    def stats(self) -> RingStats:
        with self._locked():
            h = self._h
            states = self._rec[:, R_STATE]
            return RingStats(self.spec.slots, self.spec.slot_bytes, int(h[H_NFREE]),
                             int((states == WRITING).sum()), int((states == READY).sum()),
                             int((states == READING).sum()), int(h[H_ACQUIRES]), int(h[H_RELEASES]),
                             int(h[H_HIGH_WATER]), int(h[H_BLOCKED_NS]), int(h[H_BLOCKED_N]),
                             int(h[H_RECLAIMED]))

    def free_count(self) -> int:
        return self.stats().free

    def used_count(self) -> int:
        return self.stats().in_use

    def check(self) -> None:
        """Invariants: free list and slot states agree, every slot is counted once."""
        with self._locked():
            n, head = int(self._h[H_NFREE]), int(self._h[H_HEAD])
            listed = [int(self._fifo[(head + i) % self.spec.slots]) for i in range(n)]
            free = [s for s in range(self.spec.slots) if self._rec[s, R_STATE] == FREE]
            if sorted(listed) != free or len(set(listed)) != n:
                raise HarnessError(f"frame ring free list {listed} disagrees with free slots {free}")

    # ---- lifetime --------------------------------------------------------------------------
    def unlink(self) -> None:
        """Remove the segments' names (owner): memory is returned once the last mapping goes."""
        if self.owner:
            self._finalizer()

    def close(self) -> None:
        """Owner: mark closed (blocked producers get RingClosed), unlink, unmap. Attacher: unmap.
        A numpy view still alive keeps its mapping until it is garbage; the names are gone."""
        if self._closed:
            return
        if self.owner and os.getpid() == self._pid:
            self._h[H_CLOSED] = 1
            self.unlink()
        self._closed = True
        self._h = self._fifo = self._rec = None
        self._data.unmap()
        self._ctl.unmap()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()

    def __reduce__(self):
        raise TypeError("pass FrameRing.spec to other processes and FrameRing.attach(spec) there")
