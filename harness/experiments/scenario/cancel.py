"""cancel: sessions cancelled (or disconnected) at every point of the pipeline. The cancel takes
effect (a late one is a no-op), every KV block and ring slot is free afterwards, a cancelled
session's media is removed and a kept one is valid, and the next session is bit-identical to a
fresh run of its seed."""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness.drivers.driver import SessionControl
from harness.experiments.scenario.session_figures import MS, decoded_hashes
from harness.experiments.scenario.params import Params
from harness.experiments.scenario.points import CancelPoint, Trigger, WsCancelPoint, cancel_points, where, ws_cancel_points
from harness.experiments.scenario.findings import Report
from harness.experiments.scenario.server_process import ServerProcess
from harness.experiments.scenario.topology import Bench, prompt_for
from harness.serving.client import ViewerOptions, run_session, status, verify_media


@dataclass
class Reference:
    """A complete session of the base seed: what every verification session must reproduce."""

    session: int
    pairs: list[tuple[str, str]]  # (latent, pixels) SHA-256 per chunk
    frames: list[str]  # SHA-256 per frame
    per_chunk: list[int]  # frames per chunk

    def matches(self, pairs: list[tuple[str, str]], frames: list[str], chunks: int) -> bool:
        return pairs == self.pairs[:chunks] and frames == self.frames[:sum(self.per_chunk[:chunks])]


def _problems(*kinds: str) -> dict[str, list[str]]:
    return {k: [] for k in (*kinds, "kv", "ring", "media", "next")}


def _state_checks(report: Report, problems: dict[str, list[str]], media_check: str, verified: int, same_as: str) -> None:
    """The checks both transports make after every point has run."""
    report.check_none("all KV blocks free after every session", problems["kv"])
    report.check_none("all ring slots free after every session", problems["ring"])
    report.check_none(media_check, problems["media"])
    report.check_none("the next session is bit-identical to a fresh run", problems["next"],
                      f"{verified} verification sessions{same_as}", also=verified > 0)


# ---- in process ----------------------------------------------------------------------------------
def _reference_inprocess(bench: Bench, p: Params, report: Report) -> tuple[Reference, list[CancelPoint]]:
    """Run the reference session and aim the cancel points with its timings."""
    n, v = p.cancel_chunks, p.verify_chunks
    ref = bench.run(p.seed, max(n, v))
    fwd = statistics.median((e.dit_end - e.dit_start) / 5 for e in ref.events)
    dec = statistics.median(e.decode_end - e.decode_start for e in ref.events)
    lag = statistics.median(e.dit_start - e.submit for e in ref.events)
    report.notes.append(f"reference session {ref.start.session} (seed {p.seed}, {len(ref.events)} chunks): submit → DiT start "
                        f"≈ {lag / MS:.1f} ms, DiT forward ≈ {fwd / MS:.1f} ms, decode ≈ {dec / MS:.0f} ms per chunk "
                        "(cancel points aim with these; 'fired in' is where each landed)")
    reference = Reference(ref.start.session, [(h["latent_sha256"], h["pixels_sha256"]) for h in ref.chunk_hashes],
                          ref.frame_sha256, [e.frames for e in ref.events])
    return reference, cancel_points(fwd, dec, n, bench.cfg.video.fps, lag)


def _media_inprocess(pt: CancelPoint, res, media_dir: Path, problems: list[str]) -> str:
    """What became of the session's media: removed when cancelled (unless kept by policy), else
    a file that decodes to exactly the delivered frames; never a ``.part`` left behind."""
    s = res.start.session
    mkv, part = media_dir / f"session{s}.mkv", media_dir / f"session{s}.mkv.part"
    media = "-"
    if part.exists():
        problems.append(f"{pt.name}: {part.name} left behind")
    if res.cancelled and not pt.keep_partial:
        media = "removed" if not mkv.exists() and res.media is not None and res.media.discarded else "KEPT"
        if media != "removed":
            problems.append(f"{pt.name}: cancelled session's media not removed")
    elif mkv.exists():
        got = decoded_hashes(mkv)
        media = f"{len(got)} frames"
        if got != res.frame_sha256:
            problems.append(f"{pt.name}: {mkv.name} does not decode to the {len(res.frame_sha256)} delivered frames")
    else:
        problems.append(f"{pt.name}: no media for a kept/complete session")
    return media


