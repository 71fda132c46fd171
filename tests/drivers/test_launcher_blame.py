"""Which rank ``LocalLauncher.poll`` blames when a rank dies and a collective peer reports the
symptom ("connection reset") first. Processes are faked (a pid, an exit status and a sentinel
that becomes ready when it exits) over real pipes, so the ordering is constructed, not raced."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest

from harness.drivers import launcher as launcher_mod
from harness.drivers.launcher import LocalLauncher, Proc, RankFailed
from harness.pipeline import messages as M

RESET = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection reset by peer\nTraceback (most recent call last): ..."


class FakeProcess:
    """What the launcher reads of an ``mp.Process``."""

    def __init__(self, pid: int):
        self.pid, self.exitcode = pid, None
        self.sentinel, self._held = os.pipe()  # ready for reading once the write end closes

    def exit(self, code: int) -> None:
        self.exitcode = code  # set before the sentinel is ready, as after a real waitpid
        os.close(self._held)

    def join(self, timeout=None) -> None:
        pass

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        self.exit(-9)


@pytest.fixture
def ranks():
    """``add(role, rank)`` → (Proc, the worker's end of its pipe); everything closed afterwards."""
    made = []

    def add(role: str, rank: int):
        parent, child = mp.Pipe(duplex=True)
        proc = Proc(role, rank, FakeProcess(1000 * (role == "vae") + rank), parent)
        made.append((proc, child))
        return proc, child

    yield add
    for proc, child in made:
        if proc.process.exitcode is None:
            os.close(proc.process._held)
        os.close(proc.process.sentinel)
        proc.conn.close()
        child.close()


def report(proc: Proc, child, message: str) -> None:
    child.send_bytes(M.encode(M.WorkerError(role=proc.role, rank=proc.rank, message=message)))


def die(proc: Proc, child, code: int) -> None:
    """The worker ends: its pipe and its sentinel close."""
    child.close()
    proc.process.exit(code)


def launcher(*procs: Proc) -> LocalLauncher:
    return LocalLauncher(cfg=None, run_dir="", ring_spec={}, procs=list(procs))


def test_a_peer_reporting_first_does_not_hide_the_killed_rank(ranks):
    # vae rank 0's conn comes before vae rank 1's conn and sentinel in poll's ready list.
    (v0, c0), (v1, c1), (enc, _) = ranks("vae", 0), ranks("vae", 1), ranks("encoder", 0)
    die(v1, c1, -9)
    report(v0, c0, RESET)
    with pytest.raises(RankFailed) as err:
        launcher(v0, v1, enc).poll(1.0)
    assert str(err.value) == ("vae rank 1 (pid 1001) died: killed by signal 9; "
                              "then vae rank 0 failed: " + RESET.splitlines()[0])


def test_a_death_seen_a_moment_after_the_report_is_still_blamed(ranks, monkeypatch):
    """The rank dies only once the peer's report has been read and the launcher waits for a
    death: started from inside that wait, 50 ms late (the wait's bound is raised so a slow timer
    thread cannot outlast it — what is tested is the order, not the 0.5 s)."""
    (d0, c0), (d1, c1) = ranks("dit", 0), ranks("dit", 1)
    report(d1, c1, RESET)
    timers, real_wait = [], launcher_mod.wait

    def wait_for_death(objs, timeout=None):
        if all(isinstance(o, int) for o in objs) and not timers:  # sentinels only: _failure's wait
            timers.append(threading.Timer(0.05, die, (d0, c0, -9)))
            timers[0].start()
        return real_wait(objs, timeout)

    monkeypatch.setattr(launcher_mod, "wait", wait_for_death)
    monkeypatch.setattr(launcher_mod, "DEATH_WAIT_S", 30.0)
    try:
        with pytest.raises(RankFailed, match=r"^dit rank 0 \(pid 0\) died: killed by signal 9; then dit rank 1 failed: "):
            launcher(d0, d1).poll(1.0)
    finally:
        for t in timers:
            t.join()
    assert len(timers) == 1


@pytest.mark.parametrize("peer_reported", [True, False])
def test_a_rank_that_exited_1_is_blamed_only_if_it_reported_nothing(ranks, peer_reported):
    # A worker that reports its error exits 1 afterwards: that peer noticed, it is not the cause.
    (v0, c0), (v1, c1) = ranks("vae", 0), ranks("vae", 1)
    report(v0, c0, "ValueError: the real error\nTraceback ...")
    if peer_reported:
        report(v1, c1, RESET)
    die(v1, c1, 1)
    with pytest.raises(RankFailed) as err:
        launcher(v0, v1).poll(1.0)
    if peer_reported:
        assert str(err.value) == "vae rank 0 failed: ValueError: the real error"
    else:
        assert str(err.value).startswith("vae rank 1 (pid 1001) died: exit code 1; then vae rank 0 failed: ValueError")


def test_a_worker_error_with_every_rank_alive_is_reported_as_is(ranks):
    (d0, _), (enc, c) = ranks("dit", 0), ranks("encoder", 0)
    report(enc, c, "OSError: disk full\nTraceback ...")
    with pytest.raises(RankFailed, match=r"^encoder failed: OSError: disk full$"):
        launcher(d0, enc).poll(1.0)


def test_a_write_to_a_rank_that_reported_and_died_gives_its_report(ranks):
    # The encoder meets a full disk, reports it and exits before the driver reads the report; the
    # driver's next EncodeChunk breaks the pipe. The error must be the report, not "exit code 1".
    (enc, c), = (ranks("encoder", 0),)
    report(enc, c, "OSError: [Errno 28] No space left on device\nTraceback ...")
    die(enc, c, 1)
    with pytest.raises(RankFailed, match=r"^encoder failed: OSError: \[Errno 28\] No space left on device$"):
        launcher(enc).send(enc, M.Shutdown())


def test_a_write_to_a_rank_that_died_silently_says_how_it_died(ranks):
    (enc, c), = (ranks("encoder", 0),)
    die(enc, c, -9)
    with pytest.raises(RankFailed, match=r"^encoder \(pid 0\) died: killed by signal 9$"):
        launcher(enc).send(enc, M.Shutdown())


def test_teardown_of_a_rank_dying_as_the_run_ends_raises_nothing(ranks):
    # The run already failed (say, the encoder's full disk); the encoder has closed its pipe but is
    # not reaped yet. The teardown's Shutdown must not raise a second error ("died: exit code 1")
    # that would replace the run's own: the disk-full test's failure in CI.
    (enc, c), = (ranks("encoder", 0),)
    c.close()
    assert enc.process.is_alive()
    launcher(enc).shutdown(grace_s=0)
    assert enc.conn.closed and enc.process.exitcode == -9
