"""``serve --launcher ray`` on a two-node Ray cluster started by this module on one machine
(``ray.cluster_utils.Cluster``: the driver's head node at 127.0.0.1 with 1 CPU, a second node at
127.0.0.2 with 3; fractional bundles; both are loopback): the same run directory, media and
ordering as the local launcher and byte-identical outputs with ranks on both nodes, the frame
path chosen by placement (shared-memory ring when VAE rank 0 sits with the encoder on the
driver's node, the socket channel when it does not), a killed rank named within a bounded time,
and nothing left behind — no actor, no placement group, no shared memory, and after shutdown no
Ray process.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

# Before ray is imported: keep every Ray and harness socket on loopback (Ray otherwise advertises
# the host's routable address), no token auth on a throwaway local cluster, no usage reporting.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'harness[ray]')")

from harness.config import load_preset, override  # noqa: E402
from harness.drivers.launcher import RankFailed  # noqa: E402
from harness.errors import HarnessError  # noqa: E402
from harness.drivers.procwatch import alive, descendants, wait_gone  # noqa: E402
from harness.drivers.ray_launcher import DEATH_REPORT_S, PEER_FIRST_WAIT_S  # noqa: E402
from harness.drivers.serve_run import ServeOptions, serve  # noqa: E402
from harness.measure.events import BOUNDARIES, read_events, validate_events  # noqa: E402
from harness.measure.gates import gate  # noqa: E402
from harness.pipeline.decode import decode_pyav  # noqa: E402
from harness.pipeline.ring import leftover_segments  # noqa: E402

from helpers.presets import tiny  # noqa: E402
from helpers.procs import run_segments  # noqa: E402

HEAD, OTHER = "127.0.0.1", "127.0.0.2"
CPUS = {HEAD: 1, OTHER: 3}  # logical CPUs (the machine has 2 cores)
RAY = {"cpus_per_rank": 0.25}  # encoder + VAE rank 0 fit on the head (pinned there), the rest spill over


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    # Before the cluster starts, so the reference does not share the 2 cores with Ray's daemons.
    return serve(tiny(sessions=2), ServeOptions(out=str(tmp_path_factory.mktemp("local")), progress=False))


@pytest.fixture(scope="module")
def ray_cluster(local_run):
    from ray.cluster_utils import Cluster

    small = {"object_store_memory": 100 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": CPUS[HEAD], "node_ip_address": HEAD,
                                                            "include_dashboard": False, **small})
    try:
        cluster.add_node(num_cpus=CPUS[OTHER], node_ip_address=OTHER, **small)
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        daemons = _ray_processes(os.getpid())
        ray.shutdown()
        cluster.shutdown()
        assert daemons, "no Ray process found under this one: the leak check below would prove nothing"
        assert wait_gone(daemons, 30) == [], "Ray processes outlived the cluster's shutdown"


@pytest.fixture(scope="module")
def ray_run(ray_cluster, tmp_path_factory):
    return serve(tiny(sessions=2), ServeOptions(out=str(tmp_path_factory.mktemp("ray")), progress=False,
                                                launcher="ray", launcher_options=dict(RAY)))


def test_ray_run_directory_media_and_ordering(ray_run):
    d = ray_run.run_dir
    man = json.loads((d / "manifest.json").read_text())
    assert man["status"] == "complete" and json.loads((d / "summary.json").read_text())["status"] == "complete"
    nodes = {name: r["node"] for name, r in man["launcher"]["ranks"].items()}
    assert man["launcher"]["name"] == "ray" and man["launcher"]["frame_path"] == "ring"
    assert nodes["encoder"] == nodes["vae rank 0"] == HEAD  # pinned with the driver: frames in shared memory
    assert OTHER in nodes.values()  # the head cannot hold all five: torch.distributed spans both nodes
    assert man["placement"] == {name: f"cpu@{ip}" for name, ip in nodes.items()}
    _check_sessions(d, ray_run.sessions, chunks=load_preset("tiny").video.chunks_per_session)
    assert len(list((d / "outputs").rglob("*.npy"))) == 40


def test_ray_outputs_are_byte_identical_to_the_local_launcher(local_run, ray_run):
    res = gate(local_run.run_dir, ray_run.run_dir, "exact")
    assert res.passed, res.verdict
    a, b = (r.run_dir / "outputs" / "hashes.jsonl" for r in (local_run, ray_run))
    assert a.read_text() == b.read_text()
    assert (local_run.run_dir / "frames.jsonl").read_text() == (ray_run.run_dir / "frames.jsonl").read_text()


def test_ray_run_leaves_no_actor_behind(ray_run):
    assert len(ray_run.pids) == 5  # 2 DiT + 2 VAE + encoder actors, all on this host
    assert wait_gone(ray_run.pids, 10) == []
    assert leftover_segments(ray_run.ring_prefix) == []
    assert _resources_back()


def test_vae_rank_0_on_another_node_sends_frames_over_the_socket(local_run, ray_cluster, tmp_path):
    """0.6 CPU per rank: VAE rank 0 no longer fits on the head beside the encoder, so it runs on the
    other node, and frames go VAE rank 0's own ring → TCP → the driver node's ring."""
    n = 4
    res = serve(tiny(sessions=2, chunks=n), ServeOptions(out=str(tmp_path), progress=False, launcher="ray",
                                                         launcher_options={"cpus_per_rank": 0.6}))
    man = json.loads((tmp_path / "manifest.json").read_text())
    ranks = man["launcher"]["ranks"]
    assert man["status"] == "complete" and man["launcher"]["frame_path"] == "socket"
    assert ranks["encoder"]["node"] == HEAD and ranks["vae rank 0"]["node"] == OTHER
    assert man["launcher"]["rendezvous"].startswith(ranks["dit rank 0"]["node"] + ":")
    _check_sessions(tmp_path, res.sessions, chunks=n)
    # The session's first chunks are the same computation as the full-length reference's.
    ref = {(h["epoch"], h["chunk"]): h for h in _jsonl(local_run.run_dir / "outputs" / "hashes.jsonl")}
    got = _jsonl(tmp_path / "outputs" / "hashes.jsonl")
    assert len(got) == 2 * n and all(h == ref[(h["epoch"], h["chunk"])] for h in got)
    for p in (tmp_path / "outputs").rglob("*.npy"):
        assert np.array_equal(np.load(p), np.load(local_run.run_dir / p.relative_to(tmp_path)))
    assert wait_gone(res.pids, 10) == [] and leftover_segments(res.ring_prefix) == []
    assert _resources_back()


def test_a_killed_actor_is_named_within_bounds_and_nothing_is_left(ray_cluster, tmp_path):
    cfg = tiny(sessions=1, chunks=5)
    seen: dict = {}

    def runner(ctx):
        pids = ctx.launcher.pids()
        seen["pids"] = pids
        stop = threading.Event()

        def watch():  # the moment the first actor process disappears
            while not stop.is_set() and "death" not in seen:
                if any(not alive(p) for p in pids):
                    seen["death"] = time.monotonic()
                time.sleep(0.005)

        th = threading.Thread(target=watch, daemon=True)
        th.start()
        try:
            ctx.add_result(ctx.driver.run_session(session=0, epoch=0, seed=cfg.runtime.seed, chunks=5))
        except RankFailed:
            seen["raised"] = time.monotonic()
            raise
        finally:
            stop.set()
            th.join()
            if "death" not in seen and "raised" in seen:
                # The driver may name the rank from its closed socket before the kernel has finished
                # tearing the killed process down (or before this 5 ms watcher looked): then the
                # naming came first, and the process must still be gone within a bounded time.
                deadline = time.monotonic() + 10
                while all(alive(p) for p in pids) and time.monotonic() < deadline:
                    time.sleep(0.005)
                if any(not alive(p) for p in pids):
                    seen["death"] = seen["raised"]
            elif seen.get("death", 0) > seen.get("raised", float("inf")):
                seen["death"] = seen["raised"]  # the watcher looked once more after the driver named it

    with pytest.raises(RankFailed, match=r"^vae rank 1 \(pid \d+ on [\d.]+\) died: ") as err:
        serve(cfg, ServeOptions(out=str(tmp_path), progress=False, probes=False, launcher="ray",
                                launcher_options=dict(RAY), faults={"vae:1": "die-at-chunk:3"}, session_runner=runner))
    teardown_s = time.monotonic() - seen["raised"]
    # named within the launcher's own bound for naming a death (plus scheduling slack)
    assert "death" in seen and 0 <= seen["raised"] - seen["death"] < DEATH_REPORT_S + PEER_FIRST_WAIT_S + 2.0, seen
    # Teardown after the naming is bounded; the run before the fault (Ray start, 3 chunks) is not a
    # claim of this test: its ranks run at Ray's worker niceness and a busy box can starve them.
    assert teardown_s < 30
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["status"] == "failed" and man["error"].startswith("RankFailed: vae rank 1 ") and "died" in str(err.value)
    events = read_events(tmp_path / "events.jsonl")
    assert len(events) >= 1 and validate_events(events) == []
    assert wait_gone(seen["pids"], 10) == []
    assert not run_segments(os.getpid())
    assert _resources_back()


def test_cli_maps_the_ray_options():
    from harness.cli import build_parser
    from harness.drivers.config_options import launcher_options

    args = build_parser().parse_args(["serve", "--launcher", "ray", "--ray-address", "10.0.0.1:6379",
                                      "--ray-frame-path", "socket", "--ray-cpus-per-rank", "0.5"])
    assert launcher_options(args) == {"launcher": "ray", "launcher_options": {
        "address": "10.0.0.1:6379", "frame_path": "socket", "cpus_per_rank": 0.5}}
    assert launcher_options(build_parser().parse_args(["serve"])) == {"launcher": "local"}


# ---- helpers ------------------------------------------------------------------------------------
def _check_sessions(run_dir: Path, sessions, chunks: int) -> None:
    """What tests/drivers/test_serve.py checks of a local run: frames per chunk, media decoding to exactly the saved
    (or hashed) pixels, every boundary present, ordered, FIFO per session."""
    cfg = load_preset("tiny")
    hashes = _jsonl(run_dir / "outputs" / "hashes.jsonl")
    for s in sessions:
        assert [e.frames for e in s.events] == [9] + [12] * (chunks - 1)
        decoded = decode_pyav(run_dir / "media" / f"session{s.start.session}.mkv").frames
        assert decoded.shape == (9 + 12 * (chunks - 1), cfg.video.height, cfg.video.width, 3)
        start = 0
        for c, e in enumerate(s.events):
            digest = hashlib.sha256(decoded[start:start + e.frames].tobytes()).hexdigest()
            assert digest == next(h["pixels_sha256"] for h in hashes if (h["epoch"], h["chunk"]) == (s.start.epoch, c))
            pix = run_dir / "outputs" / f"epoch{s.start.epoch}" / f"chunk{c:02d}.pixels.npy"
            if pix.exists():
                np.testing.assert_array_equal(decoded[start:start + e.frames], np.load(pix))
            start += e.frames
    events = read_events(run_dir / "events.jsonl")
    assert len(events) == len(sessions) * chunks and validate_events(events) == []
    for e in events:
        assert list(e.present()) == list(BOUNDARIES), (e.session, e.chunk)


def _resources_back(timeout: float = 15.0) -> bool:
    """Every CPU free again and no placement-group resource left: no actor and no bundle holds anything."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        avail = ray.available_resources()
        if avail.get("CPU", 0) >= sum(CPUS.values()) - 1e-6 and not any("_group_" in k for k in avail):
            return True
        time.sleep(0.1)
    return False


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _ray_processes(root: int) -> list[int]:
    """Ray's daemons and workers under ``root`` (not, e.g., multiprocessing's resource tracker)."""
    out = []
    for pid in descendants(root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"/ray/" in cmd or cmd.startswith(b"ray::"):
            out.append(pid)
    return out


def test_gpu_plan_pairs_dit_and_vae_ranks_on_one_gpu_bundle():
    from harness.drivers.ray_launcher import _plan

    cuda = override(load_preset("tiny"), runtime={"device": "cuda"})
    bundles, plan = _plan(cuda, 1.0)
    assert bundles == [{"GPU": 1.0, "CPU": 2.0}, {"GPU": 1.0, "CPU": 2.0}, {"CPU": 1.0}]
    assert [(r, k, b, g) for r, k, b, _, g in plan] == [("dit", 0, 0, 0.5), ("vae", 0, 0, 0.5), ("dit", 1, 1, 0.5),
                                                        ("vae", 1, 1, 0.5), ("encoder", 0, 2, 0.0)]
    apart = override(cuda, parallel={"dit_devices": (0, 1), "vae_devices": (2, 3)})
    bundles, plan = _plan(apart, 1.0)
    assert bundles[:4] == [{"GPU": 1.0, "CPU": 1.0}] * 4 and all(g == 1.0 for *_, g in plan[:4])


def test_a_placement_the_cluster_cannot_hold_fails_at_once(ray_cluster, tmp_path):
    cfg = override(load_preset("tiny"), runtime={"device": "cuda", "sessions": 1})
    t0 = time.monotonic()
    with pytest.raises(HarnessError, match=r"needs 2 GPU .* has 0"):
        serve(cfg, ServeOptions(out=str(tmp_path), progress=False, probes=False, launcher="ray", launcher_options=dict(RAY)))
    assert time.monotonic() - t0 < 30
    assert json.loads((tmp_path / "manifest.json").read_text())["status"] == "failed"
    assert _resources_back()