def _verify_inprocess(bench: Bench, p: Params, ref: Reference, pt: CancelPoint, problems: dict[str, list[str]]) -> str:
    v = p.verify_chunks
    chk = bench.run(p.seed, v)
    same = ref.matches([(h["latent_sha256"], h["pixels_sha256"]) for h in chk.chunk_hashes], chk.frame_sha256, v)
    if not same:
        problems["next"].append(f"after {pt.name}")
    if chk.kv_after.get("blocks_used") != 0 or chk.ring_free_after != bench.ctx.ring_slots:
        problems["kv"].append(f"verification after {pt.name} left state behind")
    return "identical" if same else "DIFFERS"


def _point_inprocess(bench: Bench, p: Params, i: int, pt: CancelPoint, ref: Reference, problems: dict[str, list[str]]) -> list:
    """Run one cancelled session (then, if the point asks, a verification session); its table row."""
    slots = bench.ctx.ring_slots
    trig = Trigger(pt.when)
    res = bench.run(p.seed + 1 + i, p.cancel_chunks, sink=pt.sink, scheduler=pt.scheduler,
                    control=SessionControl(should_cancel=trig, keep_partial_media=pt.keep_partial))
    encoded = sum(1 for e in res.events if e.encoded is not None)
    kv = res.kv_after.get("blocks_used")
    if res.cancelled != pt.expect_cancelled:
        problems["cancelled"].append(f"{pt.name}: cancelled={res.cancelled}")
    if kv != 0:
        problems["kv"].append(f"{pt.name}: {kv} blocks used")
    if res.ring_free_after != slots:
        problems["ring"].append(f"{pt.name}: {res.ring_free_after} of {slots} free")
    media = _media_inprocess(pt, res, bench.ctx.run_dir / "media", problems["media"])
    nxt = _verify_inprocess(bench, p, ref, pt, problems) if pt.verify else "-"
    return [i + 1, pt.name, pt.target, where(trig.fired_ns, res.events, res.start.start_ns),
            "yes" if res.cancelled else "no", f"{len(res.events)}/{encoded}", kv, f"{res.ring_free_after}/{slots}", media, nxt]


def cancel_inprocess(bench: Bench, p: Params) -> Report:
    report = Report("cancel", "inprocess")
    ref, points = _reference_inprocess(bench, p, report)
    if p.points:
        unknown = sorted(set(p.points) - {c.name for c in points})
        if unknown:
            report.check("known cancel points", False, f"unknown: {', '.join(unknown)}")
            return report
        points = [c for c in points if c.name in p.points]
    report.header = ["#", "point", "aimed at", "fired in", "cancelled", "chunks gen/enc", "KV used", "ring free", "media",
                     "next session"]
    problems = _problems("cancelled")
    report.rows = [_point_inprocess(bench, p, i, pt, ref, problems) for i, pt in enumerate(points)]
    report.check(f"{len(points)} distinct cancel points", len(points) >= 20 or bool(p.points),
                 "covering before the first chunk, mid-DiT between steps, mid-decode, mid-encode, between chunks, "
                 "after the last chunk, Case E overlap, a slow consumer, twice in a row")
    report.check_none("cancel takes effect (and is a no-op once the session is over)", problems["cancelled"])
    _state_checks(report, problems, "cancelled media removed, kept media valid", sum(pt.verify for pt in points),
                  f": latents, pixels and frame hashes equal reference session {ref.session}")
    return report.done()


# ---- over websocket ------------------------------------------------------------------------------
async def ended_of(url: str, rep, served_before: int, timeout_s: float = 60.0, token: str = ""):
    """The server's account of a session the client left without waiting for it: the ``last``
    of the first idle status after the server finished one more session than before (another
    connection sees it only with the server's operator token)."""
    if rep.ended is not None:
        return rep.ended
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = await status(url, token=token)
        if not st.busy and st.sessions_served > served_before and st.last is not None:
            return st.last
        await asyncio.sleep(0.05)
    return None


