"""The recovery's rules on fake pools, in milliseconds: the replay re-sends exactly the
messages since the restore point, a spare takes over, and the heartbeat check fires."""

from __future__ import annotations

import collections
import multiprocessing
import os
import queue
import threading
import time
import types
import weakref
from typing import Any

import pytest

from paraloom.errors import WorkerError
from paraloom.training import recovery
from paraloom.training.gate import RoundGate
from paraloom.training.messages import (
    Begin,
    Failed,
    IdleRound,
    RestorePoint,
    RestorePointRequest,
    Round,
    StepDone,
)
from paraloom.training.packing import PackedTensors, pack_tensors, unpack_tensors
from paraloom.training.process_pool import ProcessPool
from paraloom.training.recovery import RecoveringPool
from paraloom.training.spares import Spares

pytestmark = pytest.mark.timeout(30)


class FakePool:
    """Two workers that answer each round and restore point at once; ``fail_on`` makes the
    send of that round (to rank 1) raise WorkerError, once."""

    made = 0

    def __init__(self, fail_on: int | None = None) -> None:
        FakePool.made += 1
        self.name = FakePool.made
        self.workers, self.backend, self.devices, self.threads = 2, "gloo", ["cpu"] * 2, 1
        self.fail_on = fail_on
        self.begun: list[Begin] = []
        self.sent: list[tuple[int, Any]] = []
        self.replies: collections.deque[Any] = collections.deque()
        self.killed = self.closed = self.reaped = False

    pids: list[int] = []
    alive = True
    warm = True

    def begin(self, messages):
        self.begun = list(messages)

    def halt(self, last=None):
        return -1

    def send(self, rank, message):
        if isinstance(message, Round) and message.round_id == self.fail_on and rank == 1:
            self.fail_on = None
            raise WorkerError("worker 1 was killed by SIGKILL", worker=1)
        self.sent.append((rank, message))
        if isinstance(message, Round | IdleRound):
            self.replies.append(StepDone(rank, message.round_id, 0.0, 1, True))
        elif isinstance(message, RestorePointRequest):
            self.replies.append(RestorePoint(rank, message.round_id, pack_tensors(
                f"state{rank}@{message.round_id}"), 0.0))

    def recv(self, timeout_s=None):
        return self.replies.popleft() if self.replies else None

    def close(self, timeout_s=10.0):
        self.closed = True

    def kill(self, wait=True):
        self.killed = True
        self.reaped = self.reaped or wait


def _starter(make: Any) -> tuple[Any, list[FakePool]]:
    """A ``start`` for RecoveringPool that makes pools with ``make(first)``, and the list of
    those it made."""
    started: list[FakePool] = []

    def start() -> FakePool:
        started.append(make(not started))
        return started[-1]

    return start, started


def _resumed(begin: Begin) -> Any:
    assert isinstance(begin.resume, PackedTensors)
    return unpack_tensors(begin.resume)


def _drain(pool: RecoveringPool) -> list[Any]:
    got = []
    while (reply := pool.recv(0)) is not None:
        got.append(reply)
    return got


