"""What a pool of workers is built with and a running fit() cannot change in them: the layout.

The replicas' models are pickled copies of the user's model and their optimizers are built
from the user's param groups as the workers start, so which parameters train
(``requires_grad``) and the param groups are fixed for the workers' life. A warm fit() whose
layout changed restarts them; a change made by a listener during a fit is found as the next
epoch starts (``FitRun``), where the fit stops and says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Layout", "relaid_error"]


@dataclass(frozen=True)
class Layout:
    """Which of the model's parameters train, and the parameters of each of the optimizer's
    param groups (indices into ``model.parameters()``, -1 for a tensor not among them)."""

    trainable: tuple[bool, ...]
    groups: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Layout:
        """The layout ``model`` and ``optimizer`` (None: a factory's, built by each replica)
        have now."""
        params = list(model.parameters())
        index = {id(p): i for i, p in enumerate(params)}
        groups = () if optimizer is None else tuple(
            tuple(index.get(id(p), -1) for p in g["params"]) for g in optimizer.param_groups)
        return cls(tuple(p.requires_grad for p in params), groups)

    def changes(self, now: Layout, model: nn.Module) -> str | None:
        """What differs in ``now`` (the same model's later layout), in words, or None."""
        said: list[str] = []
        names = [name for name, _ in model.named_parameters()]
        for was, name, trains in zip(self.trainable, names, now.trainable, strict=False):
            if was != trains:
                said.append(f"{name} {'now trains' if trains else 'is now frozen'}")
        if len(self.trainable) != len(now.trainable):
            said.append(f"the model has {len(now.trainable)} parameters (it had "
                        f"{len(self.trainable)})")
        if len(said) > 3:
            said[3:] = [f"and {len(said) - 3} more parameters' requires_grad"]
        if len(self.groups) != len(now.groups):
            said.append(f"the optimizer has {len(now.groups)} param groups (it had "
                        f"{len(self.groups)})")
        elif self.groups != now.groups:
            said.append("the optimizer's param groups hold other parameters")
        return "; ".join(said) or None


def relaid_error(epoch: int, change: str, epochs: int) -> ValueError:
    """The error of a fit stopped as ``epoch`` began because a listener changed what trains."""
    return ValueError(
        f"a listener changed what trains during fit(): {change}. The workers were built with "
        f"the parameters and param groups the fit began with, so it stopped as epoch {epoch} "
        f"began, with the epochs before it trained into the model and the optimizer. Go on "
        f"with fit(data, epochs={epochs}, initial_epoch={epoch}): the workers restart with the "
        "change. (Freeze, unfreeze or add param groups between fits, e.g. one fit per stage.)")
