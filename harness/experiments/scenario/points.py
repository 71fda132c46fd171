"""Where the cancel scenario cancels: points aimed at every stage of the pipeline from timings of a
reference session (in process), or at moments of the client's conversation (over websocket); and
where, from the session's own events, each point actually landed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from harness.experiments.scenario.session_figures import MS
from harness.measure.clock import now


@dataclass
class CancelPoint:
    name: str
    target: str  # what it aims at, for the table
    when: Callable[[int, list[dict]], bool] | None  # (start_ns, driver stamps) → cancel now; None: at the first poll
    expect_cancelled: bool = True
    scheduler: str | None = None
    sink: str | None = None
    keep_partial: bool = False
    verify: bool = True  # False: the next point's session follows at once ("twice in a row")


#: the driver-visible boundary that ends the stage a delayed point aims into
_STAGE_END = {"submit": "latent_ready", "decode_submit": "cpu_ready", "cpu_ready": "delivered"}


def _at(chunk: int, boundary: str, delay_ns: float = 0):
    """Fire ``delay_ns`` after ``boundary`` of ``chunk`` — or as soon as that stage is seen to be
    over, so an estimate that runs long on a busy machine still cancels inside the session."""
    end = _STAGE_END.get(boundary) if delay_ns else None

    def when(_start: int, st: list[dict]) -> bool:
        if chunk >= len(st) or boundary not in st[chunk]:
            return False
        return now() >= st[chunk][boundary] + delay_ns or (end is not None and end in st[chunk])
    return when


def cancel_points(fwd: float, dec: float, n: int, fps: int = 16, lag: float = 0) -> list[CancelPoint]:
    """Timings from the reference session (ns): ``fwd`` one DiT forward, ``dec`` one chunk's decode,
    ``lag`` from the driver's submit to the DiT rank starting; ``n`` chunks per cancelled session.
    "step k" points aim at the middle of forward k (0-3 denoise, 4 commit)."""
    last = n - 1
    mid = min(1, last)
    step = lambda k: lag + (k + 0.5) * fwd  # noqa: E731
    pts = [
        CancelPoint("before-first-chunk", "nothing submitted yet", None),
        CancelPoint("start+1ms", "1 ms after the session started", lambda s, st: now() >= s + MS),
        CancelPoint("dit0:submitted", "chunk 0 just submitted to the DiT", _at(0, "submit")),
        CancelPoint("dit0:step0", "chunk 0, denoise step 0", _at(0, "submit", step(0))),
        CancelPoint("dit0:step1", "chunk 0, denoise step 1", _at(0, "submit", step(1))),
        CancelPoint("dit0:step2", "chunk 0, denoise step 2", _at(0, "submit", step(2))),
        CancelPoint("dit0:step3", "chunk 0, denoise step 3", _at(0, "submit", step(3))),
        CancelPoint("dit0:commit", "chunk 0, the commit forward", _at(0, "submit", step(4))),
        CancelPoint(f"dit{mid}:step2", f"chunk {mid} mid-DiT, with cached context", _at(mid, "submit", step(2))),
        CancelPoint(f"dit{last}:step3", "last chunk mid-DiT", _at(last, "submit", step(3))),
        CancelPoint("decode0+0", "chunk 0 just sent to the VAE", _at(0, "decode_submit")),
        CancelPoint(f"decode{mid}+half", f"chunk {mid} half-way through its decode", _at(mid, "decode_submit", 0.5 * dec)),
        CancelPoint(f"decode{last}+0.9", "last chunk late in its decode", _at(last, "decode_submit", 0.9 * dec)),
        CancelPoint("encode0", "chunk 0's frames just handed to the encoder", _at(0, "cpu_ready")),
        CancelPoint(f"encode{mid}+2ms", f"chunk {mid} being encoded", _at(mid, "cpu_ready", 2 * MS)),
        CancelPoint("delivered0", "between chunks: chunk 0 delivered", _at(0, "delivered")),
        CancelPoint("last-latent", "all chunks generated, last one decoding", _at(last, "latent_ready")),
        CancelPoint("last-encode", "last chunk's frames at the encoder", _at(last, "cpu_ready")),
        CancelPoint("after-last-chunk", "too late: every chunk delivered (a no-op)", _at(last, "delivered"),
                    expect_cancelled=False),
        CancelPoint("case-e:dit-while-decoding", f"Case E: DiT of chunk {mid + 1 if mid < last else last} while "
                    f"chunk {mid} decodes", lambda s, st: len(st) > mid + 1 and "submit" in st[mid + 1]
                    and "cpu_ready" not in st[mid], scheduler="case-e"),
        CancelPoint("case-e:latent-waiting", f"Case E: chunk {mid}'s latent waiting for the decoder",
                    lambda s, st: "latent_ready" in st[mid] and "decode_submit" not in st[mid], scheduler="case-e"),
        CancelPoint("slow-sink-backlog", "consumer behind (throttled sink), chunks queued at the encoder",
                    _at(mid, "cpu_ready"), sink=f"throttled:{fps / 2:g}"),
        CancelPoint("keep-partial-media", "chunk 0 delivered; partial media kept (policy)", _at(0, "delivered"),
                    keep_partial=True),
        CancelPoint("twice-1", "first of two cancelled sessions in a row (mid-DiT)", _at(0, "submit", step(1)), verify=False),
        CancelPoint("twice-2", "second one, right after (mid-decode)", _at(0, "decode_submit", 0.3 * dec)),
    ]
    return pts


class Trigger:
    """A session's should_cancel: true from the first poll at which the point's moment has come."""

    def __init__(self, when) -> None:
        self.when, self.fired_ns = when, None

    def __call__(self, start_ns: int, stamps: list[dict]) -> bool:
        if self.fired_ns is None and (self.when is None or self.when(start_ns, stamps)):
            self.fired_ns = now()
        return self.fired_ns is not None


def where(t: int | None, events, start_ns: int) -> str:
    """Where in the pipeline a moment fell, from the session's own events."""
    if t is None:
        return "never fired"
    spans = []
    for e in events:
        c = e.chunk
        for a, b, what in (("submit", "dit_start", f"→dit{c}"), ("dit_start", "dit_end", f"dit{c}"),
                           ("dit_end", "latent_ready", f"→drv{c}"), ("latent_ready", "decode_submit", f"latent{c} waiting"),
                           ("decode_submit", "decode_start", f"→vae{c}"), ("decode_start", "cpu_ready", f"decode{c}"),
                           ("cpu_ready", "received", f"→enc{c}"), ("received", "encoded", f"encode{c}"),
                           ("encoded", "delivered", f"sink{c}")):
            ta, tb = getattr(e, a), getattr(e, b)
            if ta is not None and tb is not None and ta <= t < tb:
                if what.startswith("dit") and tb > ta:
                    what += f" step {min(4, int(5 * (t - ta) / (tb - ta)))}"
                spans.append(what)
    if spans:
        return ", ".join(spans)
    if not events or all(e.submit is None or t < e.submit for e in events):
        return f"before chunk 0 (+{(t - start_ns) / MS:.1f} ms)"
    return "between stages"