def test_the_replay_resends_exactly_the_rounds_since_the_restore_point(monkeypatch):
    monkeypatch.setattr(recovery, "_MIN_INTERVAL_S", 3600.0)  # restore points only when asked
    pools = iter([FakePool(fail_on=6), FakePool()])
    seen: list[recovery.Recovery] = []
    pool = RecoveringPool(lambda: next(pools), max_failures=1, on_recovery=seen.append)
    first = pool._pool
    pool.begin([Begin(None), Begin(None)])
    for round_id in range(6):
        for rank in range(2):
            pool.send(rank, Round(round_id, round_id))
        if round_id == 3:
            pool._request(3)  # a restore point after round 3
        _drain(pool)
    assert pool._restore.round_id == 3
    for rank in range(2):
        pool.send(rank, Round(6, 6))  # rank 1's send fails: the recovery replays
    second = pool._pool
    # Killed at once, reaped later (a recovery does not wait for the processes to go).
    assert second is not first and first.killed and not first.reaped
    # The restore point replaces the fit's model and optimizer state: only it travels.
    assert [_resumed(b) for b in second.begun] == ["state0@3", "state1@3"]
    assert all(b.state is None and b.optimizer_state is None for b in second.begun)
    assert [(rank, m.round_id) for rank, m in second.sent if isinstance(m, Round)] == [
        (0, 4), (1, 4), (0, 5), (1, 5), (0, 6), (1, 6)]
    delivered = [(r.round_id, r.rank) for r in _drain(pool) if isinstance(r, StepDone)]
    assert delivered == [(6, 0), (6, 1)]  # rounds 4 and 5 were delivered before the failure
    assert seen[0].replayed_rounds == 3 and seen[0].rank == 1
    assert seen[0].redone_rounds == 2  # 4 and 5 were trained; 6 was being sent
    pool.close()
    assert first.reaped and second.closed


def test_restore_points_asked_for_together_complete_in_order_and_the_replay_follows_the_last(
        monkeypatch):
    # A restore point is answered behind the rounds in flight: a second one is asked for
    # before the first is answered, and each completed one shortens the log.
    monkeypatch.setattr(recovery, "_MIN_INTERVAL_S", 3600.0)  # restore points only when asked
    pools = iter([FakePool(fail_on=7), FakePool()])
    pool = RecoveringPool(lambda: next(pools), max_failures=1, on_recovery=lambda r: None)
    pool.begin([Begin(None), Begin(None)])
    for round_id in range(7):
        for rank in range(2):
            pool.send(rank, Round(round_id, round_id))
        if round_id in (3, 5):
            pool._request(round_id)
    assert [p.round_id for p in pool._pending] == [3, 5]
    _drain(pool)
    assert pool._restore.round_id == 5 and not pool._pending
    assert [(rank, m.round_id) for rank, m in pool._log] == [(0, 6), (1, 6)]
    for rank in range(2):
        pool.send(rank, Round(7, 7))  # rank 1's send fails: the recovery replays
    second = pool._pool
    assert [_resumed(b) for b in second.begun] == ["state0@5", "state1@5"]
    assert [(rank, m.round_id) for rank, m in second.sent if isinstance(m, Round)] == [
        (0, 6), (1, 6), (0, 7), (1, 7)]
    pool.close()


def test_restore_points_are_spaced_by_their_typical_cost_not_their_worst():
    pool = RecoveringPool(FakePool, max_failures=1, on_recovery=lambda r: None)
    pool.begin([Begin(None), Begin(None)])
    assert pool._interval() == recovery._MIN_INTERVAL_S  # nothing measured yet

    def take(round_id: int, *seconds: float) -> None:
        pool._request(round_id)
        for rank, s in enumerate(seconds):
            pool._keep(RestorePoint(rank, round_id, pack_tensors({}), s))
        assert pool._restore.round_id == round_id

    take(0, 0.002, 0.008)  # the first copy, into fresh pages: its slowest replica counts
    assert pool._interval() == pytest.approx(0.008 / recovery._COST_SHARE)
    take(1, 0.0012, 0.0010)
    take(2, 0.0009, 0.0011)
    assert pool._interval() == recovery._MIN_INTERVAL_S  # the median: 1.2 ms, 2% of 0.06 s
    for round_id in range(3, 3 + recovery._COSTS_KEPT):
        take(round_id, 0.010, 0.009)  # a bigger state from now on: 2% of the time again
    assert pool._interval() == pytest.approx(0.010 / recovery._COST_SHARE)
    pool.close()


