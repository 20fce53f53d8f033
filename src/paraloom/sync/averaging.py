"""Periodic parameter averaging (DL4J's AVERAGING mode)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paraloom.sync.base import StepContext, Synchronizer, is_distributed
from paraloom.sync.collectives import average_tensors_, broadcast_tensors_

__all__ = ["Averaging", "average_tensors_", "optimizer_state_tensors", "trained_share"]

log = logging.getLogger(__name__)


_COUNTERS = frozenset({"step"})
"""Optimizer state entries that count steps (Adam's, Adagrad's, ...): taken from rank 0,
which trains in every round, not averaged (a replica idle in an epoch's last round has
counted one fewer, and a mean of 5 and 6 is not a step count)."""


def trained_share(state: dict[str, Any]) -> float | None:
    """From an ``Averaging.state_dict()``: the share of the rounds since the last averaging
    that its replica trained, the weight the next averaging gives it; None for a state saved
    before these counters were kept."""
    if "trained" not in state or "averaged_at" not in state:
        return None
    return _share(int(state["trained"]), int(state.get("sync_steps", 0)) -
                  int(state["averaged_at"]))


def _share(trained: int, window: int) -> float:
    """``trained`` of the ``window`` rounds since the last averaging, as a fraction (1 for an
    empty window: nothing to weigh)."""
    return min(trained, window) / window if window > 0 else 1.0


def optimizer_state_tensors(optimizer: torch.optim.Optimizer
                            ) -> list[list[tuple[str, torch.Tensor]]]:
    """Per parameter, in a fixed order: its optimizer state tensors (momentum, moments, step),
    each with its key."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            out.append([(k, state[k]) for k in sorted(state)
                        if isinstance(state[k], torch.Tensor)])
    return out


def _densified(optimizer: torch.optim.Optimizer
               ) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    """Make each sparse optimizer state tensor dense (SGD's momentum of a sparse embedding's
    gradient: the collectives take dense tensors, and the replicas' entries differ); returns
    where each was and the sparse tensor, to make the mean sparse again as it was."""
    where = []
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.layout != torch.strided:
                state[key] = value.to_dense()
                where.append((state, key, value))
    return where


def _sparse_like(dense: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``dense`` in ``like``'s sparse layout (a COO tensor's sparse dimensions too)."""
    if like.layout == torch.sparse_coo:
        return dense.to_sparse(like.sparse_dim())
    return dense.to_sparse(layout=like.layout, dense_dim=like.dense_dim())


def _model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The parameters that train and every buffer: a frozen parameter is the same on every
    replica (averaging it would cost its bytes and could move it by a rounding error)."""
    return [p.data for p in model.parameters() if p.requires_grad] + list(model.buffers())


