"""stop() ends a fit after the round in flight; the rounds queued behind it are not trained."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
from training_helpers import Scalar, linear_loss

from paraloom import FitInterrupted, ParallelWrapper, TrainingListener
from paraloom.training.gate import RoundGate
from paraloom.training.interrupts import graceful_interrupt


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
    gate.fetched(0)  # its batch in hand: its model hangs, or it waits in a forward collective
    gate.admit(1, 1)  # rank 1 has no batch yet: hung in its data, named first
    assert gate.stuck([0, 1]) == [1, 0] and gate.without_batch([0, 1]) == [1]


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


@pytest.mark.parametrize("workers", [1, 2])
def test_close_from_another_thread_stops_the_fit_and_then_the_workers(workers):
    """A close() from another thread (a UI's stop button) while fit() runs: the fit stops
    after the round in flight and returns what it trained, then the workers go (they used to
    be pulled from under the fit, which raised "worker 0 exited with code 0")."""
    model = Scalar()
    wrapper = ParallelWrapper(model, step_fn=slow_step, workers=workers, progress=False,
                              optimizer=torch.optim.SGD(model.parameters(), lr=1.0), timeout=60)
    batches = [(torch.ones(1, 1), torch.zeros(1))] * 400  # 200 rounds of 2: 10 s
    wrapper.fit(batches[:4])
    pids = wrapper.worker_pids
    closer = threading.Timer(0.5, wrapper.close)
    closer.start()
    stats = wrapper.fit(batches)
    closer.join(timeout=30)
    assert not closer.is_alive()
    assert 0 < stats["rounds"] < 100, stats
    assert model.w.item() == -(4 // workers) - stats["rounds"]  # what it trained is kept
    assert wrapper.worker_pids == []
    for pid in pids:  # gone, not left running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert wrapper.fit(batches[:4])["rounds"] == 4 // workers  # new workers start
    wrapper.close()


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler for the test, whatever an earlier test left (a SparkContext
    installs one of its own, which fit() leaves alone)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _interrupting_wrapper(model: Scalar, times: int) -> ParallelWrapper:
    """A wrapper whose listener presses Ctrl-C ``times`` times at iteration 1, as a terminal
    does: to this process and to every worker."""
    fired: list[int] = []

    def listener(iteration, epoch, loss):
        if iteration == 1 and not fired:
            fired.append(iteration)
            for _ in range(times):
                for pid in wrapper._pool.pids:  # type: ignore[union-attr]
                    os.kill(pid, signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)

    wrapper = ParallelWrapper(model, step_fn=slow_step,
                              optimizer=torch.optim.SGD(model.parameters(), lr=1.0), workers=2,
                              prefetch_buffer=40, progress=False, listeners=[listener])
    return wrapper


def test_ctrl_c_stops_after_the_round_in_flight_and_keeps_what_was_trained(python_sigint):
    model = Scalar()
    wrapper = _interrupting_wrapper(model, times=1)
    batches = [(torch.ones(1, 1), torch.zeros(1))] * 80  # 40 rounds of 2 workers
    with wrapper:
        with pytest.raises(FitInterrupted, match="model holds the parameters trained so far"):
            wrapper.fit(batches)
        trained = wrapper.stats()["rounds"]
        assert 2 <= trained <= 4
        assert model.w.item() == -trained  # the rounds trained before the stop are kept
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        pids = wrapper._pool.pids  # type: ignore[union-attr]
        stats = wrapper.fit(batches[:4])  # the workers ignored their Ctrl-C: same processes
        assert wrapper._pool.pids == pids  # type: ignore[union-attr]
        assert stats["rounds"] == 2 and model.w.item() == -trained - 2


def test_ctrl_c_while_the_workers_start_stops_the_fit_before_it_trains(python_sigint,
                                                                      monkeypatch):
    """The workers' start (seconds: processes, imports) ran before fit() took Ctrl-C over: a
    Ctrl-C then came out as a bare KeyboardInterrupt from deep in multiprocessing, with a
    forkserver child's traceback, and stats() was {}."""
    model = Scalar()
    wrapper = ParallelWrapper(model, step_fn=slow_step, workers=2, progress=False,
                              optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    start = wrapper._ensure_pool

    def pressed_while_starting():
        os.kill(os.getpid(), signal.SIGINT)  # handled before the next line runs
        return start()

    batches = [(torch.ones(1, 1), torch.zeros(1))] * 8
    with wrapper:
        monkeypatch.setattr(wrapper, "_ensure_pool", pressed_while_starting)
        with pytest.raises(FitInterrupted, match="after 0 iterations"):
            wrapper.fit(batches)
        assert wrapper.stats()["rounds"] == 0 and model.w.item() == 0.0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        monkeypatch.setattr(wrapper, "_ensure_pool", start)
        assert wrapper.fit(batches[:4])["rounds"] == 2 and model.w.item() == -2


def test_a_second_ctrl_c_aborts_at_once_and_leaves_the_model_as_it_was(python_sigint):
    model = Scalar()
    wrapper = _interrupting_wrapper(model, times=2)
    batches = [(torch.ones(1, 1), torch.zeros(1))] * 80
    with wrapper:
        with pytest.raises(KeyboardInterrupt) as raised:
            wrapper.fit(batches)
        assert not isinstance(raised.value, FitInterrupted)
        assert model.w.item() == 0.0 and wrapper._pool is None  # aborted: workers gone
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert wrapper.fit(batches[:4])["rounds"] == 2 and model.w.item() == -2


def test_ctrl_c_is_left_to_a_handler_the_user_installed():
    heard: list[int] = []
    stops: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: heard.append(signum))
    try:
        with graceful_interrupt(lambda: stops.append(1)) as interrupted:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # the handler runs between bytecodes of the main thread
        assert heard == [signal.SIGINT] and stops == [] and not interrupted()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_forkserver_starts_with_ctrl_c_ignored(monkeypatch):
    """It imports torch before it ignores SIGINT itself: a Ctrl-C at the terminal (sent to the
    whole process group) in those seconds killed it, and the next fit() failed with EOFError.
    Started with SIGINT ignored, it inherits that across exec; ours is put back at once."""
    import signal
    from multiprocessing import forkserver

    from paraloom.training.launch import worker_context

    seen = []
    monkeypatch.delenv("PARALOOM_START_METHOD", raising=False)
    monkeypatch.setattr(forkserver, "ensure_running",
                        lambda: seen.append(signal.getsignal(signal.SIGINT)))
    before = signal.getsignal(signal.SIGINT)
    worker_context()
    assert seen == [signal.SIG_IGN]
    assert signal.getsignal(signal.SIGINT) is before


class _Heads(torch.nn.Module):
    """300 linear heads summed: 600 parameters, each trained by every step."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(300))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(head(x) for head in self.heads) / 300


def test_a_ctrl_c_while_the_trained_weights_are_copied_waits_for_the_copy(monkeypatch):
    """A second Ctrl-C that landed while fit() copied the trained weights into the model left
    it half updated: 7 of 600 parameters changed."""
    from torch import nn

    from paraloom.training.wrapper import ParallelWrapper as Wrapper

    adopt = Wrapper._adopt

    def interrupted_adopt(self, *args):
        os.kill(os.getpid(), signal.SIGINT)  # arrives in the middle of the copy
        time.sleep(0.05)
        return adopt(self, *args)

    monkeypatch.setattr(Wrapper, "_adopt", interrupted_adopt)
    torch.manual_seed(0)
    model = _Heads()
    before = [p.detach().clone() for p in model.parameters()]
    # Python's own handler (a SparkContext of an earlier test leaves its own installed).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with ParallelWrapper(model, loss_fn=nn.MSELoss(), workers=2, progress=False,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.5)) as wrapper:
            with pytest.raises(KeyboardInterrupt):
                wrapper.fit([(torch.randn(8, 4), torch.randn(8, 4))] * 4)
    finally:
        signal.signal(signal.SIGINT, previous)
    changed = sum(not torch.equal(p, b) for p, b in zip(model.parameters(), before,
                                                           strict=True))
    assert changed == len(before)  # every parameter got its trained value
