"""update_model under load, close() draining or failing every request, and no leaked threads."""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import wait

import numpy as np
import pytest
import torch
from inference_helpers import WAIT, GatedScale
from torch import nn

from paraloom.inference import (
    InferenceClosedError,
    InferenceError,
    InvalidRequestError,
    ModelUpdateError,
    ParallelInference,
    execute,
)
from paraloom.models import MLP

MODES = ["batched", "sequential", "inplace"]


class Scale(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Tally:
    """Counts results per model version; lets the test wait for a count without sleeping."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.by_version: dict[int, int] = {}

    def add(self, version: int) -> None:
        with self.cond:
            self.by_version[version] = self.by_version.get(version, 0) + 1
            self.cond.notify_all()

    def wait_for(self, version: int, count: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.by_version.get(version, 0) >= count, WAIT)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
def test_update_model_under_concurrent_load_fails_nothing_and_switches(mode):
    scales = {1: 2.0, 2: 3.0}
    tally, stop = Tally(), threading.Event()
    seen: list[list[tuple[torch.Tensor, torch.Tensor, int]]] = [[] for _ in range(8)]
    errors: list[BaseException] = []

    def client(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        try:
            while not stop.is_set():
                x = torch.randn(1, 4, generator=g)
                y, version = pi.output(x, return_version=True)
                seen[i].append((x, y, version))
                tally.add(version)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    with ParallelInference(Scale(scales[1]), inference_mode=mode, workers=2, batch_limit=8,
                           queue_limit=16) as pi:
        clients = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in clients:
            t.start()
        try:
            tally.wait_for(1, 200)
            assert pi.update_model(Scale(scales[2])) == 2 == pi.model_version
            tally.wait_for(2, 200)
        finally:
            stop.set()
            for t in clients:
                t.join(WAIT)
        stats = pi.stats()
    assert not errors, errors[:3]
    for own in seen:
        versions = [v for _, _, v in own]
        assert versions == sorted(versions)         # once a client saw v2, never v1 again
        for x, y, v in own:
            torch.testing.assert_close(y, x * scales[v])
    assert stats["failed"] == 0 and sum(stats["rejections"].values()) == 0
    assert stats["completed"] == stats["requests"] == sum(map(len, seen))


def test_a_batch_in_flight_finishes_on_the_old_model_and_queued_ones_run_on_the_new(gate):
    with ParallelInference(GatedScale(gate, 2.0), workers=1) as pi, gate:
        in_flight = pi.submit(torch.ones(1, 1), return_version=True)
        assert gate.entered.wait(WAIT)
        queued = pi.submit(torch.ones(1, 1), return_version=True)   # queued before the swap
        assert pi.update_model(Scale(3.0)) == 2
        gate.open()
        assert in_flight.result(WAIT) == (torch.tensor([[2.0]]), 1)
        assert queued.result(WAIT) == (torch.tensor([[3.0]]), 2)


def test_a_failed_update_keeps_the_old_model_serving():
    torch.manual_seed(0)
    old = MLP(in_features=8, hidden=(4,)).eval()
    with ParallelInference(old, workers=1) as pi:
        x8 = torch.randn(2, 8)
        pi.output(x8)
        with pytest.raises(ModelUpdateError, match="Version 1 keeps serving.*example_input="):
            pi.update_model(MLP(in_features=5, hidden=(4,)))   # fails on the last good input
        assert pi.model_version == 1
        torch.testing.assert_close(pi.output(x8), old(x8))
        assert pi.update_model(MLP(in_features=5, hidden=(4,)), example_input=torch.ones(1, 5)) == 2
        assert pi.output(torch.ones(3, 5)).shape == (3, 10)
        with pytest.raises(TypeError, match="torch.nn.Module"):
            pi.update_model("not a model")
    with pytest.raises(InferenceClosedError):
        pi.update_model(old)



class _TimeMajor(nn.Module):
    """Reads ``(T=7, N, F=4)`` steps and ``(N,)`` weights: no input's first dimension is N."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(7 * 4, 2)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.head(x.permute(1, 0, 2).reshape(x.shape[1], 28)) * w[:, None]


@pytest.mark.parametrize("mode", ["sequential", "inplace"])
def test_models_whose_inputs_are_not_row_first_warm_and_update_where_nothing_merges(mode):
    torch.manual_seed(0)
    x, w = torch.randn(7, 3, 4), torch.rand(3)
    first, second = _TimeMajor().eval(), _TimeMajor().eval()
    with ParallelInference(first, inference_mode=mode, workers=1, example_input=(x, w)) as pi:
        torch.testing.assert_close(pi.output((x, w)), first(x, w))
        assert pi.update_model(second) == 2  # warmed on the input served, all 7 steps of it
        torch.testing.assert_close(pi.output((x, w)), second(x, w))
        assert pi.update_model(first, example_input=(x[:, :1], w[:1])) == 3


def test_close_drains_every_queued_request(gate, monkeypatch):
    with ParallelInference(GatedScale(gate), workers=1, batch_limit=2) as pi, gate:
        held = pi.submit(torch.ones(1, 1))
        assert gate.entered.wait(WAIT)
        queued = [pi.submit(torch.full((1, 1), float(i))) for i in range(5)]
        closing = threading.Event()
        real_close = pi._queue.close

        def close_then_signal() -> None:
            real_close()
            closing.set()

        monkeypatch.setattr(pi._queue, "close", close_then_signal)
        closer = threading.Thread(target=pi.close)
        closer.start()
        assert closing.wait(WAIT)          # close() has begun while all five still wait
        with pytest.raises(InferenceClosedError, match="closed"):
            pi.submit(torch.ones(1, 1))
        gate.open()
        closer.join(WAIT)
        assert not closer.is_alive()
        assert held.result(0).item() == 2.0
        assert [f.result(0).item() for f in queued] == [0.0, 2.0, 4.0, 6.0, 8.0]
        assert pi.stats()["rejections"]["closed"] == 1


def test_close_without_drain_fails_queued_requests_clearly(gate):
    with ParallelInference(GatedScale(gate), workers=1) as pi, gate:
        held = pi.submit(torch.ones(1, 1))
        assert gate.entered.wait(WAIT)
        queued = [pi.submit(torch.ones(1, 1)) for _ in range(3)]
        closer = threading.Thread(target=pi.close, kwargs={"drain": False})
        closer.start()
        done, _ = wait(queued, WAIT)       # they fail while the worker is still held
        assert len(done) == 3
        for f in queued:
            with pytest.raises(InferenceClosedError, match="drain=False"):
                f.result(0)
        gate.open()
        closer.join(WAIT)
        assert held.result(0).item() == 2.0    # what was running finishes
        stats = pi.stats()
    assert stats["rejections"]["closed"] == 3 and stats["failed"] == 3
    assert stats["requests"] == 4 and stats["completed"] == 1


def test_close_with_a_timeout_fails_what_is_left_and_returns(gate):
    with ParallelInference(GatedScale(gate), workers=1) as pi, gate:
        held = pi.submit(torch.ones(1, 1))
        assert gate.entered.wait(WAIT)
        queued = pi.submit(torch.ones(1, 1))
        with pytest.warns(UserWarning, match="still running a batch"):
            pi.close(timeout=0.05)
        with pytest.raises(InferenceClosedError, match="ran out of time"):
            queued.result(0)
        gate.open()
        assert held.result(WAIT).item() == 2.0
        pi.close()                            # joins the worker; safe to call twice


def test_a_caller_blocked_on_a_full_queue_is_released_by_close(gate):
    with ParallelInference(GatedScale(gate), workers=1, queue_limit=1, batch_limit=1) as pi, gate:
        pi.submit(torch.ones(1, 1))
        assert gate.entered.wait(WAIT)
        pi.submit(torch.ones(1, 1))           # the queue is full now
        errors: list[BaseException] = []

        def blocked() -> None:
            try:
                pi.output(torch.ones(1, 1))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        caller = threading.Thread(target=blocked)
        caller.start()
        closer = threading.Thread(target=pi.close, kwargs={"drain": False})
        closer.start()
        caller.join(WAIT)
        assert len(errors) == 1 and isinstance(errors[0], InferenceClosedError)
        gate.open()
        closer.join(WAIT)


def test_inplace_close_releases_a_caller_waiting_for_a_replica(gate):
    with ParallelInference(GatedScale(gate), inference_mode="inplace", workers=1) as pi, gate:
        first = threading.Thread(target=pi.output, args=(torch.ones(1, 1),))
        first.start()
        assert gate.entered.wait(WAIT)
        errors: list[BaseException] = []

        def second() -> None:
            try:
                pi.output(torch.ones(1, 1))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        waiter = threading.Thread(target=second)
        waiter.start()
        pi.close()
        waiter.join(WAIT)
        assert len(errors) == 1 and isinstance(errors[0], InferenceClosedError)
        gate.open()
        first.join(WAIT)


def test_close_from_a_done_callback_on_a_worker_thread_does_not_deadlock():
    pi = ParallelInference(Scale(2.0), workers=2)
    closed_by_callback = threading.Event()

    def callback(_) -> None:
        pi.close()
        closed_by_callback.set()

    fut = pi.submit(torch.ones(1, 1))
    fut.add_done_callback(callback)
    assert closed_by_callback.wait(WAIT) and fut.result(0).item() == 2.0
    pi.close()                                 # joins the worker that ran the callback


class Exits(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() < 0:
            raise SystemExit("the model ended its thread")
        return x


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_worker_killed_mid_batch_leaves_no_caller_waiting():
    with ParallelInference(Exits(), workers=1) as pi:
        with pytest.raises(InferenceError, match="interrupted"):
            pi.output(-torch.ones(1, 1))
        with pytest.raises(InferenceClosedError):    # the only worker is gone: refused at once
            pi.output(torch.ones(1, 1), timeout=WAIT)


def test_pools_leave_no_threads_behind():
    before = threading.active_count()
    for mode in MODES:
        for _ in range(3):
            with ParallelInference(Scale(1.0), inference_mode=mode, workers=2) as pi:
                pi.output(torch.ones(1, 1))
    assert threading.active_count() == before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pi.close()                              # closing again is silent and harmless
    assert pi.closed


class Float8(nn.Module):
    """Returns a dtype numpy has no form for."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float8_e4m3fn)


@pytest.mark.parametrize("mode", MODES)
def test_an_output_numpy_cannot_hold_fails_that_request_and_the_worker_keeps_serving(mode):
    with ParallelInference(Float8(), inference_mode=mode, workers=1) as pi:
        fut = pi.submit(np.ones((1, 3), np.float32))
        with pytest.raises(InferenceError, match="dtype float8_e4m3fn, which has no numpy form"):
            fut.result(WAIT)
        with pytest.raises(InferenceError, match="send the input as a torch.Tensor"):
            pi.output(np.ones((1, 3), np.float32), timeout=WAIT)
        assert pi.output(torch.ones(1, 3), timeout=WAIT).dtype == torch.float8_e4m3fn
        assert not pi.closed
        stats = pi.stats()
    assert stats["completed"] == 1 and stats["failed"] == 2 and stats["rejections"]["error"] == 2


@pytest.mark.parametrize("mode", MODES)
def test_an_unexpected_error_serving_a_batch_fails_its_requests_not_the_worker(mode, monkeypatch):
    real = execute.serve_batch
    calls = []

    def broken_once(*args: object, **kwargs: object) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated bug after the forward pass")
        real(*args, **kwargs)

    monkeypatch.setattr(execute, "serve_batch", broken_once)
    with ParallelInference(Scale(2.0), inference_mode=mode, workers=1) as pi:
        fut = pi.submit(torch.ones(1, 1))
        with pytest.raises(InferenceError, match="simulated bug after the forward pass"):
            fut.result(WAIT)
        assert pi.output(torch.ones(1, 1), timeout=WAIT).item() == 2.0  # the worker lives
        pi.close(timeout=WAIT)
    assert fut.done()


class FailsAlways(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the model is broken")


@pytest.mark.parametrize("mode", MODES)
def test_a_model_failing_on_every_input_is_the_models_error_not_the_callers(mode):
    with ParallelInference(FailsAlways(), inference_mode=mode, workers=1) as pi:
        with pytest.raises(InferenceError, match="the model is broken") as info:
            pi.output(torch.ones(1, 2), timeout=WAIT)
    assert not isinstance(info.value, InvalidRequestError)
    assert "has not run any input successfully" in str(info.value)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_closed_is_true_once_the_last_worker_thread_died():
    pi = ParallelInference(Exits(), workers=1)
    try:
        assert not pi.closed and pi.output(torch.ones(1, 1), timeout=WAIT).item() == 1.0
        with pytest.raises(InferenceError):
            pi.output(-torch.ones(1, 1), timeout=WAIT)
        assert pi._workers is not None and not pi._workers.join(WAIT)  # the thread is gone
        assert pi.closed and pi.stats()["closed"]
    finally:
        pi.close(timeout=WAIT)


@pytest.mark.parametrize("call", ["output", "submit"])
@pytest.mark.parametrize("mode", ["batched", "sequential"])
def test_a_pool_dropped_without_close_is_collected_and_its_threads_stop(mode: str, call: str
                                                                        ) -> None:
    """The worker threads held the pool: ten dropped in a loop kept 21 threads and 0.8 GB of
    replicas alive for the life of the process. And a submit()'s future held the pool in a
    reference cycle, freed only by a cyclic collection: here the collector is off."""
    import gc
    import time
    import weakref

    def predict_once() -> weakref.ref:
        pool = ParallelInference(Scale(2.0), inference_mode=mode, workers=2)
        answer = pool.output(torch.ones(3, 2)) if call == "output" else \
            pool.submit(torch.ones(3, 2)).result(WAIT)
        assert answer.tolist() == [[2.0, 2.0]] * 3
        return weakref.ref(pool)

    before = {t.name for t in threading.enumerate()}
    gc.collect()
    gc.disable()
    try:
        dropped = predict_once()
        assert dropped() is None  # freed by its last reference, not by the collector
    finally:
        gc.enable()
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline and any(
            t.name.startswith("paraloom-inference-") and t.name not in before
            for t in threading.enumerate()):
        time.sleep(0.05)
    left = [t.name for t in threading.enumerate()
            if t.name.startswith("paraloom-inference-") and t.name not in before]
    assert left == []


def test_a_ctrl_c_in_a_with_block_fails_the_queue_instead_of_running_it() -> None:
    """__exit__ drained the queue whatever ended the block: 30 queued half-second requests
    held a Ctrl-C back for 14.5 s."""
    import time

    from inference_helpers import Gate

    gate = Gate()
    queued = []
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with ParallelInference(GatedScale(gate), inference_mode="sequential", workers=1) as pool:
            queued = [pool.submit(torch.ones(1, 2)) for _ in range(10)]
            assert gate.entered.wait(WAIT)
            threading.Timer(0.5, gate.open).start()  # the request running ends then
            raise KeyboardInterrupt
    assert time.monotonic() - started < 10  # not the nine queued ones after it
    failed = [f for f in queued if isinstance(f.exception(timeout=WAIT), InferenceClosedError)]
    assert len(failed) >= 9  # all but the one running