def test_a_spare_takes_over_and_is_replaced(monkeypatch):
    monkeypatch.setattr(recovery, "_MIN_INTERVAL_S", 3600.0)
    start, started = _starter(lambda first: FakePool(fail_on=1 if first else None))
    pool = RecoveringPool(start, max_failures=1, on_recovery=lambda r: None, spares=1)
    pool._spares.restock_delay_s = 0.0
    deadline = time.monotonic() + 5
    while pool._spares.ready < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(started) == 2  # the pool and its spare
    pool.begin([Begin(None), Begin(None)])
    for round_id in range(2):
        for rank in range(2):
            pool.send(rank, Round(round_id, round_id))
    assert pool._pool is started[1]  # the spare, not a pool started by the recovery
    while pool._spares.ready < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(started) == 3  # its replacement
    pool.close()
    assert started[2].closed and not started[0].closed and started[0].killed


def test_spares_edge_cases():
    with pytest.raises(ValueError, match="spares=-1"):
        Spares(FakePool, -1)
    assert Spares(FakePool, 0).take(0.1) is None  # no spare: the recovery starts its own

    gate = threading.Event()

    def slow() -> FakePool:
        gate.wait(5)
        return FakePool()

    spares = Spares(slow, 1)
    threading.Timer(0.2, gate.set).start()
    taken = spares.take(5.0)  # a failure while the spare is still starting waits for it
    assert isinstance(taken, FakePool)
    spares.close(1.0)

    dead = FakePool()
    dead.alive = False  # type: ignore[misc]
    spares = Spares(lambda: dead, 1, restock_delay_s=60)
    while spares.ready < 1:
        time.sleep(0.01)
    assert spares.take(1.0) is None and dead.killed  # its workers died while it waited
    spares.close(1.0)

    spares = Spares(FakePool, 1, restock_delay_s=60)
    while spares.ready < 1:
        time.sleep(0.01)
    assert isinstance(spares.take(5.0), FakePool)
    started = time.monotonic()
    assert spares.take(5.0) is None  # the replacement waits out its delay: not waited for
    assert time.monotonic() - started < 1.0
    spares.close(1.0)

    def broken() -> FakePool:
        raise WorkerError("workers [0] did not start within 1 s")

    assert Spares(broken, 1).take(1.0) is None  # logged; the recovery starts its own


def test_the_heartbeat_check_names_a_stopped_worker_and_spares_a_busy_one(monkeypatch):
    from paraloom.training import process_pool

    pool = process_pool.ProcessPool.__new__(process_pool.ProcessPool)

    class Proc:
        pid = 4242

    pool._procs = [Proc(), Proc()]  # type: ignore[list-item]
    pool.heartbeat_timeout_s = 1.0
    pool._pending = collections.deque()
    pool.workers = 2
    pool.survive = False
    pool._inbox = _DeadSenderInbox([])  # nothing reported
    pool._gate = RoundGate.create(multiprocessing.get_context("spawn"), 2)
    assert pool._gate.admit(1, 5)  # rank 1 started round 5
    killed: list[bool] = []
    monkeypatch.setattr(pool, "kill", lambda wait=True: killed.append(True), raising=False)
    now = time.monotonic()
    pool._beats = [now, now - 1.5]  # rank 1 silent for 1.5 s
    states = iter(["running", "stopped"])
    monkeypatch.setattr(process_pool, "process_state", lambda pid: next(states))
    pool._check_heartbeats()  # running (native code holding the GIL): not a failure
    assert not killed
    with pytest.raises(WorkerError, match=r"worker 1 .* no heartbeat for 1\.5 s") as failed:
        pool._check_heartbeats()
    assert failed.value.worker == 1 and failed.value.batch == 5 and killed
    assert "(pid 4242) (the last round it started: 5)" in str(failed.value)
    pool._beats = [now, now - 0.5]
    pool._check_heartbeats()  # within heartbeat_timeout