@dataclass
class WsCancelPoint:
    name: str
    target: str
    opts: dict
    expect: str = "cancelled"  # the session's outcome on the server: cancelled | complete
    verify: bool = True


def ws_cancel_points(ttfc_s: float, n: int) -> list[WsCancelPoint]:
    last = n - 1
    return [
        WsCancelPoint("cancel-right-after-start", "before the server picked the session up", dict(cancel_at="start")),
        WsCancelPoint("cancel-on-started", "before chunk 0", dict(cancel_at="started")),
        WsCancelPoint("cancel-mid-chunk0", f"{0.5 * ttfc_s:.2f} s after start (chunk 0 in DiT/VAE)",
                      dict(cancel_at=f"after:{0.5 * ttfc_s:.3f}")),
        WsCancelPoint("cancel-on-header0", "chunk 0 announced, its media in flight", dict(cancel_at="header:0")),
        WsCancelPoint("cancel-after-chunk0", "chunk 0 read; chunk 1 in progress", dict(cancel_at="chunk:0")),
        WsCancelPoint("cancel-twice-at-once", "two cancel messages back to back", dict(cancel_at="chunk:0", cancel_repeat=2)),
        WsCancelPoint("disconnect-right-after-start", "socket closed right after start", dict(disconnect_at="start")),
        WsCancelPoint("disconnect-mid-chunk1", "socket closed after chunk 0 (chunk 1 in progress)", dict(disconnect_at="chunk:0")),
        WsCancelPoint("disconnect-mid-media", "socket closed with chunk 1's media in flight", dict(disconnect_at=f"header:{min(1, last)}")),
        WsCancelPoint("actions-timeout", "client withholds chunk 1's actions (server times out)",
                      dict(withhold_actions_from=min(1, last), action_timeout_s=0.5)),
        WsCancelPoint("cancel-after-last-chunk", "too late: last chunk read (a no-op)", dict(cancel_at=f"chunk:{last}"),
                      expect="complete"),
        WsCancelPoint("twice-1", "first of two cancelled sessions in a row", dict(cancel_at="chunk:0"), verify=False),
        WsCancelPoint("twice-2", "second one, right after", dict(cancel_at="started")),
    ]
