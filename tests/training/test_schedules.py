"""Optimizer settings that listeners change during a fit (a scheduler's step) reach the replicas.

``Scalar`` with ``linear_loss`` and inputs of 1: each round moves w by minus the learning rate
(the mean of the replicas' equal gradients), so w tells which learning rate each round used.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from training_helpers import Scalar, linear_loss, make_weight_reporting

from paraloom import ParallelWrapper, TrainingListener

pytestmark = pytest.mark.timeout(120)

ONES = [(torch.ones(1, 1), torch.zeros(1))] * 4  # 2 rounds an epoch with 2 workers


class StepPerEpoch(TrainingListener):
    """Steps a torch scheduler in on_epoch_end, as a Lightning user's epoch schedule does."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler
        self.events: list[tuple[str, int]] = []

    def on_epoch_start(self, epoch: int) -> None:
        self.events.append(("start", epoch))

    def on_iteration(self, iteration: int, epoch: int, loss: float) -> None:
        self.events.append(("round", epoch))

    def on_epoch_end(self, epoch: int, loss: float) -> None:
        self.events.append(("end", epoch))
        self.scheduler.step()


@pytest.mark.parametrize(("workers", "mode"), [(1, "averaging"), (2, "allreduce"),
                                               (2, "averaging")])
def test_a_scheduler_stepped_at_each_epoch_end_sets_the_next_epochs_rate(workers, mode) -> None:
    model = Scalar()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    listener = StepPerEpoch(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    rounds = len(ONES) // workers  # per epoch
    with ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, workers=workers,
                         training_mode=mode, progress=False, listeners=[listener]) as wrapper:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing to warn about: epoch-end steps are exact
            wrapper.fit(ONES, epochs=3)
        # Epochs at 1, 0.5 and 0.25: not 3 epochs at 1, as when the replicas never heard.
        assert model.w.item() == -rounds * (1 + 0.5 + 0.25)
        # The user's optimizer keeps the last epoch's step (it applies from the next fit).
        assert opt.param_groups[0]["lr"] == 0.125
        assert listener.events == [e for epoch in range(3) for e in
                                   [("start", epoch)] + [("round", epoch)] * rounds
                                   + [("end", epoch)]]
        wrapper.fit(ONES, epochs=1)
        assert model.w.item() == -rounds * (1.75 + 0.125)
        assert opt.param_groups[0]["lr"] == 0.0625


def test_a_rate_set_in_on_epoch_start_applies_to_that_epoch() -> None:
    model = Scalar()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)

    class Warmup(TrainingListener):
        def on_epoch_start(self, epoch: int) -> None:
            opt.param_groups[0]["lr"] = [0.25, 0.5, 1.0][epoch]

    with ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, workers=2,
                         training_mode="allreduce", progress=False,
                         listeners=[Warmup()]) as wrapper:
        wrapper.fit(ONES, epochs=3)
    assert model.w.item() == -2 * (0.25 + 0.5 + 1.0)


def test_a_rate_changed_within_an_epoch_warns_and_applies_at_the_next_epoch() -> None:
    model = Scalar()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)

    class PerRound(TrainingListener):
        def on_iteration(self, iteration: int, epoch: int, loss: float) -> None:
            opt.param_groups[0]["lr"] = 0.5

    with ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, workers=2,
                         training_mode="allreduce", progress=False, prefetch_buffer=2,
                         listeners=[PerRound()]) as wrapper:
        with pytest.warns(UserWarning, match=r"\['lr'\] changed during an epoch"):
            wrapper.fit(ONES, epochs=2)
    # Epoch 0 at 1.0 throughout (its rounds were dealt before), epoch 1 at 0.5.
    assert model.w.item() == -2 * 1.0 - 2 * 0.5


def test_stop_in_on_epoch_start_trains_nothing_of_that_epoch() -> None:
    model = Scalar()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    events: list[tuple[str, int]] = []

    class StopAtSecondEpoch(TrainingListener):
        def on_epoch_start(self, epoch: int) -> None:
            events.append(("start", epoch))
            if epoch == 1:
                wrapper.stop()

        def on_epoch_end(self, epoch: int, loss: float) -> None:
            events.append(("end", epoch))

    wrapper = ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, workers=2,
                              progress=False, listeners=[StopAtSecondEpoch()])
    with wrapper:
        stats = wrapper.fit(ONES, epochs=3)
    assert stats["rounds"] == 2 and model.w.item() == -2.0
    assert events == [("start", 0), ("end", 0), ("start", 1), ("end", 1)]



