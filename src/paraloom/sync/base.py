"""The Synchronizer protocol: hooks around one replica's training step.

Every launcher runs the same replica loop (``paraloom.training.replica``); a synchronizer is
what keeps the replicas consistent. One synchronizer object lives in each replica (worker
process, Spark task, or the calling process when ``workers=1``). The loop calls, for each round:

    sync.before_step(ctx)                 # before forward
    loss = forward + backward             # through ctx.model, which wrap_model may replace
    sync.after_backward(ctx)              # gradients are in p.grad
    ctx.clip_gradients()                  # with gradient_clip_val
    optimizer.step()                      # may be skipped by a synchronizer (see below)
    sync.after_step(ctx)                  # parameters updated

or, when this replica got no batch in a partial last round, ``sync.idle_step(ctx)`` instead,
so that every replica makes the same collective calls in the same order. At the end of
``fit()`` the loop calls ``sync.finish(ctx)``: after it, every replica must hold the same
parameters.

Subclass ``Synchronizer`` and pass an instance as ``training_mode=`` to ``ParallelWrapper``
for your own scheme. The instance is pickled into every worker, so keep
its constructor arguments picklable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paraloom.clipping import GradientClipping

__all__ = ["Synchronizer", "StepContext", "NoSync"]


@dataclass
class StepContext:
    """What a synchronizer may see and touch in its replica."""

    model: nn.Module
    """The replica's model (the unwrapped module: its parameters are the replica's)."""
    optimizer: torch.optim.Optimizer
    group: dist.ProcessGroup | None = None
    """The torch.distributed process group, or None when training in one process."""
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    step: int = 0
    """Optimizer steps completed in this fit() before the current round (idle rounds count
    too; with gradient accumulation the rounds of one step share the value)."""
    skip_optimizer_step: bool = False
    """Set by ``after_backward`` to tell the loop not to call ``optimizer.step()``."""
    scaler: torch.amp.GradScaler | None = None
    """The replica's ``torch.amp.GradScaler`` with precision="16-mixed", else None: a
    synchronizer that steps the optimizer itself must go through it."""
    clipping: GradientClipping | None = None
    """``gradient_clip_val`` / ``gradient_clip_algorithm``, or None."""

    def clip_gradients(self) -> None:
        """Clip the gradients as ``clipping`` says (unscaled first under a GradScaler). The loop
        calls it before ``optimizer.step()``; a synchronizer that steps the optimizer itself
        calls it first, so every replica steps with gradients clipped alike."""
        if self.clipping is None:
            return
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        self.clipping.clip_(self.optimizer)


class Synchronizer:
    """Base class: every hook is a no-op. Override what your scheme needs."""

    name = "custom"

    def __init__(self) -> None:
        self.bytes_sent = 0
        """Bytes this replica has sent to its peers so far, as counted by the synchronizer."""
        self.sync_steps = 0
        """Rounds seen (stepped or idle) since setup."""

    # -- lifecycle ---------------------------------------------------------------------------
    takes_complex = True
    """Whether this synchronizer trains complex parameters (``check_model`` refuses them
    otherwise)."""

    def check_model(self, model: nn.Module) -> None:
        """Raise ``ValueError`` for a model this synchronizer's options cannot train; called
        when ``ParallelWrapper`` is built, before any worker starts. The default refuses
        complex parameters unless ``takes_complex``."""
        if not self.takes_complex and any(p.is_complex() for p in model.parameters()
                                          if p.requires_grad):
            raise ValueError(f"training_mode={self.name!r} takes real parameters; the model "
                             "has complex ones (train it with 'allreduce' or 'averaging')")

    def setup(self, ctx: StepContext) -> None:
        """Called once per fit() before the first step, after the process group exists."""

    def wrap_model(self, model: nn.Module, ctx: StepContext) -> nn.Module:
        """Return the module to run forward/backward through (e.g. a DDP wrapper)."""
        return model

    def run_step_fn(self, step_fn: Callable[[nn.Module, Any], Any], module: nn.Module,
                    batch: Any, ctx: StepContext) -> Any:
        """Compute a ``step_fn=`` loss; ``module`` is what ``wrap_model`` returned.

        The default calls ``step_fn(module, batch)``. A synchronizer whose wrapper must see the
        forward (DDP does) overrides it to give ``step_fn`` the user's own module (``ctx.model``)
        and run it inside the wrapper's forward, as ``AllReduce`` does.
        """
        return step_fn(module, batch)

    def finish(self, ctx: StepContext) -> None:
        """Called at the end of fit(); afterwards every replica must hold the same parameters."""

    # -- per step ----------------------------------------------------------------------------
    def before_step(self, ctx: StepContext) -> None:
        """Before forward."""

    def after_backward(self, ctx: StepContext) -> None:
        """Gradients are ready in ``p.grad``; the optimizer has not stepped yet."""

    def accumulating(self, ctx: StepContext) -> AbstractContextManager[object]:
        """The context of a backward whose gradients only add up (gradient accumulation: no
        ``after_backward`` or step follows). A synchronizer that communicates during
        backward holds that off here, as ``AllReduce`` does with DDP's ``no_sync()``; the
        default does nothing."""
        return contextlib.nullcontext()

    def returned_parameters(self) -> dict[int, torch.Tensor]:
        """After ``finish``: the values ``fit()`` gives the user's model for some parameters,
        by ``id`` of their parameter, where they are not what the replica holds (shared
        gradients adds the updates its messages left unsent). Empty: the model's own."""
        return {}

    def shared_parameters(self, ctx: StepContext) -> dict[int, torch.Tensor]:
        """The values every replica agrees on, by ``id`` of their parameter, for the
        parameters whose model value is this replica's own between steps (shared gradients'
        local view): a saved state takes these. Empty: the model holds them."""
        return {}

    def explain(self, error: BaseException, ctx: StepContext) -> BaseException | None:
        """An error of a step in the user's terms, when the synchronizer knows better words
        for it (``AllReduce`` rewrites DDP's advice as ``ParallelWrapper`` options); None:
        raise it as it is."""
        return None

    def abort_step(self, ctx: StepContext) -> None:
        """The step that ``before_step`` began raised (a NaN loss, a bad batch): undo what
        ``before_step`` did to the model, so that the replica holds consistent parameters."""

    def after_step(self, ctx: StepContext) -> None:
        """The optimizer has stepped (unless ``ctx.skip_optimizer_step`` was set)."""

    def idle_step(self, ctx: StepContext) -> None:
        """This replica had no batch this round: make the same collective calls as the others."""

    def synchronized(self) -> bool:
        """Whether the round just finished ended at a synchronization point: every replica
        holds the same parameters. True by default (schemes that sync every step); a periodic
        scheme returns False between its synchronizations."""
        return True

    # -- reporting ---------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """The settings that change training (JSON-able); a checkpoint must match them."""
        return {}

    def stats(self) -> dict[str, float]:
        """Counters reported by ``ParallelWrapper.stats()``; extend in subclasses."""
        steps = max(1, self.sync_steps)
        return {"bytes_sent": float(self.bytes_sent),
                "bytes_sent_per_step": self.bytes_sent / steps,
                "sync_steps": float(self.sync_steps)}

    def state_dict(self) -> dict[str, Any]:
        """This replica's synchronizer state for checkpoints (tensors and plain values only).

        It is per replica: a checkpoint restores each rank's own state on the same rank.
        """
        return {"bytes_sent": self.bytes_sent, "sync_steps": self.sync_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this replica's ``state_dict()`` output (on the rank that saved it);
        missing counters start from 0."""
        self.bytes_sent = int(state.get("bytes_sent", 0))
        self.sync_steps = int(state.get("sync_steps", 0))

    # -- helpers for subclasses --------------------------------------------------------------
    @staticmethod
    def collective_bytes(tensor: torch.Tensor, world_size: int, kind: str = "allreduce") -> int:
        """Bytes one rank sends for a collective over ``tensor``, for a ring algorithm.

        allreduce: 2(n-1)/n of the tensor (reduce-scatter + all-gather); broadcast and
        allgather: the tensor once to each of the n-1 peers' shares, i.e. (n-1)/n * n = n-1
        times the per-rank chunk for allgather, and the whole tensor for a broadcast root.
        """
        return Synchronizer.collective_nbytes(tensor.numel() * tensor.element_size(), world_size,
                                              kind)

    @staticmethod
    def collective_nbytes(nbytes: int, world_size: int, kind: str = "allreduce") -> int:
        """``collective_bytes`` for a tensor of ``nbytes`` bytes (one that is not at hand)."""
        if world_size <= 1:
            return 0
        if kind == "allreduce":
            return 2 * (world_size - 1) * nbytes // world_size
        if kind == "allgather":
            return (world_size - 1) * nbytes
        if kind == "broadcast":
            return nbytes
        raise ValueError(f"kind={kind!r}; expected 'allreduce', 'allgather' or 'broadcast'")


class NoSync(Synchronizer):
    """Used by ``workers=1``: nothing to synchronize."""

    name = "none"

    def after_step(self, ctx: StepContext) -> None:
        self.sync_steps += 1

    def idle_step(self, ctx: StepContext) -> None:
        self.sync_steps += 1


def sparse_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The weights with sparse gradients: of ``nn.Embedding(sparse=True)`` and
    ``nn.EmbeddingBag(sparse=True)``, trainable."""
    return [m.weight for m in model.modules()
            if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse
            and m.weight.requires_grad]


def zero_loss(model: nn.Module) -> torch.Tensor:
    """0 times the sum of every trainable parameter: a backward through it gives each one a
    zero gradient, so a replica without a batch takes part in collectives that run in
    backward (DDP's bucket all-reduces). The weight of a sparse embedding
    (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) gets an empty sparse
    gradient, as it would from a batch: DDP refuses a dense one there, and a dense zero added
    to an accumulated sparse gradient would turn it dense. The loss is real for complex
    parameters too."""
    sparse = {id(p) for p in sparse_parameters(model)}
    none = torch.zeros(0, dtype=torch.long)

    def term(p: torch.Tensor) -> torch.Tensor:
        if id(p) in sparse:  # looks up no row: an empty sparse gradient
            return nn.functional.embedding(none.to(p.device), p, sparse=True).sum()
        if p.is_complex():  # a real loss, as backward needs: the zero gradient stays complex
            return torch.view_as_real(p).sum()
        return p.sum()

    return sum((term(p) for p in model.parameters() if p.requires_grad),
               torch.zeros((), device=next(model.parameters()).device)) * 0.0


def is_distributed(ctx: StepContext) -> bool:
    """True when the replica has peers to talk to."""
    return ctx.world_size > 1 and dist.is_available() and dist.is_initialized()
