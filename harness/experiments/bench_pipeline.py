"""Micro-benchmarks of the pipeline primitives (not tests):

    python -m harness bench-pipeline ring   [--height 480 --width 832 --frames 12 --chunks 60 --slots 4]
    python -m harness bench-pipeline encode [--sizes 480x832,704x1280 --backends pyav,ffmpeg --threads 2]
    python -m harness bench-pipeline channel [--height 480 --width 832 --frames 12 --chunks 60 --slots 4 --host 127.0.0.1]

``ring``: one process writes (T, H, W, 3) uint8 chunks into the ring, another claims and reads
every byte (a copy out, as an encoder's first pass would), slot refs travel over a typed
ProcessQueue. ``encode``: FFV1 time per chunk into a null sink, on synthetic frames that look
like decoded video rather than noise: moving colour gradients plus Gaussian noise (σ = 3).
``channel``: the Ray launcher's cross-host frame path on one host: a producer process fills its
own ring, a ``RingSender`` ships each chunk over TCP to a ``RingReceiver`` that fills the
consumer's ring, the consumer claims and reads every byte (the ``ring`` figures plus the socket).
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import statistics
import time

import msgspec
import numpy as np

from harness.pipeline.channel import Listener, RingReceiver, RingSender, connect
from harness.pipeline.encoder import make_encoder
from harness.pipeline.queues import ProcessQueue
from harness.pipeline.ring import FrameRing, RingSpec, SlotRef, leftover_segments
from harness.pipeline.sinks import NullSink


def synthetic_chunk(frames: int, height: int, width: int, seed: int = 0, start: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    out = np.empty((frames, height, width, 3), np.uint8)
    for t in range(frames):
        p = (start + t) / 16
        r = 128 + 100 * np.sin(2 * np.pi * (x + 0.3 * y + 0.05 * p))
        g = 128 + 100 * np.sin(2 * np.pi * (0.7 * y - 0.2 * x + 0.08 * p))
        b = 128 + 90 * np.cos(2 * np.pi * (x * y + 0.03 * p))
        img = np.stack(np.broadcast_arrays(r, g, b), -1) + rng.normal(0, 3, (height, width, 3))
        out[t] = np.clip(img, 0, 255).astype(np.uint8)
    return out


def _ring_producer(spec_bytes: bytes, q: ProcessQueue, shape, chunks: int, times: ProcessQueue) -> None:
    ring = FrameRing.attach(msgspec.msgpack.decode(spec_bytes, type=RingSpec))
    src = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    copy_ns = []
    for i in range(chunks):
        ref = ring.acquire(chunk=i)
        t0 = time.perf_counter_ns()
        np.copyto(ring.buffer(ref, shape), src)
        copy_ns.append(time.perf_counter_ns() - t0)
        q.put(ring.publish(ref, shape))
    times.put((copy_ns, ring.blocked_ns))
    ring.close()


def bench_ring(height: int, width: int, frames: int, chunks: int, slots: int) -> dict:
    shape = (frames, height, width, 3)
    nbytes = int(np.prod(shape))
    ctx = mp.get_context("spawn")
    prefix = "harness-bench-ring"
    ring = FrameRing.create(prefix, slots, nbytes)
    dst = np.empty(shape, np.uint8)
    try:
        q = ProcessQueue(chunks + 1, type=SlotRef, ctx=ctx)
        times = ProcessQueue(1, ctx=ctx)
        p = ctx.Process(target=_ring_producer, args=(msgspec.msgpack.encode(ring.spec), q, shape, chunks, times))
        p.start()
        read_ns, t_first = [], None
        for _ in range(chunks):
            ref = q.get(timeout=60)
            t_first = t_first or time.perf_counter_ns()
            view = ring.claim(ref)
            t0 = time.perf_counter_ns()
            np.copyto(dst, view)
            read_ns.append(time.perf_counter_ns() - t0)
            del view
            ring.release(ref)
        wall = time.perf_counter_ns() - t_first
        copy_ns, blocked = times.get(timeout=60)
        p.join(60)
        stats = ring.stats()
    finally:
        ring.close()
    src = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    t0 = time.perf_counter_ns()
    for _ in range(10):
        np.copyto(dst, src)
    local = (time.perf_counter_ns() - t0) / 10
    skip = min(3, chunks // 4)  # first chunks touch cold caches/TLB
    med = lambda v: statistics.median(v[skip:])  # noqa: E731
    return {
        "chunk_bytes": nbytes, "chunks": chunks, "slots": slots,
        "write_GBps": nbytes / med(copy_ns), "read_GBps": nbytes / med(read_ns),
        "end_to_end_GBps": nbytes * (chunks - 1) / wall, "end_to_end_chunks_per_s": (chunks - 1) / wall * 1e9,
        "write_ms": med(copy_ns) / 1e6, "read_ms": med(read_ns) / 1e6,
        "local_memcpy_GBps": nbytes / local, "producer_blocked_ms": blocked / 1e6,
        "high_water": stats.high_water, "leftover": leftover_segments(prefix),
    }


def _channel_producer(prefix: str, slots: int, shape, chunks: int, address, token: str, times: ProcessQueue) -> None:
    ring = FrameRing.create(prefix + "-tx", slots, int(np.prod(shape)))
    conn, _ = connect(address, token)
    sender = RingSender(ring, conn)
    src = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    for i in range(chunks):
        ref = ring.acquire(chunk=i)
        np.copyto(ring.buffer(ref, shape), src)
        sender.submit(ring.publish(ref, shape))
    sender.drain(120)
    times.put((ring.blocked_ns, sender.send_ns))
    sender.close()
    ring.close()


def bench_channel(height: int, width: int, frames: int, chunks: int, slots: int, host: str = "127.0.0.1") -> dict:
    shape = (frames, height, width, 3)
    nbytes = int(np.prod(shape))
    ctx = mp.get_context("spawn")
    prefix = "harness-bench-channel"
    token = secrets.token_hex(8)
    ring = FrameRing.create(prefix, slots, nbytes)
    listener = Listener(host, token)
    dst = np.empty(shape, np.uint8)
    try:
        times = ProcessQueue(1, ctx=ctx)
        p = ctx.Process(target=_channel_producer, args=(prefix, slots, shape, chunks, listener.address, token, times))
        p.start()
        got = None
        while got is None:
            got = listener.accept(timeout=60)
        rx = RingReceiver(ring, got[0])
        arrive, t_first = [], None
        for i in range(chunks):
            ref = rx.take_next(60)
            assert ref.chunk == i, (ref.chunk, i)
            t = time.perf_counter_ns()
            t_first = t_first or t
            arrive.append(t)
            view = ring.claim(ref)
            np.copyto(dst, view)
            del view
            ring.release(ref)
        wall = time.perf_counter_ns() - t_first
        blocked, send_ns = times.get(timeout=60)
        p.join(60)
        rx.close()
    finally:
        listener.close()
        ring.close()
    gaps = np.diff(arrive)
    return {
        "chunk_bytes": nbytes, "chunks": chunks, "slots": slots, "host": host,
        "end_to_end_GBps": nbytes * (chunks - 1) / wall, "end_to_end_chunks_per_s": (chunks - 1) / wall * 1e9,
        "ms_per_chunk_median": float(np.median(gaps)) / 1e6, "producer_send_ms_per_chunk": send_ns / chunks / 1e6,
        "producer_blocked_ms": blocked / 1e6, "leftover": leftover_segments(prefix),
    }


def bench_encode(backend: str, height: int, width: int, threads: int, chunks: int, frames: int = 12) -> dict:
    data = [synthetic_chunk(frames, height, width, seed=i, start=i * frames) for i in range(chunks)]
    enc = make_encoder(backend, width, height, fps=16, threads=threads)
    sink = NullSink()
    enc.open(sink)
    per_call = []
    t0 = time.perf_counter_ns()
    for i, c in enumerate(data):
        t = time.perf_counter_ns()
        enc.encode(c, chunk=i)
        per_call.append(time.perf_counter_ns() - t)
    enc.close()
    total = time.perf_counter_ns() - t0
    raw = chunks * frames * height * width * 3
    return {"backend": backend, "size": f"{height}x{width}", "threads": threads, "chunks": chunks,
            "ms_per_chunk_median_call": statistics.median(per_call[1:]) / 1e6,
            "ms_per_chunk_throughput": total / chunks / 1e6,
            "MB_per_chunk": sink.bytes_written / chunks / 1e6, "compression": raw / sink.bytes_written}


def add_arguments(ap) -> None:
    """``bench-pipeline {ring,channel,encode}``: the transport primitives alone, one JSON line per result."""
    sub = ap.add_subparsers(dest="what", required=True)
    r, c = sub.add_parser("ring", help="shared-memory frame ring"), sub.add_parser("channel", help="frame socket channel")
    for p in (r, c):
        p.add_argument("--height", type=int, default=480)
        p.add_argument("--width", type=int, default=832)
        p.add_argument("--frames", type=int, default=12)
        p.add_argument("--chunks", type=int, default=60)
        p.add_argument("--slots", type=int, default=4)
    c.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    e = sub.add_parser("encode", help="FFV1 encoders")
    e.add_argument("--sizes", default="480x832,704x1280")
    e.add_argument("--backends", default="pyav,ffmpeg")
    e.add_argument("--threads", default="2", help="comma-separated thread counts")
    e.add_argument("--chunks", type=int, default=4)


def main(a) -> int:
    if a.what == "ring":
        print(msgspec.json.encode(bench_ring(a.height, a.width, a.frames, a.chunks, a.slots)).decode())
    elif a.what == "channel":
        print(msgspec.json.encode(bench_channel(a.height, a.width, a.frames, a.chunks, a.slots, a.host)).decode())
    else:
        for size in a.sizes.split(","):
            h, w = map(int, size.split("x"))
            for backend in a.backends.split(","):
                for threads in map(int, a.threads.split(",")):
                    print(msgspec.json.encode(bench_encode(backend, h, w, threads, a.chunks)).decode(), flush=True)
    return 0
