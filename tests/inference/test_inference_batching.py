"""RequestQueue: grouping by key, row limits, FIFO, max_wait from the oldest arrival, bounds."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paraloom.inference.batching import Request, RequestQueue
from paraloom.inference.errors import InferenceClosedError, QueueFullError

WAIT = 30.0


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def req(key: str = "a", rows: int = 1, arrival: float = 0.0) -> Request:
    return Request((), None, rows, key, arrival=arrival)


def keys_and_rows(batch: list[Request]) -> list[tuple[str, int]]:
    return [(r.key, r.rows) for r in batch]


def test_a_free_worker_takes_everything_queued_for_the_oldest_key_at_once():
    q = RequestQueue(limit=16, batch_rows=8)
    a1, b1, a2, a3 = req("a", arrival=1), req("b", arrival=2), req("a", arrival=3), req("a", 2, 4)
    for r in (a1, b1, a2, a3):
        q.put(r)
    assert q.take(0) == [a1, a2, a3]      # a's group, across b: shapes do not block each other
    assert q.take(0) == [b1]
    assert q.take(0) == [] and len(q) == 0


def test_batches_stop_at_batch_rows_in_arrival_order():
    q = RequestQueue(limit=16, batch_rows=4)
    rs = [req(rows=r, arrival=i) for i, r in enumerate([2, 1, 2, 1])]
    for r in rs:
        q.put(r)
    assert q.take(0) == rs[:2]          # 2 + 1 = 3; the next (2 rows) would make 5 > 4
    assert q.take(0) == rs[2:]          # 2 + 1 = 3


def test_a_request_larger_than_batch_rows_runs_alone():
    q = RequestQueue(limit=4, batch_rows=4)
    big, small = req(rows=9, arrival=1), req(rows=1, arrival=2)
    q.put(big)
    q.put(small)
    assert q.take(0) == [big]
    assert q.take(0) == [small]


def test_sequential_queue_hands_out_one_request_at_a_time_fifo_over_keys():
    q = RequestQueue(limit=8, batch_rows=None)
    rs = [req("a", arrival=1), req("b", arrival=2), req("a", arrival=3)]
    for r in rs:
        q.put(r)
    assert [q.take(0) for _ in rs] == [[r] for r in rs]


def test_oldest_group_goes_first_even_if_its_key_was_seen_later():
    q = RequestQueue(limit=8, batch_rows=8)
    a_old, b_new = req("a", arrival=5), req("b", arrival=9)
    q.put(req("b", arrival=1))
    assert keys_and_rows(q.take(0)) == [("b", 1)]
    q.put(b_new)
    q.put(a_old)     # queued after b_new, but arrived before it (it waited for room)
    assert q.take(0) == [a_old]


def test_max_wait_holds_the_batch_until_size_closes_it():
    # A huge max_wait: only the size can close this batch, so the test cannot race.
    q = RequestQueue(limit=8, batch_rows=3, max_wait=3600.0)
    got: list[list[Request]] = []
    worker = threading.Thread(target=lambda: got.append(q.take(WAIT)))
    first = req(arrival=time.monotonic())
    q.put(first)
    worker.start()
    rest = [req(arrival=time.monotonic()) for _ in range(2)]
    for r in rest:
        q.put(r)
    worker.join(WAIT)
    assert got == [[first, *rest]]


def test_max_wait_is_timed_from_the_oldest_requests_arrival():
    clock = FakeClock(now=100.0)
    q = RequestQueue(limit=8, batch_rows=32, max_wait=0.010, clock=clock)
    old = req(arrival=100.0 - 0.011)   # arrived 11 ms ago: its 10 ms are already spent
    q.put(old)
    assert q.take(0) == [old]          # no further wait, though the batch is far from full


def test_a_full_batch_of_another_key_goes_first_while_an_older_one_is_held_open():
    """Different shapes never block each other: a worker takes a ready batch at once, not
    after the older, half-empty one's max_wait."""
    q = RequestQueue(limit=8, batch_rows=4, max_wait=3600.0, clock=FakeClock(now=100.0))
    old = req("a", arrival=99.0)
    full = req("b", rows=4, arrival=99.5)
    q.put(old)
    q.put(full)
    assert q.take(0) == [full]  # "a" is still held open for more requests: it waited
    q.close()
    assert q.take(0) == [old]


def test_a_batch_is_held_open_for_at_most_half_its_requests_timeout():
    """A held-open batch starts by half of the shortest timeout among its requests, so a
    request whose timeout is shorter than max_wait does not time out in the queue."""
    q = RequestQueue(limit=8, batch_rows=32, max_wait=3600.0)
    now = time.monotonic()
    q.put(req(arrival=now))
    q.put(Request((), None, 1, "a", arrival=now, deadline=now + 1.0))  # a 1 s timeout
    batch = q.take(WAIT)
    assert len(batch) == 2 and 0.45 <= time.monotonic() - now < 1.0