def test_a_process_whose_main_thread_sleeps_while_another_runs_is_running():
    """What the heartbeat check reads: not the main thread's state alone (a worker that just
    left a GIL-holding call sleeps in a collective while its heartbeat thread waits for a
    CPU), but whether any thread runs; a stopped process is stopped whatever its threads."""
    import os
    import select
    import signal
    import subprocess
    import sys

    from paraloom.training.failures import process_state

    busy = "import threading, time\n" \
           "def spin():\n" \
           "    while True:\n" \
           "        pass\n" \
           "threading.Thread(target=spin, daemon=True).start()\n" \
           "print('started', flush=True)\n" \
           "time.sleep(60)\n"
    p = subprocess.Popen([sys.executable, "-c", busy], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert select.select([p.stdout], [], [], 30)[0], "the child did not start in 30 s"
        assert p.stdout.readline() == "started\n"
        # the main thread is asleep (not still starting up, reading files: 'D' on a loaded
        # machine) before the process is read: otherwise it is its state that says "running"
        deadline = time.monotonic() + 10
        while _main_thread_state(p.pid) != "S" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _main_thread_state(p.pid) == "S"
        assert process_state(p.pid) == "running"
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(p.pid) != "stopped" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_state(p.pid) == "stopped"
    finally:
        p.kill()
        p.wait(10)


def _main_thread_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


class _DeadSenderInbox:
    """Replies as the reader thread hands them on once a worker has exited: one whose tensors
    lived in that worker (unreadable), then the peer's own report."""

    def __init__(self, items: list[Any]) -> None:
        self.items = collections.deque(items)

    def get(self, timeout_s: float) -> Any:
        if not self.items:
            raise queue.Empty
        item = self.items.popleft()
        if isinstance(item, Exception):
            raise item
        return item


def test_collecting_errors_drops_a_reply_from_a_worker_that_has_exited() -> None:
    # The fault CI met: a worker raised and exited while its last step's tensors were queued;
    # reading them raised FileNotFoundError, which hid the worker's own error.
    pool = object.__new__(ProcessPool)
    pool.workers = 2
    pool._procs = [types.SimpleNamespace(exitcode=1), types.SimpleNamespace(exitcode=None)]
    pool._pending = collections.deque()
    peer = Failed(1, 11, "connection closed by peer", "", "RuntimeError")
    cause = Failed(0, 11, "boom", "", "RuntimeError")
    pool._inbox = _DeadSenderInbox([FileNotFoundError(2, "listener"),
                                    ConnectionResetError(104, "reset"), cause])
    assert pool._collect_errors(peer) == [peer, cause]


def test_a_first_report_that_is_a_cause_is_not_waited_behind() -> None:
    # A worker's own exception names the failure: the recovery starts without waiting up to
    # half a second for its peers' reports (symptoms of it).
    pool = object.__new__(ProcessPool)
    pool.workers = 2
    pool._procs = [types.SimpleNamespace(exitcode=None)] * 2
    pool._pending = collections.deque()
    peer = Failed(1, 11, "connection closed by peer", "", "RuntimeError")
    pool._inbox = inbox = _DeadSenderInbox([peer])
    cause = Failed(0, 11, "boom", "", "RuntimeError")
    assert pool._collect_errors(cause) == [cause]
    assert list(inbox.items) == [peer]  # not read: nothing was waited for


def test_the_inbox_thread_lets_go_of_each_reply_and_closing_waits_for_it() -> None:
    # The exit abort (status 134, "terminate called without an active exception", about one
    # script in ten): the reply thread still held the last reply when the script ended, and
    # freed its tensors while the interpreter shut down.
    from paraloom.training.inbox import Inbox

    class Reply:
        pass

    freed_by: list[str] = []
    results: queue.Queue[Any] = queue.Queue()
    inbox = Inbox(results)  # type: ignore[arg-type]
    reply = Reply()
    weakref.finalize(reply, lambda: freed_by.append(threading.current_thread().name))
    results.put(reply)
    assert inbox.get(timeout_s=5.0) is reply
    del reply  # the thread keeps no reference to a reply it handed on: freed here, at once
    assert freed_by == ["MainThread"]
    inbox.close()
    assert not inbox._thread.is_alive()


def test_the_inbox_says_at_once_when_a_watched_process_ends() -> None:
    # A killed worker reports nothing: the pool learns of it from the process's sentinel, not
    # at its next look (up to 0.05 s later), and only once per process.
    import multiprocessing

    from paraloom.training.inbox import EXITED, Inbox

    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=time.sleep, args=(60,), daemon=True) for _ in range(2)]
    for p in procs:
        p.start()
    inbox = Inbox(queue.Queue())  # type: ignore[arg-type]
    inbox.watch([p.sentinel for p in procs])
    try:
        with pytest.raises(queue.Empty):
            inbox.get(timeout_s=0.2)  # both alive: nothing
        procs[1].kill()
        assert inbox.get(timeout_s=10.0) is EXITED
        with pytest.raises(queue.Empty):
            inbox.get(timeout_s=0.2)  # the same exit is not told twice
        procs[0].kill()
        assert inbox.get(timeout_s=10.0) is EXITED
    finally:
        for p in procs:
            p.kill()
            p.join(5)
        inbox.close()
    assert not inbox._thread.is_alive()


