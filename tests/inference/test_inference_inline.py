"""submit(inline_under=): an idle pool runs a fast request on the calling thread, safely."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from inference_helpers import WAIT, Gate, GatedScale
from torch import nn

from paraloom.inference import InvalidRequestError, ParallelInference

BUDGET = 0.05  # seconds: far above a Linear(8, 2)'s forward, far below a held gate's


class Recording(nn.Module):
    """y = x @ W; records the thread of each call and fails if one replica is entered twice."""

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)
        self.seconds = seconds
        self.threads: list[str] = []
        self._running = 0
        self.overlaps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._running += 1
        self.overlaps += self._running > 1
        self.threads.append(threading.current_thread().name)
        if self.seconds:
            time.sleep(self.seconds)
        try:
            return self.lin(x)
        finally:
            self._running -= 1


def _replicas(pool: ParallelInference) -> list[Recording]:
    return pool._generation.replicas  # type: ignore[return-value]


def test_an_idle_pool_runs_a_known_fast_shape_on_the_calling_thread() -> None:
    model = Recording()
    x = torch.randn(3, 8)
    with ParallelInference(model, workers=2) as pool:
        first = pool.submit(x, inline_under=BUDGET)
        assert torch.allclose(first.result(WAIT), model(x))  # unknown cost: a worker ran it
        second = pool.submit(x, inline_under=BUDGET)
        assert second.done()  # ran before submit returned
        assert torch.equal(second.result(), first.result())
        ran = [t for r in _replicas(pool) for t in r.threads]
        stats = pool.stats()
    assert ran[0].startswith("paraloom-inference") and ran[1] == threading.current_thread().name
    assert stats["completed"] == 2 and stats["batches"] == 2


@pytest.mark.parametrize("options, x, under", [
    ({}, torch.randn(3, 8), 1e-9),                             # slower than the budget
    ({}, torch.randn(30_000, 8), 0.0005),                      # 10,000x the rows timed
    ({"max_wait_ms": 5.0}, torch.randn(3, 8), BUDGET),         # the user asked for batches
    ({"threads_per_worker": 1}, torch.randn(3, 8), BUDGET),    # a thread size to honour
    ({"inference_mode": "sequential"}, torch.randn(3, 8), None),  # not asked
])
def test_a_request_goes_to_a_worker_unless_every_condition_holds(options, x, under) -> None:
    model = Recording()
    with ParallelInference(model, workers=1, **options) as pool:
        pool.submit(x[:3]).result(WAIT)
        future = pool.submit(x, inline_under=under)
        assert torch.allclose(future.result(WAIT), model(x), atol=1e-6)
        ran = _replicas(pool)[0].threads
    assert ran == ["paraloom-inference-0"] * 2


def test_a_busy_pool_queues_instead_of_running_inline() -> None:
    gate = Gate(holds=0)
    model = GatedScale(gate)
    with ParallelInference(model, workers=1) as pool, gate:
        pool.submit(torch.ones(1, 2)).result(WAIT)  # timed: fast
        gate.hold_next()
        held = pool.submit(torch.ones(1, 2))        # the gate holds the only worker
        assert gate.entered.wait(WAIT)
        queued = pool.submit(torch.ones(1, 2), inline_under=BUDGET)
        assert not queued.done()  # the only replica is busy: it waits its turn
        gate.open()
        assert torch.equal(queued.result(WAIT), torch.full((1, 2), 2.0))
        assert held.result(WAIT) is not None


def test_a_worker_never_shares_a_replica_with_an_inline_caller() -> None:
    model = Recording(seconds=0.001)
    xs = [torch.randn(2, 8) for _ in range(200)]
    with ParallelInference(model, workers=2) as pool:
        pool.submit(xs[0]).result(WAIT)
        results: dict[int, torch.Tensor] = {}

        def caller(start: int) -> None:
            for i in range(start, len(xs), 4):
                results[i] = pool.submit(xs[i], inline_under=BUDGET).result(WAIT)

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        replicas = _replicas(pool)
        stats = pool.stats()
    assert sum(r.overlaps for r in replicas) == 0
    ran = [t for r in replicas for t in r.threads]
    assert any(t.startswith("Thread") for t in ran) and any(t.startswith("paraloom") for t in ran)
    assert len(results) == len(xs)
    for i, x in enumerate(xs):
        assert torch.allclose(results[i], model.lin(x)), i
    assert stats["completed"] == len(xs) + 1 and stats["failed"] == 0


class NanRefusing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.isnan(x).any():
            raise ValueError("NaN in the input")
        return self.lin(x)


def test_a_request_that_fails_inline_fails_alone_and_the_pool_goes_on() -> None:
    model = NanRefusing()
    x = torch.randn(1, 8)
    with ParallelInference(model, workers=1) as pool:
        pool.submit(x).result(WAIT)
        bad = pool.submit(torch.full((1, 8), float("nan")), inline_under=BUDGET)
        assert bad.done()
        with pytest.raises(InvalidRequestError, match="failed on this request alone"):
            bad.result()
        good = pool.submit(x, inline_under=BUDGET)
        assert good.done() and torch.allclose(good.result(), model(x))
        assert pool.stats()["failed"] == 1