def test_close_makes_take_drain_at_once_and_then_return_empty():
    q = RequestQueue(limit=8, batch_rows=8, max_wait=3600.0)
    r = req(arrival=time.monotonic())
    q.put(r)
    q.close()
    assert q.take(WAIT) == [r]         # closing: no waiting for a fuller batch
    assert q.take(WAIT) == []
    with pytest.raises(InferenceClosedError, match="closed"):
        q.put(req())


def test_full_queue_fails_fast_without_blocking():
    q = RequestQueue(limit=2)
    q.put(req())
    q.put(req())
    with pytest.raises(QueueFullError, match="queue_limit=2.*block=False"):
        q.put(req(), block=False)


def test_full_queue_blocks_for_the_timeout_then_raises():
    q = RequestQueue(limit=1)
    q.put(req())
    start = time.monotonic()
    with pytest.raises(QueueFullError, match="for 0.05 s"):
        q.put(req(), timeout=0.05)
    assert time.monotonic() - start >= 0.05


def test_a_blocked_put_goes_through_when_a_worker_takes_a_batch():
    q = RequestQueue(limit=1, batch_rows=1)
    first, second = req(arrival=1), req(arrival=2)
    q.put(first)
    entered = threading.Event()

    def producer() -> None:
        entered.set()
        q.put(second, timeout=WAIT)

    t = threading.Thread(target=producer)
    t.start()
    entered.wait(WAIT)
    assert q.take(WAIT) == [first]     # makes room: the producer's put completes
    assert q.take(WAIT) == [second]
    t.join(WAIT)
    assert not t.is_alive()


def test_close_wakes_a_blocked_producer_with_a_clear_error():
    q = RequestQueue(limit=1)
    q.put(req())
    errors: list[BaseException] = []

    def producer() -> None:
        try:
            q.put(req(), timeout=WAIT)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=producer)
    t.start()
    q.close()  # whether the producer waits already or not, it must end with the error
    t.join(WAIT)
    assert len(errors) == 1 and isinstance(errors[0], InferenceClosedError)


def test_take_times_out_empty():
    assert RequestQueue(limit=1).take(0.01) == []


def test_discard_removes_only_queued_requests():
    q = RequestQueue(limit=4, batch_rows=4)
    a, b = req(arrival=1), req(arrival=2)
    q.put(a)
    q.put(b)
    assert q.discard(a) and not q.discard(a)
    assert len(q) == 1 and q.take(0) == [b]


def test_clear_returns_everything_oldest_first():
    q = RequestQueue(limit=4, batch_rows=4)
    rs = [req("a", arrival=1), req("b", arrival=2), req("a", arrival=3)]
    for r in rs:
        q.put(r)
    assert q.clear() == rs and len(q) == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"limit": 0}, "limit=0"), ({"limit": 1, "batch_rows": 0}, "batch_rows=0"),
    ({"limit": 1, "max_wait": -1}, "max_wait=-1")])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RequestQueue(**kwargs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 5)), max_size=40),
       st.integers(1, 8), st.booleans())
def test_every_request_comes_out_once_in_key_fifo_batches(items, batch_rows, merge):
    q = RequestQueue(limit=64, batch_rows=batch_rows if merge else None)
    queued = [req(k, rows, arrival=i) for i, (k, rows) in enumerate(items)]
    for r in queued:
        q.put(r)
    seen: list[Request] = []
    while batch := q.take(0):
        assert len({r.key for r in batch}) == 1                     # one key per batch
        assert len(batch) == 1 or sum(r.rows for r in batch) <= batch_rows
        assert merge or len(batch) == 1
        # the batch starts with the oldest queued request of all keys
        assert batch[0] is min((r for r in queued if r not in seen), key=lambda r: r.arrival)
        seen.extend(batch)
    assert sorted(map(id, seen)) == sorted(map(id, queued))         # each exactly once
    for key in "abc":                                               # FIFO within a key
        mine = [r.arrival for r in seen if r.key == key]
        assert mine == sorted(mine)


def test_pending_behaves_like_the_future_parts_workers_use():
    from concurrent.futures import CancelledError, InvalidStateError

    from paraloom.inference.pending import Pending

    p = Pending()
    with pytest.raises(TimeoutError):
        p.result(0.01)
    assert p.set_running_or_notify_cancel() and not p.cancel()   # running: too late to cancel
    p.set_result(7)
    assert p.done() and p.result(0) == 7 and p.result() == 7     # readable more than once
    with pytest.raises(InvalidStateError):
        p.set_exception(ValueError("twice"))
    q = Pending()
    assert q.cancel() and q.cancelled() and not q.set_running_or_notify_cancel()
    with pytest.raises(CancelledError):
        q.result(0)
    e = Pending()
    e.set_running_or_notify_cancel()
    e.set_exception(ValueError("bad row"))
    with pytest.raises(ValueError, match="bad row"):
        e.result(0)