def _wake_ups(thread: threading.Thread) -> int:
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        status = f.read()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads Linux's /proc")
def test_the_inbox_thread_sleeps_until_a_reply_an_end_or_a_change_wakes_it() -> None:
    # Each timed wake-up costs ~0.1 ms of CPU on a VM; polling every 0.05 s woke it 10 times
    # in this half second.
    import multiprocessing

    from paraloom.training.inbox import Inbox

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    proc.start()
    inbox = Inbox(results)
    inbox.watch([proc.sentinel])
    try:
        time.sleep(0.1)
        before = _wake_ups(inbox._thread)
        time.sleep(0.5)
        assert _wake_ups(inbox._thread) - before <= 1
        results.put("reply")  # a reply wakes it at once
        assert inbox.get(timeout_s=10.0) == "reply"
        inbox.watch([])  # so does a change of what it watches: the kill below is not told
        proc.kill()
        with pytest.raises(queue.Empty):
            inbox.get(timeout_s=0.3)
    finally:
        proc.kill()
        proc.join(5)
        inbox.close()
        results.close()
    assert not inbox._thread.is_alive()


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads Linux's /proc")
def test_a_spares_heartbeat_sleeps_until_it_has_a_rank_then_beats() -> None:
    from paraloom.training.worker import _Heartbeat

    beats = [0.0, 0.0]
    heartbeat = _Heartbeat(beats, -1)
    time.sleep(0.1)
    before = _wake_ups(heartbeat.thread)
    time.sleep(0.4)  # beating on its loop, it woke 4 times here
    assert _wake_ups(heartbeat.thread) - before <= 1 and beats == [0.0, 0.0]
    heartbeat.rank = 1
    deadline = time.monotonic() + 5.0
    while beats[1] == 0.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert beats[0] == 0.0 and beats[1] > 0.0


def test_the_pool_checks_its_workers_every_eighth_of_the_heartbeat_timeout() -> None:
    from paraloom.training.process_pool import check_interval

    assert check_interval(1.0) == 0.125
    assert check_interval(0.25) == 0.05  # the least heartbeat_timeout: never more often
    assert check_interval(2.0) == check_interval(10.0) == check_interval(None) == 0.25


def _report_and_exit(results: Any) -> None:
    results.put(Failed(1, 7, "RuntimeError: boom", "", "RuntimeError"))
    results.close()
    results.join_thread()  # as a worker reports: flushed to the pipe before it exits


def test_a_process_that_reported_and_exited_is_told_after_its_report() -> None:
    # The order lets the pool take an ended worker's report as read: no wait for it.
    import multiprocessing

    from paraloom.training.inbox import EXITED, Inbox

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    inbox = Inbox(results)
    proc = ctx.Process(target=_report_and_exit, args=(results,))
    proc.start()
    inbox.watch([proc.sentinel])
    try:
        first = inbox.get(timeout_s=30.0)
        assert isinstance(first, Failed) and first.message == "RuntimeError: boom"
        assert inbox.get(timeout_s=30.0) is EXITED
    finally:
        proc.join(10)
        inbox.close()
        results.close()
    assert proc.exitcode == 0


