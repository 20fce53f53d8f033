"""ParallelInference: correctness under concurrency, batching, failure isolation, back-pressure."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import wait

import numpy as np
import pytest
import torch
from inference_helpers import WAIT, Gate, GatedScale
from torch import nn

from paraloom.inference import (
    InferenceMode,
    InvalidRequestError,
    ParallelInference,
    QueueFullError,
    RequestTimeoutError,
)
from paraloom.models import MLP

MODES = ["batched", "sequential", "inplace"]


class Mixed(nn.Module):
    """Accepts any trailing shape, one or two inputs, positional or keyword; 1 or 2 outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1.0, 1.0, 8))

    def forward(self, a: torch.Tensor, b: torch.Tensor | None = None):
        y = (a.float() * self.w[: a.shape[-1]]).sum(-1, keepdim=True)
        if b is None:
            return y
        return y + b.float().mean(-1, keepdim=True), b * 2


def random_request(rng: random.Random):
    rows = rng.randint(1, 3)
    kind = rng.choice(["tensor3", "tensor5", "tensor3d", "numpy", "tuple", "dict"])
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    if kind == "tensor3":
        return torch.randn(rows, 3, generator=g)
    if kind == "tensor5":
        return torch.randn(rows, 5, generator=g)
    if kind == "tensor3d":
        return torch.randn(rows, 2, 4, generator=g)
    if kind == "numpy":
        return torch.randn(rows, 3, generator=g).numpy()
    if kind == "tuple":
        return torch.randn(rows, 3, generator=g), torch.randint(0, 9, (rows, 2), generator=g)
    return {"a": torch.randn(rows, 5, generator=g), "b": torch.randn(rows, 3, generator=g)}


def reference(model: nn.Module, x):
    with torch.no_grad():
        if isinstance(x, dict):
            return model(**x)
        if isinstance(x, tuple):
            return model(*x)
        return model(torch.as_tensor(x))


def assert_same(got, expected) -> None:
    if isinstance(expected, tuple):
        assert isinstance(got, tuple) and len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            assert_same(g, e)
    elif isinstance(got, np.ndarray):
        torch.testing.assert_close(torch.from_numpy(got), expected)
    else:
        assert isinstance(got, torch.Tensor)
        torch.testing.assert_close(got, expected)