def _halving(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)


@pytest.mark.parametrize(("workers", "mode"), [(1, "averaging"), (2, "allreduce"),
                                               (2, "averaging"), (2, "shared_gradients")])
def test_lr_scheduler_steps_after_every_round_on_every_replica(workers, mode) -> None:
    # Round k trains at 0.5 ** k: w = -(1 + 0.5 + 0.25 + 0.125) after 4 rounds.
    model = Scalar()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    batches = ONES[: 2 * workers] if workers == 2 else ONES[:2]
    with ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, workers=workers,
                         training_mode=make_weight_reporting(mode), progress=False,
                         lr_scheduler=_halving) as wrapper:
        stats = wrapper.fit(batches, epochs=2)
        assert model.w.item() == -1.875
        assert opt.param_groups[0]["lr"] == 0.0625  # where the schedule stands after round 4
        replicas = [r["weights"] for r in stats["per_worker"]]
        assert all(r == replicas[0] for r in replicas)
        wrapper.fit(batches[:workers], epochs=1)  # a new fit restarts the schedule
        assert model.w.item() == -1.875 - 1.0


def test_lr_scheduler_steps_in_idle_rounds_too() -> None:
    # 3 batches a epoch with 2 workers: round 2 has one idle replica. Both step the schedule,
    # so round 3 (epoch 1's first) trains at 0.125 on both: the replicas stay identical.
    model = Scalar()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, workers=2,
                         training_mode=make_weight_reporting("allreduce"), progress=False,
                         lr_scheduler=_halving) as wrapper:
        stats = wrapper.fit(ONES[:3], epochs=2)
    # allreduce averages an idle replica's zero gradient in: round 2 moves w by 0.5 * 0.5.
    assert model.w.item() == -(1 + 0.25 + 0.25 + 0.0625)
    first, second = (r["weights"] for r in stats["per_worker"])
    assert first == second


def test_a_scheduler_object_or_a_bad_factory_is_refused_where_the_wrapper_is_built() -> None:
    """Refused in the constructor, built once on a stand-in optimizer: before, a
    ReduceLROnPlateau or a scheduler on the user's own optimizer failed in each worker once
    the pool had started."""
    model = Scalar()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(TypeError, match="expected a function that builds the scheduler"):
        ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, workers=1,
                        lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    for factory, error, message in [
            (lambda o: 0.1, TypeError, "lr_scheduler returned float"),
            (torch.optim.lr_scheduler.ReduceLROnPlateau, TypeError,
             "ReduceLROnPlateau, which steps on a metric"),
            (lambda o: torch.optim.lr_scheduler.StepLR(opt, 1), ValueError,
             "built its scheduler on another optimizer")]:
        for optimizer in (opt, lambda params: torch.optim.Adam(params, lr=0.1)):
            with pytest.raises(error, match=message):
                ParallelWrapper(model, loss_fn=linear_loss, optimizer=optimizer, workers=2,
                                lr_scheduler=factory)
    fresh = torch.optim.SGD(model.parameters(), lr=1.0)
    ParallelWrapper(model, loss_fn=linear_loss, optimizer=fresh, workers=2,
                    lr_scheduler=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 5.0, 10))
    assert fresh.param_groups[0]["lr"] == 1.0 and "initial_lr" not in fresh.param_groups[0]
    # Refused, the user's optimizer is left as it was (the probe had set lr and initial_lr).
    mine = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="on another optimizer"):
        ParallelWrapper(model, loss_fn=linear_loss, optimizer=mine, workers=2,
                        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(
                            mine, lambda e: 0.5))
    assert mine.param_groups[0]["lr"] == 0.1 and "initial_lr" not in mine.param_groups[0]
    assert "step" not in vars(mine)  # the scheduler's wrapper of step is gone too


def test_the_schedule_probe_leaves_a_factorys_tensor_learning_rate_alone() -> None:
    """The probe built the schedule on the factory's own lr tensor: LambdaLR's first step
    halved it in the closure, so the workers trained at a quarter of the rate."""
    lr = torch.tensor(1.0)
    model = Scalar()
    with ParallelWrapper(model, loss_fn=linear_loss, workers=1, progress=False,
                         optimizer=lambda p: torch.optim.SGD(p, lr=lr),
                         lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(
                             o, lambda e: 0.5)) as wrapper:
        assert lr.item() == 1.0
        wrapper.fit(ONES[:1])
    assert model.w.item() == -0.5  # one step at 1.0 * 0.5