def test_a_death_message_names_the_signal_and_what_a_sigabrt_most_often_is() -> None:
    import signal

    from paraloom.training.failures import death_message

    killed = death_message(1, 42, -signal.SIGKILL, starting=False)
    assert killed == "worker 1 (pid 42) was killed by SIGKILL; the other workers were stopped"
    aborted = death_message(0, 7, -signal.SIGABRT, starting=False)
    assert "killed by SIGABRT (a C++ check failed" in aborted
    assert "tensors of different sizes on different workers" in aborted
    assert "exited with code 3" in death_message(0, 7, 3, starting=True)


class RegroupingPool(FakePool):
    """A FakePool that replaces a failed worker in place (``regroup``), or cannot."""

    survive = True
    spare_pids: list[int] = []

    def __init__(self, fail_on: int | None = None, regroups: bool = True) -> None:
        super().__init__(fail_on)
        self.regroups = regroups
        self.regrouped: list[int] = []

    def regroup(self, failed: int) -> None:
        if not self.regroups:
            raise WorkerError("the process group could not be formed again: worker 0 ended")
        self.regrouped.append(failed)
        self.replies.clear()  # what the old group answered is dropped


def _fail_on_round_two(pool: RecoveringPool) -> None:
    pool.begin([Begin(None), Begin(None)])
    for round_id in range(3):
        for rank in range(2):
            pool.send(rank, Round(round_id, round_id))
        if round_id == 0:
            pool._request(0)
        _drain(pool)


def test_a_pool_that_regroups_keeps_its_workers_and_replays_from_the_restore_point(
        monkeypatch):
    monkeypatch.setattr(recovery, "_MIN_INTERVAL_S", 3600.0)
    start, started = _starter(lambda first: RegroupingPool(fail_on=2 if first else None))
    pool = RecoveringPool(start, max_failures=1, on_recovery=lambda r: None, spares=1)
    assert pool._spares.count == 0  # it keeps spare workers of its own: no spare pool
    _fail_on_round_two(pool)
    first = started[0]
    assert pool._pool is first and started == [first] and not first.killed
    assert first.regrouped == [1]
    assert [_resumed(b) for b in first.begun] == ["state0@0", "state1@0"]
    replayed = [(rank, m.round_id) for rank, m in first.sent if isinstance(m, Round)]
    assert replayed[-4:] == [(0, 1), (1, 1), (0, 2), (1, 2)]  # every round since round 0
    pool.close()


def test_a_regroup_that_fails_starts_new_workers(monkeypatch):
    monkeypatch.setattr(recovery, "_MIN_INTERVAL_S", 3600.0)
    start, started = _starter(
        lambda first: RegroupingPool(fail_on=2 if first else None, regroups=False))
    pool = RecoveringPool(start, max_failures=1, on_recovery=lambda r: None)
    _fail_on_round_two(pool)
    assert len(started) == 2 and pool._pool is started[1] and started[0].killed
    assert [_resumed(b) for b in started[1].begun] == ["state0@0", "state1@0"]
    pool.close()


def test_the_inbox_reads_every_workers_queue_and_drops_a_replaced_ones_replies() -> None:
    # One result queue per worker: a worker killed while it writes leaves its queue's lock
    # held, which would stop the others' replies on a shared queue.
    from paraloom.training.inbox import Inbox

    first: queue.Queue[Any] = queue.Queue()
    second: queue.Queue[Any] = queue.Queue()
    inbox = Inbox(first, second)  # type: ignore[arg-type]
    try:
        second.put("from 1")
        first.put("from 0")
        assert {inbox.get(5.0), inbox.get(5.0)} == {"from 0", "from 1"}
        replacement: queue.Queue[Any] = queue.Queue()
        inbox.watch([], [first, replacement])  # worker 1 replaced
        time.sleep(0.2)  # the thread reads the new list
        second.put("stale")
        replacement.put("new 1")
        assert inbox.get(5.0) == "new 1"
        with pytest.raises(queue.Empty):
            inbox.get(0.3)  # the stale reply is not handed on
    finally:
        inbox.close()