def hammer(pi: ParallelInference, threads: int, per_thread: int) -> list[tuple[object, object]]:
    """``threads`` threads each send ``per_thread`` random requests; returns (input, output)."""
    results: list[list[tuple[object, object]]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def client(i: int) -> None:
        rng = random.Random(i)
        try:
            start.wait(WAIT)
            for n in range(per_thread):
                x = random_request(rng)
                y = pi.submit(x).result(WAIT) if n % 7 == 0 else pi.output(x)
                results[i].append((x, y))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    workers = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(120)
    assert not errors, errors[:3]
    return [pair for own in results for pair in own]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_returns_the_models_output_for_thousands_of_mixed_concurrent_requests(mode):
    model = Mixed().eval()
    with ParallelInference(model, inference_mode=mode, workers=2, batch_limit=16,
                           queue_limit=16) as pi:
        pairs = hammer(pi, threads=8, per_thread=250)
        stats = pi.stats()
    assert len(pairs) == 2000
    for x, y in pairs:
        assert_same(y, reference(model, x))
        assert isinstance(y, np.ndarray) == isinstance(x, np.ndarray)
    assert stats["requests"] == stats["completed"] == 2000
    assert stats["failed"] == 0 and sum(stats["rejections"].values()) == 0
    if mode == "batched":  # rows of different requests really shared forward passes
        assert stats["batches"] < 2000, stats["batch_size_histogram"]
    else:
        assert stats["batches"] == 2000
    assert stats["rows"] == sum(p[0][0].shape[0] if isinstance(p[0], tuple) else
                                p[0]["a"].shape[0] if isinstance(p[0], dict) else p[0].shape[0]
                                for p in pairs)


def test_numpy_in_numpy_out_and_the_version_that_served(gate):
    gate.open()
    with ParallelInference(GatedScale(gate, 3.0)) as pi, gate:
        y, version = pi.output(np.ones((2, 2), dtype=np.float32), return_version=True)
        fut = pi.submit(torch.ones(1, 2), return_version=True)
        assert fut.result(WAIT)[1] == version == pi.model_version == 1
    assert isinstance(y, np.ndarray) and y.tolist() == [[3.0, 3.0], [3.0, 3.0]]


def test_free_worker_merges_whats_queued_grouping_shapes_apart(gate):
    with ParallelInference(GatedScale(gate), workers=1, batch_limit=32) as pi, gate:
        held = pi.submit(torch.ones(1, 4))
        assert gate.entered.wait(WAIT)     # the only worker is busy: requests now queue up
        a = [pi.submit(torch.full((1, 4), float(i))) for i in range(3)]
        b = [pi.submit(torch.full((1, 6), float(i))) for i in range(2)]
        a.append(pi.submit(torch.full((1, 4), 9.0)))   # joins a's batch, across b's requests
        gate.open()
        wait([held, *a, *b], WAIT)
        stats = pi.stats()
    assert [f.result().flatten()[0].item() for f in a] == [0.0, 2.0, 4.0, 18.0]
    assert all(f.result().shape == (1, 6) for f in b)
    assert stats["batch_size_histogram"] == {1: 1, 2: 1, 4: 1} and stats["batches"] == 3


def test_max_wait_holds_a_free_worker_until_size_closes_the_batch():
    # An hour of max_wait: only reaching batch_limit rows can close this batch.
    with ParallelInference(Mixed(), workers=1, batch_limit=4, max_wait_ms=3.6e6) as pi:
        futures = [pi.submit(torch.ones(1, 3)) for _ in range(4)]
        wait(futures, WAIT)
        assert pi.stats()["batch_size_histogram"] == {4: 1}


class Lookup(nn.Module):
    """An embedding: indices >= 10 raise IndexError, whatever the shape."""

    def __init__(self, gate: Gate) -> None:
        super().__init__()
        self.gate = gate
        self.emb = nn.Embedding(10, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.gate.pass_through()
        return self.emb(idx).sum(1)


def test_a_bad_request_in_a_batch_of_good_ones_fails_alone(gate):
    torch.manual_seed(0)
    model = Lookup(gate).eval()
    with ParallelInference(model, workers=1, batch_limit=32) as pi, gate:
        held = pi.submit(torch.tensor([[1, 2, 3]]))
        assert gate.entered.wait(WAIT)
        good = [pi.submit(torch.tensor([[i, i, i]])) for i in range(5)]
        bad = pi.submit(torch.tensor([[1, 99, 2]]))
        good += [pi.submit(torch.tensor([[i, 0, i]])) for i in range(5, 8)]
        gate.open()
        wait([held, bad, *good], WAIT)
        stats = pi.stats()
    with torch.no_grad():
        for i, f in enumerate(good):
            x = [[i, i, i]] if i < 5 else [[i, 0, i]]
            torch.testing.assert_close(f.result(), model.emb(torch.tensor(x)).sum(1))
    err = bad.exception()
    assert isinstance(err, InvalidRequestError) and isinstance(err.__cause__, IndexError)
    assert "failed on this request alone with IndexError" in str(err)
    assert err.received == err.expected == "Tensor(N, 3) int64"
    assert "as inputs it has run on, so the values are at fault" in str(err)
    assert stats["batch_size_histogram"] == {1: 1, 9: 1}    # the 9 shared one forward pass
    assert stats["completed"] == 9 and stats["failed"] == 1
    assert stats["rejections"]["invalid"] == 1


@pytest.mark.parametrize("mode", MODES)
def test_a_request_of_the_wrong_shape_names_expected_and_received(mode):
    model = MLP(in_features=64, hidden=(16,)).eval()
    with ParallelInference(model, inference_mode=mode, workers=1) as pi:
        pi.output(torch.randn(2, 64))
        with pytest.raises(InvalidRequestError) as info:
            pi.output(torch.randn(1, 65))
        torch.testing.assert_close(pi.output(torch.ones(1, 64)), model(torch.ones(1, 64)))
    message = str(info.value)
    assert "Received Tensor(N, 65) float32; expected Tensor(N, 64) float32 (the input it last " \
        "ran on)" in message
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("bad", [torch.tensor(3.0), [1, 2], torch.zeros(0, 4)])
def test_malformed_requests_are_refused_before_queueing(bad):
    with ParallelInference(Mixed(), workers=1) as pi:
        with pytest.raises(InvalidRequestError):
            pi.submit(bad)
        assert pi.stats()["rejections"]["invalid"] == 1 and pi.stats()["requests"] == 0


class _Tokens(nn.Module):
    """An embedding of any sequence length: ids >= 10 raise IndexError."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx).sum(1)


@pytest.mark.parametrize("mode", ["batched", "sequential"])
def test_a_bad_id_is_blamed_on_the_values_whatever_length_it_comes_in(mode: str) -> None:
    """The error compared a request with the one input last run on: after lengths 5 then 7,
    a bad id at length 5 was told to send length 7, and at length 9 to fix its shape."""
    with ParallelInference(_Tokens(), workers=1, inference_mode=mode) as pi:
        for length in (5, 7):
            pi.output(torch.zeros(1, length, dtype=torch.int64))
        at_five = pi.submit(torch.full((1, 5), 99)).exception(WAIT)
        at_nine = pi.submit(torch.full((1, 9), 99)).exception(WAIT)
        as_float = pi.submit(torch.full((1, 9), 99.0)).exception(WAIT)
    assert isinstance(at_five, InvalidRequestError)
    assert at_five.received == at_five.expected == "Tensor(N, 5) int64"
    assert "as inputs it has run on, so the values are at fault" in str(at_five)
    assert isinstance(at_nine, InvalidRequestError) and at_nine.received == "Tensor(N, 9) int64"
    assert "has run on Tensor(N, 5) int64, Tensor(N, 7) int64, which differ from it in sizes " \
           "that vary, so the values" in str(at_nine)
    assert isinstance(as_float, InvalidRequestError)  # another dtype: the shape or dtype
    assert "expected Tensor(N, 7) int64 (the input it last ran on)" in str(as_float)


def test_full_queue_blocks_for_the_timeout_then_raises(gate):
    with ParallelInference(GatedScale(gate), workers=1, queue_limit=2,
                           batch_limit=2) as pi, gate:
        held = pi.submit(torch.ones(1, 1))
        assert gate.entered.wait(WAIT)           # the worker holds it: the queue is empty
        queued = [pi.submit(torch.ones(1, 1)) for _ in range(2)]  # now the queue is full
        start = time.monotonic()
        with pytest.raises(QueueFullError, match="queue_limit=2.*for 0.2 s"):
            pi.output(torch.ones(1, 1), timeout=0.2)
        assert time.monotonic() - start >= 0.2
        with pytest.raises(QueueFullError, match="block=False"):
            pi.submit(torch.ones(1, 1), block=False)
        gate.open()
        assert [f.result(WAIT).item() for f in [held, *queued]] == [2.0, 2.0, 2.0]
        stats = pi.stats()
    assert stats["rejections"]["queue_full"] == 2    # refused, so neither accepted nor failed
    assert stats["requests"] == stats["completed"] == 3 and stats["failed"] == 0


def test_a_request_that_outlives_its_timeout_in_the_queue_is_dropped(gate):
    with ParallelInference(GatedScale(gate), workers=1, timeout=WAIT) as pi, gate:
        held = pi.submit(torch.ones(1, 1))
        assert gate.entered.wait(WAIT)
        with pytest.raises(RequestTimeoutError, match="timeout"):
            pi.output(torch.ones(1, 1), timeout=0.05)
        assert pi.stats()["queued"] == 0           # removed, not left for the worker
        gate.open()
        assert held.result(WAIT).item() == 2.0
        stats = pi.stats()
    assert stats["rejections"]["timeout"] == 1
    assert stats["requests"] == 2 and stats["completed"] == 1 and stats["failed"] == 1


def test_a_submitted_request_fails_at_its_deadline_while_the_workers_are_busy(gate):
    with ParallelInference(GatedScale(gate), workers=1, batch_limit=1) as pi, gate:
        held = pi.submit(torch.ones(1, 1))
        assert gate.entered.wait(WAIT)
        late = pi.submit(torch.ones(1, 1), timeout=0.1)
        kept = pi.submit(torch.ones(1, 1) * 3)   # no timeout: waits for the worker
        # The worker is still held: the Future fails on time, and leaves the queue.
        assert isinstance(late.exception(WAIT), RequestTimeoutError)
        assert not gate.opened.is_set() and pi.stats()["queued"] == 1
        gate.open()
        assert held.result(WAIT).item() == 2.0 and kept.result(WAIT).item() == 6.0
        stats = pi.stats()
    assert stats["rejections"]["timeout"] == 1
    assert stats["requests"] == 3 and stats["completed"] == 2 and stats["failed"] == 1


def test_a_cancelled_future_is_skipped(gate):
    with ParallelInference(GatedScale(gate), workers=1) as pi, gate:
        held = pi.submit(torch.ones(1, 1))
        assert gate.entered.wait(WAIT)
        doomed = pi.submit(torch.ones(1, 1))
        assert doomed.cancel()
        gate.open()
        assert pi.output(torch.ones(1, 1)).item() == 2.0
        assert held.result(WAIT).item() == 2.0
        stats = pi.stats()
    assert stats["rejections"]["cancelled"] == 1 and stats["completed"] == 2
    assert stats["requests"] == 3 and stats["failed"] == 1


def test_output_async_from_many_coroutines():
    model = Mixed().eval()
    xs = [torch.randn(1, 3) for _ in range(200)]

    async def main(pi: ParallelInference):
        return await asyncio.gather(*(pi.output_async(x) for x in xs))

    with ParallelInference(model, workers=2, queue_limit=8, batch_limit=8) as pi:
        ys = asyncio.run(main(pi))
        version = asyncio.run(pi.output_async(xs[0], return_version=True))[1]
    for x, y in zip(xs, ys, strict=True):
        torch.testing.assert_close(y, reference(model, x))
    assert version == 1


def test_output_async_times_out_without_blocking_the_loop(gate):
    async def main(pi: ParallelInference):
        with pytest.raises(RequestTimeoutError):
            await pi.output_async(torch.ones(1, 1), timeout=0.05)

    with ParallelInference(GatedScale(gate), workers=1) as pi, gate:
        held = pi.submit(torch.ones(1, 1))
        assert gate.entered.wait(WAIT)
        asyncio.run(main(pi))
        gate.open()
        assert held.result(WAIT).item() == 2.0


class ThreadRecorder(nn.Module):
    """Records which thread ran each forward pass (the list survives deepcopy)."""

    class _Log(list):
        def __deepcopy__(self, memo):
            return self

    def __init__(self) -> None:
        super().__init__()
        self.log = self._Log()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(threading.current_thread().name)
        return x + 1


def test_inplace_runs_on_the_callers_thread_and_workers_on_their_own():
    model = ThreadRecorder()
    with ParallelInference(model, inference_mode="inplace", workers=2) as pi:
        pi.output(torch.zeros(1, 1))
    with ParallelInference(model, inference_mode=InferenceMode.SEQUENTIAL, workers=1) as pi:
        pi.output(torch.zeros(1, 1))
    assert model.log == [threading.current_thread().name, "paraloom-inference-0"]


def test_inplace_with_every_replica_busy_waits_then_raises(gate):
    with ParallelInference(GatedScale(gate), inference_mode="inplace", workers=1) as pi, gate:
        caller = threading.Thread(target=pi.output, args=(torch.ones(1, 1),))
        caller.start()
        assert gate.entered.wait(WAIT)                # the only replica is in use
        # In line past its timeout: a timeout (504 in the server), as in the other modes.
        with pytest.raises(RequestTimeoutError, match="waited 0.05 s for a free replica"):
            pi.output(torch.ones(1, 1), timeout=0.05)
        with pytest.raises(QueueFullError, match="block=False"):
            pi.submit(torch.ones(1, 1), block=False)
        gate.open()
        caller.join(WAIT)
        assert pi.submit(torch.ones(1, 1)).result(0).item() == 2.0   # done before returning
        rejected = pi.stats()["rejections"]
        assert (rejected["timeout"], rejected["queue_full"]) == (1, 1)


def test_inplace_with_the_line_full_raises_queue_full(gate):
    with ParallelInference(GatedScale(gate), inference_mode="inplace", workers=1,
                           queue_limit=1) as pi, gate:
        callers = [threading.Thread(target=pi.output, args=(torch.ones(1, 1),))
                   for _ in range(2)]
        callers[0].start()
        assert gate.entered.wait(WAIT)                # the only replica is in use
        callers[1].start()                            # and the one place in line taken
        deadline = time.monotonic() + WAIT
        while pi._slots._waiting < 1 and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.005)
        with pytest.raises(QueueFullError, match="every replica is busy"):
            pi.output(torch.ones(1, 1), timeout=0.05)
        gate.open()
        for caller in callers:
            caller.join(WAIT)


def test_stats_reports_counts_histogram_percentiles_and_config():
    with ParallelInference(Mixed(), workers=1, queue_limit=8, batch_limit=8) as pi:
        for rows in (1, 2, 3):
            pi.output(torch.ones(rows, 3))
        stats = pi.stats()
    assert stats["requests"] == stats["completed"] == 3 and stats["rows"] == 6
    assert stats["batch_size_histogram"] == {1: 1, 2: 1, 3: 1}
    for key in ("queue_time_ms", "forward_time_ms"):
        assert set(stats[key]) == {"p50", "p90", "p99", "max", "mean", "count"}
        assert stats[key]["count"] == 3 and 0 <= stats[key]["p50"] <= stats[key]["max"]
    assert stats["mode"] == "batched" and stats["workers"] == 1 and stats["model_version"] == 1
    assert set(stats["rejections"]) == {"queue_full", "timeout", "cancelled", "invalid",
                                        "closed", "error"}


@pytest.mark.parametrize("kwargs, error, message", [
    ({"inference_mode": "fast"}, ValueError, "inference_mode='fast' is not known; expected one "
                                             "of 'batched', 'sequential', 'inplace'"),
    ({"workers": 0}, ValueError, "workers=0; expected an int >= 1"),
    ({"batch_limit": 2.5}, TypeError, "batch_limit must be an int; got float"),
    ({"queue_limit": True}, TypeError, "queue_limit must be an int; got bool"),
    ({"timeout": -1}, ValueError, "timeout=-1; expected > 0 seconds"),
    ({"max_wait_ms": "5"}, TypeError, "max_wait_ms must be a number of milliseconds"),
    ({"devices": []}, ValueError, "devices=\\[\\]; expected a device"),
    ({"example_input": torch.ones(1, 7)}, ValueError, "the model failed on example_input"),
    ({"max_wait_ms": float("inf")}, ValueError, "max_wait_ms=inf; expected a finite number"),
    ({"max_wait_ms": float("nan")}, ValueError, "max_wait_ms=nan; expected a finite number"),
    ({"timeout": float("inf")}, ValueError, "timeout=inf; expected a finite number > 0 seconds, "
                                            "or None for no limit"),
    ({"max_wait_ms": float("inf")}, ValueError, "or None for no wait, as 0"),
    ({"timeout": float("nan")}, ValueError, "timeout=nan; expected a finite number"),
])
def test_bad_options_are_refused_at_construction(kwargs, error, message):
    with pytest.raises(error, match=message):
        ParallelInference(MLP(in_features=4), **kwargs)


def test_construction_refuses_a_non_module_and_warns_on_pointless_settings():
    with pytest.raises(TypeError, match="torch.nn.Module; got function"):
        ParallelInference(lambda x: x)
    with pytest.warns(UserWarning, match="max_wait_ms only applies"):
        ParallelInference(Mixed(), inference_mode="sequential", max_wait_ms=5).close()
    with pytest.warns(UserWarning, match="queue_limit=4 < batch_limit=32"):
        ParallelInference(Mixed(), queue_limit=4).close()


class ThreadCount(nn.Module):
    """Returns the torch intra-op thread count of the thread that ran it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full((x.shape[0], 1), float(torch.get_num_threads()))


def test_threads_per_worker_sizes_the_workers_pools_and_leaves_the_callers_alone():
    torch.set_num_threads(2)
    with ParallelInference(ThreadCount(), workers=2, threads_per_worker=1) as pi:
        assert pi.output(torch.ones(1, 1)).item() == 1.0
        assert torch.get_num_threads() == 2
        seen: list[int] = []
        later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        later.start()
        later.join(WAIT)
    assert seen == [2]          # threads started afterwards get the process default back


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_request_timeout_is_refused_with_its_name(bad):
    with ParallelInference(MLP(in_features=4), workers=1) as pi:
        with pytest.raises(ValueError, match="timeout=(inf|nan); expected a finite number"):
            pi.submit(torch.ones(1, 4), timeout=bad)
        with pytest.raises(ValueError, match="expected a finite number"):
            pi.output(torch.ones(1, 4), timeout=bad)
        assert pi.output(torch.ones(1, 4), timeout=WAIT).shape[0] == 1  # still serving


def test_a_huge_max_wait_is_capped_and_a_full_batch_still_runs():
    # max_wait_ms=1e300 once overflowed Condition.wait and killed the worker.
    with ParallelInference(MLP(in_features=4), workers=1, batch_limit=2, queue_limit=2,
                           max_wait_ms=1e300, timeout=1e300) as pi:
        futures = [pi.submit(torch.ones(1, 4), timeout=1e10) for _ in range(2)]
        assert all(f.result(WAIT).shape[0] == 1 for f in futures)  # size closed the batch
        stats = pi.stats()
    assert stats["completed"] == 2 and stats["failed"] == 0
