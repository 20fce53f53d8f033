"""What a model handed to ``ParallelWrapper`` must be, checked before any worker starts."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.nn.parameter import is_lazy

__all__ = ["check_user_model"]


def check_user_model(model: object) -> None:
    """Raise ``TypeError`` for a model paraloom cannot replicate as it is: not a module, one
    already wrapped for data parallelism (DDP, DataParallel: paraloom places the replicas
    itself), or one with lazy parameters whose shapes are not known yet."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if isinstance(model, DistributedDataParallel | DataParallel):
        raise TypeError(f"model is a {type(model).__name__}: paraloom replicates the model "
                        "itself (training_mode='allreduce' runs DDP inside each worker); pass "
                        "the wrapped module, model.module")
    lazy = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
            if is_lazy(t)]
    if lazy:
        raise TypeError(f"{type(model).__name__} has lazy tensors whose shapes are not known "
                        f"yet ({lazy[:4]}): run one forward pass on an example batch first "
                        "(model(x)), then hand it to ParallelWrapper")
