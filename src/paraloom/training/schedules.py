"""Learning-rate schedules: the ``lr_scheduler`` factory each replica builds its scheduler with,
checked once where the wrapper is built (on a stand-in optimizer) and again on each replica."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from paraloom.training.optim import OptimizerSpec

__all__ = ["SchedulerFactory", "build_scheduler", "check_scheduler_factory"]


SchedulerFactory = Callable[[torch.optim.Optimizer], LRScheduler]
"""``lr_scheduler(optimizer) -> scheduler``, e.g. ``lambda opt: OneCycleLR(opt, 0.1, 1000)``."""


def check_scheduler_factory(factory: SchedulerFactory | None, optimizer: OptimizerSpec,
                            model: nn.Module, user_optimizer: torch.optim.Optimizer | None
                            ) -> None:
    """Build ``factory``'s scheduler once, on a stand-in of the replicas' optimizer, so that one
    they would refuse (a ReduceLROnPlateau, no scheduler, one on another optimizer) is refused
    where the wrapper is built, not once the workers have started. A factory that fails on the
    stand-in is left to the replicas, whose own build names the error. A factory that builds
    on ``user_optimizer`` itself (refused) leaves it as it was."""
    if factory is None:
        return
    with _restored(user_optimizer):
        try:
            probe = optimizer.stand_in(model)
            scheduler = factory(probe)
        except Exception:  # noqa: BLE001 - the replicas build it again and report what failed
            return
    _check_scheduler(scheduler, probe)


@contextlib.contextmanager
def _restored(optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """``optimizer``'s settings (and its ``step``, which a scheduler wraps) put back after."""
    if optimizer is None:
        yield
        return
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    tensors = {id(v): v.detach().clone() for g in settings for v in g.values()
               if isinstance(v, torch.Tensor)}  # a tensor lr: the same object, its value back
    attributes = dict(vars(optimizer))
    try:
        yield
    finally:
        with torch.no_grad():
            for group, saved in zip(optimizer.param_groups, settings, strict=False):
                for key in [k for k in group if k != "params" and k not in saved]:
                    del group[key]  # initial_lr, which a scheduler adds
                group.update(saved)
                for value in saved.values():
                    if isinstance(value, torch.Tensor):
                        value.copy_(tensors[id(value)])
        for key in [k for k in vars(optimizer) if k not in attributes]:
            delattr(optimizer, key)  # the scheduler's wrapped step, its counters
        vars(optimizer).update(attributes)


def build_scheduler(factory: SchedulerFactory, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """A replica's scheduler: ``factory(optimizer)``, refused (TypeError, ValueError) unless it
    is an ``LRScheduler`` built on ``optimizer``."""
    scheduler = factory(optimizer)
    _check_scheduler(scheduler, optimizer)
    return scheduler


def _check_scheduler(scheduler: object, optimizer: torch.optim.Optimizer) -> None:
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError("lr_scheduler returned a ReduceLROnPlateau, which steps on a metric, "
                        "not after every round: run one fit() per epoch (fit(data, epochs=e "
                        "+ 1, initial_epoch=e)), score your model after each and step it "
                        "there (see the listeners guide)")
    if not isinstance(scheduler, LRScheduler):
        raise TypeError(f"lr_scheduler returned {type(scheduler).__name__}; expected a "
                        f"torch.optim.lr_scheduler.LRScheduler built on the optimizer it is "
                        f"given (e.g. lambda opt: OneCycleLR(opt, max_lr=0.1, total_steps=N)). "
                        f"ReduceLROnPlateau needs a metric: step it between one-epoch fits")
    if scheduler.optimizer is not optimizer:
        raise ValueError("lr_scheduler built its scheduler on another optimizer; expected one "
                         "on the optimizer it is given: lambda opt: StepLR(opt, ...)")
