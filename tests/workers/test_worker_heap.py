"""A rank's host memory between sessions (harness.workers.heap): the freed heap goes back to the
kernel at every session's end, before the lead's reply, the session leaves no record in the rank,
and torch.distributed's flight recorder keeps no record of the collectives."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap

import pytest

from harness.config import load_preset
from harness.drivers.procwatch import rss_bytes
from harness.pipeline import messages as M
from harness.workers import common, dit_worker, heap, vae_worker

needs_trim = pytest.mark.skipif(heap._TRIM is None, reason="no malloc_trim in this libc")


@needs_trim
def test_trim_heap_gives_the_freed_heap_back_to_the_kernel():
    """40 MiB of small blocks, touched, then freed under one block still held (so free() itself
    cannot shrink the heap from the top): resident until trim_heap, gone after it."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, n = 4096, 10240
    blocks = [libc.malloc(size) for _ in range(n)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks[:-1]:
        libc.free(b)
    held = rss_bytes(os.getpid())
    assert heap.trim_heap()
    after = rss_bytes(os.getpid())
    libc.free(blocks[-1])
    assert held - after > 30 * 2**20, (held, after)


class _Engine:
    """The session API of a DiT or VAE engine, without the model."""

    def __init__(self):
        self.open = 0

    def start_session(self, *_):
        self.open += 1
        return object()

    def end_session(self, _):
        self.open -= 1

    def kv_stats(self):
        return {"sessions": self.open}


class _Logged:
    """The rank's end of its pipe, noting each reply it sends in ``log``."""

    def __init__(self, conn, log: list):
        self.conn, self.log = conn, log

    def recv_bytes(self):
        return self.conn.recv_bytes()

    def send_bytes(self, raw):
        self.log.append(("reply", len(raw)))
        self.conn.send_bytes(raw)


def _drive(role: str, monkeypatch) -> tuple[list, list, dict]:
    """Three sessions started and ended through a lead rank's real loop. Returns what happened in
    order (each trim with the sessions the rank still held), the replies, and the rank's
    per-session records afterwards."""
    ours, theirs = mp.Pipe(duplex=True)
    sessions, epochs, engine, log = {}, {}, _Engine(), []
    monkeypatch.setattr(common, "trim_heap", lambda: log.append(("trim", len(sessions))))
    for i in range(3):
        M.send(ours, M.StartSession(session=i, epoch=i, seed=i, prompt="", image=None))
    for i in range(3):
        M.send(ours, M.EndSession(session=i))
    M.send(ours, M.Shutdown())
    conn = _Logged(theirs, log)
    if role == "dit":
        dit_worker._loop(None, conn, engine, sessions, epochs, None, True, load_preset("tiny"), None)
    else:
        vae_worker._loop(None, conn, None, engine, None, sessions, None, True, None)
    replies = []
    while ours.poll():
        replies.append(M.recv(ours))
    return log, replies, {"sessions": sessions, "epochs": epochs, "engine": engine.open}


@pytest.mark.parametrize("role", ["dit", "vae"])
def test_every_session_end_trims_the_heap_before_the_lead_replies(role, monkeypatch):
    log, replies, left = _drive(role, monkeypatch)
    # each trim comes once that session is gone from the rank, and before its reply
    assert [e[0] for e in log] == ["trim", "reply"] * 3
    assert [n for what, n in log if what == "trim"] == [2, 1, 0]
    assert [(type(r).__name__, r.session) for r in replies] == [("SessionEnded", i) for i in range(3)]
    assert left == {"sessions": {}, "epochs": {}, "engine": 0}


_FR_PROBE = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    from harness.workers.heap import flight_recorder_off
    os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
    if sys.argv[1] != "-":
        os.environ["TORCH_FR_BUFFER_SIZE"] = sys.argv[1]
    flight_recorder_off()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    x = torch.ones(8)
    for _ in range(20):
        dist.all_reduce(x)
    entries = json.loads(torch._C._distributed_c10d._dump_fr_trace_json()).get("entries", [])
    dist.destroy_process_group()
    print(len(entries))
""")


@pytest.mark.parametrize("operator_size, recorded", [("-", 0), ("100", 20)])
def test_the_flight_recorder_is_off_unless_the_operator_sized_it(operator_size, recorded):
    out = subprocess.run([sys.executable, "-c", _FR_PROBE, operator_size], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == recorded