class _WsSessions:
    """Sessions of one preset against one server, their media under ``files``."""

    def __init__(self, url: str, files: Path, server: ServerProcess | None) -> None:
        self.url, self.files, self.server = url, files, server
        self.preset = asyncio.run(status(url)).preset

    def run(self, seed: int, chunks: int, **opts):
        return asyncio.run(run_session(self.url, preset=self.preset, seed=seed, chunks=chunks, prompt=prompt_for(seed),
                                       opts=ViewerOptions(out_dir=self.files, **opts)))

    def served(self) -> int:
        return asyncio.run(status(self.url)).sessions_served

    def ended(self, rep, served_before: int):
        token = self.server.operator_token() if self.server else ""
        return asyncio.run(ended_of(self.url, rep, served_before, token=token))


def _verify_ws(ws: _WsSessions, p: Params, ref: Reference, pt: WsCancelPoint, problems: list[str]) -> str:
    v = p.verify_chunks
    chk = ws.run(p.seed, v)
    pairs = [(h.latent_sha256, h.pixels_sha256) for h in chk.ended.hashes] if chk.ended else []
    bad_media = verify_media(chk) if chk.outcome == "complete" else chk.error or chk.outcome
    same = chk.outcome == "complete" and ref.matches(pairs, chk.frame_sha256, v) and not bad_media
    if not same:
        problems.append(f"after {pt.name}" + (f" ({bad_media})" if bad_media else ""))
    return "identical" if same else "DIFFERS"


def _point_ws(ws: _WsSessions, p: Params, i: int, pt: WsCancelPoint, ref: Reference,
              problems: dict[str, list[str]]) -> tuple[list, bool]:
    """Run one cancelled (or disconnected) session, judged by the server's account of it, then a
    verification session if the point asks; its table row and whether it was verified."""
    served = ws.served()
    rep = ws.run(p.seed + 1 + i, p.cancel_chunks, **pt.opts)
    end = ws.ended(rep, served)
    if end is None:
        problems["outcome"].append(f"{pt.name}: the server never finished the session")
        return [i + 1, pt.name, pt.target, rep.outcome, "?", "", "", "", "", ""], False
    server_outcome = "cancelled" if end.cancelled else "complete"
    if server_outcome != pt.expect:
        problems["outcome"].append(f"{pt.name}: {server_outcome}")
    if end.kv_blocks_used != 0:
        problems["kv"].append(f"{pt.name}: {end.kv_blocks_used}")
    if end.ring_free != end.ring_slots:
        problems["ring"].append(f"{pt.name}: {end.ring_free}/{end.ring_slots}")
    if end.cancelled and not end.media_discarded:
        problems["media"].append(f"{pt.name}: server kept cancelled media")
    leftover = sorted(f.name for f in ws.files.glob("*.part"))
    if leftover:
        problems["media"].append(f"{pt.name}: client left {leftover}")
    nxt = _verify_ws(ws, p, ref, pt, problems["next"]) if pt.verify else "-"
    return [i + 1, pt.name, pt.target, rep.outcome, server_outcome, end.reason or "-", end.kv_blocks_used,
            f"{end.ring_free}/{end.ring_slots}", "removed" if end.media_discarded else "-", nxt], pt.verify


def cancel_ws(url: str, p: Params, server: ServerProcess | None = None) -> Report:
    report = Report("cancel", "websocket")
    files = Path(tempfile.mkdtemp(prefix="cancel-", dir=p.workdir))
    ws = _WsSessions(url, files, server)
    ref = ws.run(p.seed, max(p.cancel_chunks, p.verify_chunks))
    if ref.outcome != "complete":
        report.check("reference session completes", False, ref.error or ref.outcome)
        return report
    reference = Reference(ref.session, [(h.latent_sha256, h.pixels_sha256) for h in ref.ended.hashes], ref.frame_sha256,
                          [h.frames for h in ref.headers])
    points = ws_cancel_points((ref.t_first_media_ns - ref.t_start_ns) / 1e9, p.cancel_chunks)
    if p.points:
        points = [c for c in points if c.name in p.points]
    report.header = ["#", "point", "aimed at", "client saw", "server", "reason", "KV used", "ring free", "media", "next session"]
    problems = _problems("outcome")
    verified = 0
    for i, pt in enumerate(points):
        row, checked = _point_ws(ws, p, i, pt, reference, problems)
        report.rows.append(row)
        verified += checked
    report.check_none("cancel and disconnect end the session on the server (a late cancel is a no-op)", problems["outcome"])
    _state_checks(report, problems, "no partial media claimed valid", verified,
                  " equal the reference (latents, pixels, frame hashes, decoded media)")
    shutil.rmtree(files, ignore_errors=True)
    return report.done()