class Averaging(Synchronizer):
    """Every ``frequency`` rounds, replace each replica's parameters by the replicas' mean.

    With ``average_updaters`` the optimizer state (momentum, Adam moments) is averaged too, as
    DL4J does by default; without it each replica keeps its own. ``finish`` averages once more
    when rounds ran since the last averaging, so no worker's last steps are thrown away.

    Each replica counts in proportion to the rounds it trained since the last averaging: one
    idle in an epoch's short last round (or whose stream has ended) is left out, as DL4J
    leaves it out, where a plain mean would pull the average back towards its stale weights.
    Where every replica trained every round the mean is the plain one, bit for bit.
    """

    name = "averaging"

    def __init__(self, frequency: int = 1, average_updaters: bool = True) -> None:
        super().__init__()
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise ValueError(f"averaging_frequency={frequency!r}; expected an int >= 1 "
                             "(1 averages after every round)")
        if not isinstance(average_updaters, bool):
            raise TypeError(f"average_updaters={average_updaters!r}; expected True (the "
                            "optimizer state is averaged too) or False")
        self.frequency = frequency
        self.average_updaters = average_updaters
        self.averagings = 0
        self._trained = 0
        """Rounds trained (not idle) since the last averaging."""
        self._averaged_at = 0
        """``sync_steps`` at the last averaging."""

    def setup(self, ctx: StepContext) -> None:
        self.sync_steps = 0
        self.bytes_sent = 0
        self.averagings = 0
        self._trained = 0
        self._averaged_at = 0

    def after_step(self, ctx: StepContext) -> None:
        self._trained += 1
        self._tick(ctx)

    def idle_step(self, ctx: StepContext) -> None:
        self._tick(ctx)

    def _tick(self, ctx: StepContext) -> None:
        self.sync_steps += 1
        if self.synchronized():
            self.average(ctx)

    def synchronized(self) -> bool:
        return self.sync_steps % self.frequency == 0

    def finish(self, ctx: StepContext) -> None:
        if not self.synchronized():
            self.average(ctx)

    def average(self, ctx: StepContext) -> None:
        """Average parameters and buffers (and optimizer state if asked) across replicas,
        each weighted by the share of the rounds since the last averaging that it trained.

        One pipelined pass over all of them (see ``average_tensors_``).
        """
        share = _share(self._trained, self.sync_steps - self._averaged_at)
        self._trained, self._averaged_at = 0, self.sync_steps
        if not is_distributed(ctx):
            return
        self.averagings += 1
        tensors, counters, sparse = _model_tensors(ctx.model), [], []
        if self.average_updaters:
            sparse = _densified(ctx.optimizer)
            entries = self._common_optimizer_state(ctx)
            tensors += [t for key, t in entries if key not in _COUNTERS]
            counters = [t for key, t in entries if key in _COUNTERS]
        self.bytes_sent += average_tensors_(tensors, ctx.group, ctx.world_size, ctx.device,
                                            share=share)
        if counters:
            self.bytes_sent += broadcast_tensors_(counters, ctx.group, ctx.world_size,
                                                  ctx.device)
        for state, key, like in sparse:  # the mean, sparse again
            state[key] = _sparse_like(state[key], like)

    def _common_optimizer_state(self, ctx: StepContext) -> list[tuple[str, torch.Tensor]]:
        """The optimizer state tensors (with their keys) of the parameters whose state every
        replica holds."""
        per_param = optimizer_state_tensors(ctx.optimizer)
        # A parameter that got no gradient on some replica has no state there (a routed or
        # multi-task model): average only parameters whose state every replica holds.
        counts = torch.tensor([len(t) for t in per_param], dtype=torch.int64, device=ctx.device)
        both = torch.cat([counts, -counts])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=ctx.group)
        self.bytes_sent += Synchronizer.collective_bytes(both, ctx.world_size)
        most, least = both[:len(counts)], -both[len(counts):]
        tensors = [t for i, ts in enumerate(per_param) if most[i] == least[i] for t in ts]
        if len(tensors) < sum(len(ts) for ts in per_param):
            log.debug("optimizer state missing on some replica for some parameters; those "
                      "are not averaged this time")
        return tensors

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "averagings": float(self.averagings)}

    def config(self) -> dict[str, Any]:
        """The settings: ``frequency`` and ``average_updaters``."""
        return {"frequency": self.frequency, "average_updaters": self.average_updaters}

    def state_dict(self) -> dict[str, Any]:
        """The counters, with the number of averagings so far and the rounds trained since
        the last one."""
        return {**super().state_dict(), "averagings": self.averagings,
                "trained": self._trained, "averaged_at": self._averaged_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s counters (the next averaging falls where it would
        have)."""
        super().load_state_dict(state)
        self.averagings = int(state.get("averagings", 0))
        # A checkpoint from before these counters: every replica trained the whole window.
        self._averaged_at = int(state.get("averaged_at", self.sync_steps
                                         - self.sync_steps % self.frequency))
        self._trained = int(state.get("trained", self.sync_steps - self._averaged_at))
