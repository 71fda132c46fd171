"""slow-consumer: throttled sessions between unthrottled ones of the same seeds. Every frame
arrives exactly once and in order, the ring and resident memory stay bounded, the producer's
blocked time is recorded, and full rate returns once the consumer catches up."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

from harness.drivers.procwatch import RssSampler
from harness.experiments.scenario import session_figures as F
from harness.experiments.scenario.session_figures import MS
from harness.experiments.scenario.params import Params
from harness.experiments.scenario.findings import Report
from harness.experiments.scenario.server_process import ServerProcess
from harness.experiments.scenario.topology import Bench, prompt_for
from harness.measure.events import read_events
from harness.serving.client import ViewerOptions, run_session, status

BLOCKED_KINDS = ("ring", "sink", "client")


def _slow_plan(p: Params) -> list[tuple[str, int, bool]]:
    """(role, seed, throttled). Every seed of a throttled session also runs unthrottled: the
    reference first, the recovery last."""
    slow = [("slow", p.seed + (i % 2), True) for i in range(p.slow_sessions)]
    last_seed = slow[-1][1] if slow else p.seed
    return [("reference", p.seed, False)] + slow + [("restored", last_seed, False)]


def consumer_fps(rate: float, reference_fps: float | None, nominal_fps: float) -> float:
    """The throttled consumer's frame rate: ``rate`` × the rate the unthrottled reference session
    was delivered at on this machine (DESIGN §7: a fraction of the production rate), so that the
    consumer is the bottleneck however fast or slow the machine generates; ``rate`` × the nominal
    rate when the reference was too short to measure."""
    return rate * (reference_fps or nominal_fps)


def _check_delivery(report: Report, sessions: list[dict], slow: list[dict]) -> None:
    refs = {s["seed"]: s for s in sessions if s["role"] != "slow"}
    bad = []
    for s in sessions:
        want = refs[s["seed"]]["frame_sha256"]
        if s["frame_sha256"] != want or s["decoded"] != want:
            bad.append(f"session {s['session']} ({s['role']}): {len(s['decoded'])} decoded / {len(want)} expected frames differ")
        if len(want) != s["expected_frames"]:
            bad.append(f"session {s['session']}: {len(want)} frames, expected {s['expected_frames']}")
    report.check("every frame delivered exactly once, in order", not bad and bool(slow),
                 "; ".join(bad) if bad else f"{len(slow)} throttled sessions match the unthrottled run of their seed, "
                 "hash for hash, in the hashes and in the decoded media")


def _check_bounded(report: Report, sessions: list[dict], slow: list[dict], p: Params) -> None:
    over = [f"session {s['session']}: {s['occupancy']} > {s['slots']}" for s in sessions if s["occupancy"] > s["slots"]]
    free = [f"session {s['session']}: {s['ring_free']} free of {s['slots']}" for s in sessions
            if s["ring_free"] is not None and s["ring_free"] != s["slots"]]
    report.check("ring occupancy bounded by its slots", not over and not free,
                 "; ".join(over + free) or f"peak {max(s['occupancy'] for s in sessions)} of {sessions[0]['slots']} slots, all free after each session")
    if slow and sessions[0]["peaks"] and all(s["peaks"] for s in slow):
        # A backlog held anywhere in the driver or the encoder would show as growth over the
        # unthrottled reference; bounded queues keep the throttled sessions at the same level.
        base = sessions[0]["peaks"]
        growth = {g: max(s["peaks"].get(g, 0) for s in slow) - base.get(g, 0) for g in base}
        worst = max(growth.values()) if growth else 0
        report.check("resident memory bounded", worst <= p.rss_slack_mib * (1 << 20),
                     ", ".join(f"{g} {base[g] / 2**20:.0f} MiB unthrottled, {growth[g] / 2**20:+.1f} MiB throttled"
                               for g in base) + f" (allowed +{p.rss_slack_mib:g} MiB)")
    else:
        report.notes.append("resident memory not sampled (the server's processes are not visible from here)")


def _check_blocked(report: Report, slow: list[dict], expect_ring_block: bool) -> None:
    unblocked = [s["session"] for s in slow if sum(s["blocked"].get(k, 0) for k in BLOCKED_KINDS if k != "sink") < 10 * MS
                 or (expect_ring_block and s["blocked"].get("ring", 0) <= 0)]
    report.check("producer blocked time recorded (≥ 10 ms per throttled session)", not unblocked,
                 f"throttled sessions {unblocked} show no blocked time"
                 + (" at the ring: too few chunks for the backlog to outgrow the ring (more --chunks or fewer --ring-slots)"
                    if expect_ring_block else "") if unblocked else
                 "; ".join(f"session {s['session']}: " + ", ".join(f"{k} {s['blocked'].get(k, 0) / 1e9:.2f} s" for k in BLOCKED_KINDS
                                                                      if s["blocked"].get(k)) for s in slow))


def _check_rates(report: Report, sessions: list[dict], slow: list[dict]) -> None:
    ref_p50 = F.p50(sessions[0]["intervals"])
    slow_p50 = F.p50([i for s in slow for i in s["intervals"]])
    rest_p50 = F.p50(sessions[-1]["intervals"])
    if None in (ref_p50, slow_p50, rest_p50):
        report.check("full rate restored when the consumer catches up", False, "sessions too short to measure intervals (need ≥ 3 chunks)")
        return
    report.check("the consumer was the bottleneck", slow_p50 >= 1.2 * ref_p50,
                 f"throttled delivery interval P50 {slow_p50 / MS:.0f} ms vs unthrottled {ref_p50 / MS:.0f} ms "
                 f"(consumer at {slow[0]['consumer_fps']:.1f} frames/s)" + ("" if slow_p50 >= 1.2 * ref_p50 else "; lower --rate"), rate=True)
    fast_enough = rest_p50 <= max(1.5 * ref_p50, ref_p50 + 150 * MS) and rest_p50 <= 0.85 * slow_p50
    report.check("full rate restored when the consumer catches up", fast_enough,
                 f"after the throttled sessions: P50 {rest_p50 / MS:.0f} ms (reference {ref_p50 / MS:.0f} ms, throttled {slow_p50 / MS:.0f} ms)",
                 rate=True)


def _judge_slow(report: Report, sessions: list[dict], p: Params, expect_ring_block: bool) -> None:
    """``sessions``: role, seed, frame_sha256, decoded (hashes of the media the consumer got),
    intervals (delivery, ns), fps, blocked (ns by kind), occupancy, slots, peaks (RSS bytes by group)."""
    slow = [s for s in sessions if s["role"] == "slow"]
    _check_delivery(report, sessions, slow)
    _check_bounded(report, sessions, slow, p)
    _check_blocked(report, slow, expect_ring_block)
    _check_rates(report, sessions, slow)


def _slow_rows(report: Report, sessions: list[dict]) -> None:
    report.header = ["session", "role", "seed", "consumer fps", "frames", "P50 interval ms", "delivered fps",
                     "blocked ring/sink/client s", "peak slots", "peak RSS MiB"]
    for s in sessions:
        report.rows.append([s["session"], s["role"], s["seed"], "-" if s["consumer_fps"] is None else f"{s['consumer_fps']:.1f}",
                            len(s["decoded"]), F.ms(F.p50(s["intervals"])), "-" if s["fps"] is None else f"{s['fps']:.1f}",
                            "/".join(f"{s['blocked'].get(k, 0) / 1e9:.2f}" for k in BLOCKED_KINDS),
                            f"{s['occupancy']}/{s['slots']}",
                            " ".join(f"{g}:{v / 2**20:.0f}" for g, v in s["peaks"].items()) or "-"])


def _conclude(report: Report, sessions: list[dict], rss: RssSampler, p: Params, expect_ring_block: bool) -> Report:
    for s in sessions:
        s["peaks"] = rss.peaks.get(s.pop("label"), {})
    _slow_rows(report, sessions)
    _judge_slow(report, sessions, p, expect_ring_block)
    return report.done()


def slow_consumer_inprocess(bench: Bench, p: Params) -> Report:
    report = Report("slow-consumer", "inprocess")
    vid = bench.cfg.video
    chunks = p.chunks or vid.chunks_per_session
    expected = sum(vid.pixel_frames(c) for c in range(chunks))
    groups = lambda: {"driver": [os.getpid()], "encoder": [bench.encoder_pid()]}  # noqa: E731
    sessions = []
    with RssSampler(groups) as rss:
        for role, seed, throttled in _slow_plan(p):
            label = f"{role}-{len(sessions)}"
            consumer = consumer_fps(p.rate, sessions[0]["fps"], vid.fps) if throttled else None
            rss.mark(label)
            res = bench.run(seed, chunks, sink=f"throttled:{consumer:g}" if consumer else "file")
            ev = res.events
            sessions.append(dict(
                session=res.start.session, role=role, seed=seed, consumer_fps=consumer, frame_sha256=res.frame_sha256,
                media=bench.ctx.run_dir / "media" / f"session{res.start.session}.mkv", expected_frames=expected,
                intervals=F.intervals([e.delivered for e in ev]), fps=F.rate([e.frames for e in ev], [e.delivered for e in ev]),
                blocked={k: F.blocked(ev, k) for k in ("ring", "sink")}, occupancy=F.occupancy(ev), slots=bench.ctx.ring_slots,
                ring_free=res.ring_free_after, label=label))
        rss.mark("end")
    for s in sessions:
        # decoded only now: decoding in this (the driver's) process would blur its RSS figures
        media = s.pop("media")
        s["decoded"] = F.decoded_hashes(media) if media.exists() else []
    return _conclude(report, sessions, rss, p, expect_ring_block=True)


def _server_side(report: Report, sessions: list[dict], server: ServerProcess | None) -> None:
    """Ring occupancy and blocked time from the events of a server launched here."""
    if server is None or not (server.out / "events.jsonl").exists():
        report.notes.append("ring occupancy from the server's events not available (not launched here)")
        return
    events = read_events(server.out / "events.jsonl")
    for s in sessions:
        mine = [e for e in events if e.session == s["session"]]
        s["occupancy"] = F.occupancy(mine)
        s["blocked"].update(ring=F.blocked(mine, "ring"), sink=F.blocked(mine, "sink"))


def slow_consumer_ws(url: str, p: Params, server: ServerProcess | None = None, preset: str | None = None) -> Report:
    report = Report("slow-consumer", "websocket")
    st = asyncio.run(status(url))  # also: the server answers before anything is measured
    preset = preset or st.preset
    files = Path(tempfile.mkdtemp(prefix="slow-", dir=p.workdir))
    groups = (lambda: {"server": [server.pid], "encoder": [server.encoder_pid()]}) if server else (lambda: {})  # noqa: E731
    sessions = []
    with RssSampler(groups) as rss:
        for role, seed, throttled in _slow_plan(p):
            label = f"{role}-{len(sessions)}"
            # the client's read rate is a multiple of the stream's nominal fps (the reference's header says it)
            ref = sessions[0] if throttled else None
            consumer = consumer_fps(p.rate, ref["fps"], ref["nominal_fps"]) if ref else None
            rss.mark(label)
            rep = asyncio.run(run_session(url, preset=preset, seed=seed, chunks=p.chunks, prompt=prompt_for(seed),
                                          opts=ViewerOptions(read_rate=consumer / ref["nominal_fps"] if ref else None, out_dir=files)))
            if rep.outcome != "complete" or rep.ended is None:
                report.check(f"session {len(sessions)} ({role}) completes", False, rep.error or rep.outcome)
                return report.done()
            end = rep.ended
            sessions.append(dict(
                session=rep.session, role=role, seed=seed, consumer_fps=consumer, nominal_fps=rep.started.fps,
                frame_sha256=rep.frame_sha256, decoded=F.decoded_hashes(rep.media_path),
                expected_frames=F.frames_expected(rep.started.latent_frames_per_chunk, end.chunks),
                intervals=F.intervals(rep.receipts_ns), fps=F.rate([h.frames for h in rep.headers], rep.receipts_ns),
                blocked={"client": end.client_blocked_ns}, occupancy=0, slots=end.ring_slots, ring_free=end.ring_free,
                label=label, max_unacked=end.max_unacked, window=rep.started.window))
        rss.mark("end")
    _server_side(report, sessions, server)
    over = [f"session {s['session']}: {s['max_unacked']} > {s['window']}" for s in sessions if s["max_unacked"] > s["window"]]
    report.check("chunks in flight to the client bounded by the window", not over,
                 "; ".join(over) or f"at most {max(s['max_unacked'] for s in sessions)} unacknowledged (window {sessions[0]['window']})")
    shutil.rmtree(files, ignore_errors=True)
    return _conclude(report, sessions, rss, p, expect_ring_block=False)