def test_halting_the_gate_gives_up_on_a_lock_a_dead_worker_holds() -> None:
    import multiprocessing

    from paraloom.training.gate import RoundGate

    gate = RoundGate.create(multiprocessing.get_context("spawn"), 2)
    assert gate.halt(5, timeout_s=1.0) == 5
    holder = threading.Thread(target=gate.array.get_lock().acquire)  # as a worker killed
    holder.start()  # inside admit() leaves it (the lock is re-entrant: another thread takes it)
    holder.join()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="round gate's lock"):
        gate.halt(-1, timeout_s=0.2)
    assert time.monotonic() - started < 2.0


def test_spare_workers_are_taken_alive_and_restocked_after_a_delay() -> None:
    import multiprocessing

    from paraloom.training.launch import SpareWorkers, Worker

    class Proc:
        def __init__(self, pid: int) -> None:
            self.pid, self.exitcode = pid, None

        def join(self, timeout=None):
            pass

    class Launcher:
        def __init__(self) -> None:
            self.started: list[int] = []

        def start(self, rank: int) -> Worker:
            assert rank == -1  # a spare learns its rank when it is taken
            self.started.append(rank)
            ctx = multiprocessing.get_context("spawn")
            return Worker(Proc(1000 + len(self.started)), ctx.Queue(), ctx.Queue())  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="spares=-1"):
        SpareWorkers(Launcher(), -1)  # type: ignore[arg-type]
    launcher = Launcher()
    spares = SpareWorkers(launcher, 1, restock_delay_s=0.2)  # type: ignore[arg-type]
    spares.fill()
    assert spares.pids == [1001]
    assert spares.take().process.pid == 1001
    assert spares.take().process.pid == 1002  # none ready: a new one, started now
    spares.poll()
    assert spares.pids == []  # the replacement waits out its delay (the replay runs first)
    time.sleep(0.25)
    spares.poll()  # on a thread of its own
    assert spares._restocking is not None
    spares._restocking.join(5.0)
    assert spares.pids == [1003]
    spares._ready[0].process.exitcode = -9  # type: ignore[attr-defined]
    spares.killed.add(1003)  # (a fake pid: not sent a signal)
    assert spares.take().process.pid == 1004  # a spare that died while it waited is skipped
    spares.kill()
    spares.poll()
    time.sleep(0.25)
    spares.poll()
    assert spares.pids == []  # none is started after kill()


class _Held:
    """Stands in for the dead pool that a frame of the failure's traceback refers to."""


def _raised_while_checking(held: _Held) -> WorkerError:
    try:
        try:
            raise queue.Empty  # the pool's inbox had no reply: the workers are checked
        except queue.Empty:
            pool = held  # noqa: F841  (what the pool's frame holds)
            raise WorkerError("worker 1 sent no heartbeat for 1.0 s", worker=1)  # noqa: B904
    except WorkerError as e:
        return e


def test_a_kept_error_holds_no_frame_of_the_pool_that_raised_it() -> None:
    """A hung worker's WorkerError is raised inside `except queue.Empty`, so its __context__'s
    traceback held the pool's frames: the recovery kept the error (with_traceback(None) on the
    error alone) and with it the dead pool's queues, 13-16 sem.mp-* files in /dev/shm per
    SIGSTOP recovery until the wrapper was deleted."""
    held = _Held()
    alive = weakref.ref(held)
    error = _raised_while_checking(held)
    assert isinstance(error.__context__, queue.Empty)
    error.with_traceback(None)  # what the recovery did
    del held
    assert alive() is not None  # the context's traceback still holds the pool's frame
    kept = recovery.without_frames(error)
    assert kept is error and str(kept) == "worker 1 sent no heartbeat for 1.0 s"
    assert isinstance(kept.__context__, queue.Empty)  # what happened stays; its frames go
    assert kept.__traceback__ is None and kept.__context__.__traceback__ is None
    assert alive() is None
