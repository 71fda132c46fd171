"""The driver-thread side of ``serve --listen``: one thread per replica (engine group), each running
the sessions the router placed on it, and serve's own thread watching over them.

A replica's thread, between sessions, looks at its ranks every ``IDLE_CHECK_S``: a rank that died
(its sentinel, or Ray's record of its actor) drains the replica at once, named, even while no
session runs; a rank that is stopped (SIGSTOP) keeps new sessions off it until it runs again. In a
session the driver notices both itself (a death at once, a stall within ``runtime.stall_report_s``).
A drained replica's session ends with the reason sent to its client; the others go on serving.
When every replica is drained the server goes down with the last death as its error (the run
fails naming the rank), as a one-group server always has.

serve's own thread expires queued sessions past ``--queue-timeout``, stops after ``--sessions``,
and on the way out refuses whatever still waits.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from dataclasses import replace

from harness.drivers.launcher import RankFailed
from harness.drivers.replicas import Replica
from harness.drivers.serve_run import explain_failure
from harness.errors import HarnessError
from harness.serving import protocol as W
from harness.serving.admission import Router, Slot
from harness.serving.guards import warm_up, write_token

#: how often an idle replica's thread looks at its ranks (and at its queue of one)
IDLE_CHECK_S = 0.1


class ReplicaRunner:
    """Mixed into StreamServer: ``__call__`` is serve's session runner. The subclass supplies
    ``_run_one(ctx, sess)``, ``_refuse_waiting(sess, reason)``, ``_tell_moved(sess, position)``,
    ``_end_on_failure(sess, reason, fatal)``, ``_start_network``/``_stop_network``/``_close_all``."""

    def __call__(self, ctx) -> None:
        self.cfg = ctx.cfg
        write_token(ctx.run_dir / "operator.token", self.operator_token)
        reps = ctx.replicas or [Replica(0, ctx.cfg, ctx.launcher, ctx.driver)]
        self.router = Router([Slot(r.index, replace(ctx, driver=r.driver, launcher=r.launcher)) for r in reps],
                             self.opts.queue, self.opts.queue_timeout_s)
        self._manifest = ctx.manifest
        for slot in self.router.slots:
            if self.opts.warmup_chunks and not self._stop.is_set():
                warm_up(slot.ctx, self.opts.warmup_chunks)
        if self._stop.is_set():
            return
        self._start_network()
        threads = [threading.Thread(target=self._replica_loop, args=(s,), name=f"replica-{s.index}", daemon=True)
                   for s in self.router.slots]
        for t in threads:
            t.start()
        try:
            self._watch()
        except BaseException as e:
            why = "server interrupted" if isinstance(e, KeyboardInterrupt) else (
                e if isinstance(e, HarnessError) else f"{type(e).__name__}: {e}")
            self._close_all(W.encode(W.Error(message=W.one_line(why), fatal=True)), code=1011)
            raise
        finally:
            self._stop.set()
            self._cancel_running("server shutting down")
            for t in threads:
                t.join(60)
            for sess in self.router.expired(float("inf")):
                self._refuse_waiting(sess, "server is not accepting new sessions (shutting down)")
            self._record_replicas()
            self._stop_network()

    def _watch(self) -> None:
        """serve's thread while the replicas serve: queue timeouts, ``--sessions``, total failure."""
        r = self.router
        while not self._stop.is_set():
            if self._fatal is not None:
                raise self._fatal
            if not r.live():
                raise RankFailed(r.deaths[-1])  # the death that left none
            if self.opts.max_sessions is not None and r.served >= self.opts.max_sessions:
                return
            gone = r.expired(time.monotonic())
            for sess in gone:
                self._refuse_waiting(sess, f"server is busy: no replica became free within the queue timeout "
                                           f"({self.opts.queue_timeout_s:g} s); try again later")
            for sess, pos in r.positions() if gone else []:
                self._tell_moved(sess, pos)
            self._stop.wait(IDLE_CHECK_S)

    def _replica_loop(self, slot: Slot) -> None:
        try:
            while not self._stop.is_set():
                try:
                    sess = slot.pending.get(timeout=IDLE_CHECK_S)
                except queue.Empty:  # idle: look at the ranks
                    self._check_idle(slot)
                    continue
                self._run_one(slot.ctx, sess)
        except RankFailed as e:
            self._replica_failed(slot, e)
        except BaseException as e:  # not a rank's death (e.g. the run directory's disk): the server's failure
            self._fatal = e
            self._stop.set()
        finally:
            while not slot.pending.empty():  # placed, never started: the server is stopping
                self._refuse_waiting(slot.pending.get(), "server is not accepting new sessions (shutting down)")

    def _check_idle(self, slot: Slot) -> None:
        """An idle replica's ranks: a death raises (RankFailed, named); a stopped rank marks it stalled."""
        launcher = slot.ctx.launcher
        launcher.poll(0)  # raises for a dead rank; nothing else should arrive while no session runs
        halted = launcher.stopped() if hasattr(launcher, "stopped") else []
        with self.router.lock:
            was = slot.stalled
            slot.stalled = (f"{halted[0].name} (pid {launcher.local_pid(halted[0])}) is stopped "
                            f"(replica {slot.index})") if halted else None
        if slot.stalled and not was:
            print(f"stall: {slot.stalled} while idle; no session is routed to it until it runs again",
                  file=sys.stderr, flush=True)
        if was and not slot.stalled:
            self._after_release()  # it may take the head of the queue now

    def _replica_failed(self, slot: Slot, err: BaseException) -> None:
        cause = explain_failure(slot.ctx.launcher, err)
        reason = f"{W.one_line(cause)} (replica {slot.index})"  # the rank leads: it is what to look at
        sess = self.router.fail(slot, reason)
        last = not self.router.live()
        if not last:
            print(f"drained: {reason}; {len(self.router.live())} replicas still serving", file=sys.stderr, flush=True)
        if sess is not None:
            self._end_on_failure(sess, reason, fatal=last)

    def _after_release(self) -> None:
        """The queue moved: placed sessions start on their replica's thread; the rest hear their new place."""
        _placed, moved = self.router.admit()
        for sess, pos in moved:
            self._tell_moved(sess, pos)

    def _cancel_running(self, reason: str) -> None:
        for slot in self.router.slots:
            sess = slot.active
            if sess is not None:
                sess.cancel(reason)

    def _record_replicas(self) -> None:
        """How each replica ended, in the manifest's ``replicas`` (written by serve at the end)."""
        rows = self._manifest.get("replicas")
        if not rows:
            return
        for slot in self.router.slots:
            rows[slot.index].update(state="dead" if slot.dead else "served", reason=slot.dead or "",
                                    sessions_served=slot.served)

    def health(self) -> dict:
        """``/healthz``'s body: the server's state and every replica's."""
        r = getattr(self, "router", None)
        slots = r.slots if r is not None else []
        with (r.lock if r is not None else threading.Lock()):
            rows = [s.health() for s in slots]
            waiting = len(r.waiting) if r is not None else 0
        serving = [x for x in rows if x["state"] in ("ready", "busy")]
        status = ("stopping" if self._stop.is_set() else "unavailable" if not serving
                  else "degraded" if len(serving) < len(rows) else "ready")
        return {"status": status, "busy": not any(x["state"] == "ready" for x in rows), "waiting": waiting,
                "sessions_served": r.served if r is not None else 0, "replicas": rows}
