"""stop() ends a fit after the round in flight; the rounds queued behind it are not trained."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
from training_helpers import Scalar, linear_loss

from paraloom import ParallelWrapper, TrainingListener
from paraloom.training.gate import RoundGate


def slow_step(model, batch):
    """Scalar's step, slow enough that rounds queue up behind the one in flight."""
    time.sleep(0.05)
    x, _ = batch
    return model(x).mean()  # d/dw = mean(x) = 1: each trained round moves w by -1


def test_the_gate_halts_after_the_last_round_started():
    gate = RoundGate.create(multiprocessing.get_context("spawn"), 2)
    assert gate.admit(0, 0) and gate.admit(0, 1) and gate.admit(1, 0)
    assert gate.halt() == 1  # worker 0 is in round 1: worker 1 must train it too
    assert gate.admit(1, 1) and not gate.admit(1, 2) and not gate.admit(0, 2)
    gate.reset()  # the next fit()
    assert gate.admit(0, 5)
    assert gate.halt(3) == 3 and not gate.admit(1, 4)


def test_the_gate_tells_a_worker_stuck_in_its_step_from_one_waiting():
    gate = RoundGate.create(multiprocessing.get_context("spawn"), 2)
    assert gate.stuck([0, 1]) == []  # nothing started
    gate.admit(0, 0)
    gate.admit(1, 0)
    gate.computed(0)  # worker 0 has its loss and waits in a collective; worker 1 does not
    assert gate.stuck([0, 1]) == [1]
    gate.computed(1)
    assert gate.stuck([0, 1]) == []
    gate.admit(0, 1)
    assert gate.stuck([0, 1]) == [0]


def test_stop_skips_the_queued_rounds():
    model = Scalar()
    iterations: list[int] = []

    def listener(iteration, epoch, loss):
        iterations.append(iteration)
        if iteration == 1:
            wrapper.stop()

    wrapper = ParallelWrapper(model, step_fn=slow_step,
                              optimizer=torch.optim.SGD(model.parameters(), lr=1.0), workers=2,
                              prefetch_buffer=40, progress=False, listeners=[listener])
    batches = [(torch.ones(1, 1), torch.zeros(1))] * 80  # 40 rounds of 2 workers
    with wrapper:
        stats = wrapper.fit(batches)
        trained = stats["rounds"]
        # round 1 completed, rounds started meanwhile finish; of the ~20 queued, none runs
        assert 2 <= trained <= 4, stats
        assert iterations == list(range(trained))
        assert stats["samples"] == 2 * trained
        assert model.w.item() == -trained  # exactly the trained rounds moved the weight
        # the wrapper trains again after a stop
        stats = wrapper.fit(batches[:4])
        assert stats["rounds"] == 2 and model.w.item() == -trained - 2


def test_stop_skips_rounds_dealt_before_it_also_at_the_end_of_a_fit():
    """A small fit is dealt whole before the first reply: a stop() then still skips the rest,
    also when called at the end of an epoch."""
    model = Scalar()
    iterations: list[int] = []

    class StopAfterFirstEpoch(TrainingListener):
        def on_iteration(self, iteration, epoch, loss):
            iterations.append(iteration)

        def on_epoch_end(self, epoch, loss):
            if epoch == 0:
                wrapper.stop()

    wrapper = ParallelWrapper(model, step_fn=slow_step,
                              optimizer=torch.optim.SGD(model.parameters(), lr=1.0), workers=2,
                              prefetch_buffer=40, progress=False,
                              listeners=[StopAfterFirstEpoch()])
    batches = [(torch.ones(1, 1), torch.zeros(1))] * 4  # 2 rounds an epoch
    with wrapper:
        stats = wrapper.fit(batches, epochs=5)
    # on_epoch_end(0) runs once epoch 0's two rounds are done and before epoch 1's are dealt:
    # nothing of epoch 1 trains.
    trained = stats["rounds"]
    assert trained == 2 and iterations == [0, 1], (stats, iterations)
    assert model.w.item() == -trained


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("call", ["fit", "close"])
def test_fit_or_close_from_a_listener_is_refused_and_the_wrapper_trains_on(workers, call):
    model = Scalar()
    batches = [(torch.ones(1, 1), torch.zeros(1))] * 8

    def listener(iteration, epoch, loss):
        if iteration == 1:
            wrapper.fit(batches[:2]) if call == "fit" else wrapper.close()

    wrapper = ParallelWrapper(model, loss_fn=linear_loss, workers=workers, progress=False,
                              optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                              listeners=[listener], timeout=60)
    with wrapper:
        with pytest.raises(RuntimeError, match=rf"^{call}\(\) was called while fit\(\) is "
                                               r"running \(from a listener.*wrapper\.stop\(\)"):
            wrapper.fit(batches)
        wrapper.listeners.clear()
        before = model.w.item()
        stats = wrapper.fit(batches[:4])
        assert stats["rounds"] == 4 // workers and model.w.item() == before - 4 // workers
