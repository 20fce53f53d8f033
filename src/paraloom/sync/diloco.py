"""DiLoCo: replicas train alone for ``sync_every`` rounds, then an outer optimizer steps the
shared parameters with the replicas' averaged pseudo-gradients (Douillard et al., 2023),
optionally compressed with top-k, low-bit values and error feedback (as SparseLoCo, 2025), and
optionally one fragment of the model at a time, in flight while training goes on (as Streaming
DiLoCo, 2025).

Each replica keeps the shared parameters as they were at the last synchronization (the
*anchor*). At a synchronization of a fragment, each replica computes its pseudo-gradient
``anchor - parameters`` for the fragment's tensors, adds its residual (what earlier messages
left out), sends the ``density`` largest entries (or everything, ``density=1.0``), and keeps
the rest as its new residual. The replicas' messages are averaged; the outer optimizer (the
same on every replica, so every replica computes the same step) treats that average as the
gradient of the anchor and steps it; every replica then continues from the new anchor.
Buffers (BatchNorm statistics) are averaged at each synchronization of the whole model. The
user's optimizer is the inner one, and its state stays with its replica.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from paraloom.sync.base import StepContext, Synchronizer, is_distributed
from paraloom.sync.collectives import any_rank, average_tensors_
from paraloom.sync.pseudo_gradients import (
    Selection,
    check_encoding,
    decoded,
    entries,
    flat_difference,
    message_bytes,
    select,
    sum_selections,
)
from paraloom.sync.sharded_exchange import sharded_average

EXCHANGES = ("gather", "sharded")
"""DiLoCo's ways for compressed messages to meet (see ``DiLoCo``)."""

__all__ = ["DiLoCo", "EXCHANGES", "OuterOptimizer", "averaging_outer_optimizer", "check_outer",
           "describe_factory", "nesterov_outer_optimizer",
           "split_fragments"]

OuterOptimizer = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]
"""Builds the outer optimizer from the shared parameters (``lambda p: SGD(p, lr=0.7)``)."""

nesterov_outer_optimizer: OuterOptimizer = functools.partial(
    torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
"""The DiLoCo paper's outer optimizer: SGD with Nesterov momentum 0.9 at learning rate 0.7 (for
long runs with an AdamW inner optimizer; see the README for where it lost to plain averaging)."""
averaging_outer_optimizer: OuterOptimizer = functools.partial(torch.optim.SGD, lr=1.0)
"""The default outer optimizer: SGD at learning rate 1, so a synchronization moves the shared
parameters by the replicas' mean pseudo-gradient (what they sent of it): the average of the
replicas' parameters when nothing is compressed."""


def describe_factory(factory: object) -> str:
    """A description of an outer optimizer factory that is the same in every process (no
    memory address): a checkpoint's fingerprint compares it."""
    if isinstance(factory, functools.partial):
        arguments = [repr(a) for a in factory.args] + [f"{k}={v!r}" for k, v
                                                        in sorted(factory.keywords.items())]
        return f"{describe_factory(factory.func)}({', '.join(arguments)})"
    name = getattr(factory, "__qualname__", None) or type(factory).__qualname__
    return f"{getattr(factory, '__module__', '')}.{name}"


def check_outer(factory: OuterOptimizer) -> None:
    if not callable(factory):
        raise ValueError(f"outer_optimizer={factory!r}; expected a callable taking the "
                         "parameters, e.g. lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, "
                         "nesterov=True)")
    probe = factory([torch.zeros(1)])
    if not isinstance(probe, torch.optim.Optimizer):
        raise ValueError(f"outer_optimizer returned {type(probe).__name__}; expected a "
                         "torch.optim.Optimizer over the parameters it was given")


def _check_options(sync_every: int, density: float, values: str, fragments: int) -> None:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every={sync_every!r}; expected an int >= 1 (rounds each "
                         "replica trains alone between synchronizations)")
    check_encoding(density, values)
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"fragments={fragments!r}; expected an int >= 1")
    if fragments > sync_every:
        raise ValueError(f"fragments={fragments} is more than sync_every={sync_every}: each "
                         "fragment synchronizes once every sync_every rounds, one fragment at "
                         "a time, so there can be at most sync_every of them")


def _check_overlap(overlap: int, interval: int, exchange: str) -> None:
    if isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 0:
        raise ValueError(f"overlap_rounds={overlap!r}; expected an int >= 0 (rounds a "
                         "synchronization "
                         "stays in flight)")
    if overlap and overlap >= interval:
        raise ValueError(f"overlap_rounds={overlap} must be below sync_every // fragments = "
                         f"{interval}: a synchronization lands before the next one starts")
    if overlap and exchange != "gather":
        raise ValueError("overlap_rounds works with exchange='gather' (the sharded exchange has "
                         "two "
                         "steps, the second waits for the first)")


@dataclass
class InFlight:
    """A synchronization sent and not yet landed."""

    indices: list[int]
    launched: int
    """The round (``sync_steps``) it was sent after."""
    due: int
    """The round after which it lands."""
    snapshot: list[torch.Tensor] | None
    """The parameters of ``indices`` when it was sent (with ``overlap_rounds``)."""
    wait: Callable[[], torch.Tensor]
    """Completes the exchange; returns the replicas' mean."""
    average: torch.Tensor | None = None

    def result(self) -> torch.Tensor:
        if self.average is None:
            self.average = self.wait()
        return self.average

    def state(self) -> dict[str, Any]:
        """For a checkpoint: the exchange completed, its mean kept (landing stays due)."""
        return {"indices": list(self.indices), "launched": self.launched, "due": self.due,
                "snapshot": None if self.snapshot is None else
                [t.clone() for t in self.snapshot], "average": self.result().clone()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> InFlight:
        average = state["average"]
        return cls(list(state["indices"]), int(state["launched"]), int(state["due"]),
                   state["snapshot"], lambda: average, average)


def split_fragments(sizes: list[int], fragments: int) -> list[list[int]]:
    """Consecutive groups of tensor indices, ``fragments`` of them, of near-equal total size."""
    if fragments > len(sizes):
        raise ValueError(f"fragments={fragments} but the model has {len(sizes)} trainable "
                         f"parameter tensors; use at most {len(sizes)}")
    total, done = sum(sizes), 0
    out: list[list[int]] = []
    current: list[int] = []
    for i, size in enumerate(sizes):
        current.append(i)
        done += size
        left = len(sizes) - i - 1
        wanted = fragments - len(out) - 1
        if wanted and (done * fragments >= total * (len(out) + 1) or left == wanted):
            out.append(current)
            current = []
    out.append(current)
    return out


class DiLoCo(Synchronizer):
    """``training_mode="diloco"``: synchronize every ``sync_every`` rounds, send little.

    Options (defaults chosen so that ``training_mode="diloco"`` alone trains about as well as
    all-reduce at a small fraction of its bytes; see the README's table):

    - ``sync_every`` (50): rounds each replica trains alone. More: fewer bytes, more drift.
    - ``outer_optimizer``: builds the outer optimizer from the shared parameters (default:
      ``averaging_outer_optimizer``, SGD at lr 1: the mean of what the replicas sent). The
      paper's Nesterov SGD (lr 0.7, momentum 0.9) is ``nesterov_outer_optimizer``; on the
      convergence benchmark's short SGD runs it lost 10 or more points (see the README).
    - ``density`` (0.05): the fraction of each pseudo-gradient sent (top-k by magnitude, the
      rest kept as the residual and sent later); 1.0 sends it whole (one all-reduce in the
      parameters' dtype).
    - ``values`` ("int8"): how a sent value travels: "fp32", "fp16", or "int8" (one scale per
      message). Not used with ``density=1.0``.
    - ``fragments`` (1): synchronize the model in this many parts, one part every
      ``sync_every // fragments`` rounds (staggered: the peak of traffic is divided).
    - ``exchange`` ("gather"): how compressed messages meet. "gather": one all-gather, every
      worker receives every other's message (received bytes grow with the workers);
      "sharded": each worker averages one shard of the vector and sends back its top entries
      (``sharded_exchange``): about two messages in and out per worker at any worker count,
      the average itself compressed (with its own error feedback).
    - ``overlap_rounds`` (0): rounds a synchronization stays in flight while the replicas train on
      (Streaming DiLoCo's overlap; with ``exchange="gather"``). When it lands, each replica
      takes the new shared parameters plus what it learned meanwhile. Fewer than
      ``sync_every // fragments``; 0 lands each synchronization at once.

    Raises ``ValueError`` for an option out of range or an outer optimizer factory that does
    not return a ``torch.optim.Optimizer``; ``fragments`` above the model's number of
    parameter tensors is refused by ``check_model`` (``ParallelWrapper`` calls it when built).
    """

    name = "diloco"
    takes_complex = False

    def __init__(self, sync_every: int = 50, outer_optimizer: OuterOptimizer | None = None,
                 density: float = 0.05, values: str = "int8", fragments: int = 1,
                 exchange: str = "gather", overlap_rounds: int = 0) -> None:
        super().__init__()
        _check_options(sync_every, density, values, fragments)
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange={exchange!r}; expected one of {EXCHANGES}")
        _check_overlap(overlap_rounds, sync_every // fragments, exchange)
        self.exchange, self.overlap_rounds = exchange, overlap_rounds
        self._in_flight: InFlight | None = None
        self.bytes_received = 0
        self._aggregates: dict[tuple[int, ...], torch.Tensor] = {}
        self.outer_factory = outer_optimizer or averaging_outer_optimizer
        check_outer(self.outer_factory)
        self.sync_every, self.density, self.values = sync_every, density, values
        self.fragments = fragments
        self.synchronizations = 0
        self._anchors: list[torch.Tensor] = []
        self._residuals: list[torch.Tensor | None] = []
        self._groups: list[list[int]] = []
        self._outer: torch.optim.Optimizer | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def check_model(self, model: torch.nn.Module) -> None:
        super().check_model(model)  # real parameters only (takes_complex)
        params = [p for p in model.parameters() if p.requires_grad]
        split_fragments([p.numel() for p in params], self.fragments)

    def setup(self, ctx: StepContext) -> None:
        """Start a fit. A fit after another, on the model as the last one left it (every
        replica at the anchors), keeps the anchors, the residuals (what the last messages
        left out) and the outer optimizer's state: ``fit(1)`` twice then continues as one
        fit would. A model written since (the user's weights, a resume) starts them anew."""
        self.sync_steps = self.bytes_sent = self.synchronizations = self.bytes_received = 0
        self._in_flight = None
        params = self._params(ctx)
        self._groups = split_fragments([p.numel() for p in params], self.fragments)
        warm = self._at_anchors(params)
        if is_distributed(ctx):
            warm = not any_rank(not warm, ctx)  # every replica keeps, or none does
        if warm:
            return
        self._aggregates = {}
        with torch.no_grad():
            self._anchors = [p.detach().to(torch.promote_types(p.dtype, torch.float32))
                             .clone() for p in params]
        self._residuals = [None] * len(params)
        self._outer = self.outer_factory(self._anchors)

    def _at_anchors(self, params: list[torch.nn.Parameter]) -> bool:
        """Whether ``params`` are the anchors, as the last fit's finish left them."""
        if self._outer is None or len(params) != len(self._anchors):
            return False
        with torch.no_grad():
            return all(p.shape == a.shape and p.device == a.device
                       and torch.equal(p.detach(), a.to(p.dtype))
                       for p, a in zip(params, self._anchors, strict=True))

    @staticmethod
    def _params(ctx: StepContext) -> list[torch.nn.Parameter]:
        return [p for p in ctx.model.parameters() if p.requires_grad]

    def after_step(self, ctx: StepContext) -> None:
        self._tick(ctx)

    def idle_step(self, ctx: StepContext) -> None:
        self._tick(ctx)

    def _tick(self, ctx: StepContext) -> None:
        self.sync_steps += 1
        if self._in_flight is not None and self.sync_steps >= self._in_flight.due:
            self._land(ctx)
        due = self._due()
        if due is not None:
            self._land(ctx)  # one synchronization in flight at a time
            self._launch(ctx, self._groups[due], self.overlap_rounds)
            if not self.overlap_rounds:
                self._land(ctx)
            if due == len(self._groups) - 1:
                self._average_buffers(ctx)

    def _due(self) -> int | None:
        """The fragment that synchronizes after this round, or None."""
        interval = max(1, self.sync_every // self.fragments)
        if self.sync_steps % interval:
            return None
        return (self.sync_steps // interval - 1) % self.fragments

    def synchronized(self) -> bool:
        return self.sync_steps % self.sync_every == 0 and self.fragments == 1 and \
            (self._in_flight is None or self._in_flight.launched == self.sync_steps)

    def finish(self, ctx: StepContext) -> None:
        """One last synchronization of everything not synchronized since it last changed."""
        synchronized = self.synchronized()
        self._land(ctx)
        if synchronized:
            return
        self.synchronize(ctx, list(range(len(self._anchors))))
        self._average_buffers(ctx)

    # -- a synchronization -------------------------------------------------------------------
    def synchronize(self, ctx: StepContext, indices: list[int]) -> None:
        """Step the anchors of ``indices`` with the replicas' averaged pseudo-gradients and
        start every replica from them."""
        self._land(ctx)
        self._launch(ctx, indices, 0)
        self._land(ctx)

    def _launch(self, ctx: StepContext, indices: list[int], overlap: int) -> None:
        """Send the pseudo-gradients of ``indices``; they land ``overlap`` rounds later."""
        params = self._params(ctx)
        with torch.no_grad():
            flat = flat_difference([self._anchors[i] for i in indices],
                                   [params[i].detach() for i in indices])
            flat += self._residual_flat(indices, flat.device)
            wait = self._exchange(flat, indices, ctx)
            snapshot = [params[i].detach().clone() for i in indices] if overlap else None
        self._in_flight = InFlight(indices, self.sync_steps, self.sync_steps + overlap,
                                   snapshot, wait)

    def _land(self, ctx: StepContext) -> None:
        """Finish the synchronization in flight, if any: step its anchors, and move each
        replica to them (plus what it learned since it was sent, with ``overlap_rounds``)."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        params = self._params(ctx)
        with torch.no_grad():
            self._step_outer(flight.result(), flight.indices)
            for n, i in enumerate(flight.indices):
                landed = self._anchors[i].to(params[i].dtype)
                if flight.snapshot is not None:
                    landed = landed + (params[i].detach() - flight.snapshot[n])
                params[i].copy_(landed)
        self.synchronizations += 1

    def _residual_flat(self, indices: list[int], device: torch.device) -> torch.Tensor:
        """The residuals of ``indices``, flat (zeros where none is kept yet)."""
        parts = []
        for i in indices:
            residual = self._residuals[i]
            parts.append(torch.zeros(self._anchors[i].numel(), device=device,
                                     dtype=self._anchors[i].dtype)
                         if residual is None else residual.reshape(-1))
        return torch.cat(parts)

    def _exchange(self, flat: torch.Tensor, indices: list[int], ctx: StepContext
                  ) -> Callable[[], torch.Tensor]:
        """Start the replicas' mean of ``flat`` (compressed when ``density`` is set); returns
        what waits for it. The part of ``flat`` not sent becomes the residual."""
        world = ctx.world_size if is_distributed(ctx) else 1
        if self.density >= 1:
            if world == 1:
                return lambda: flat
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ctx.group, async_op=True)
            sent = self.collective_bytes(flat, world, "allreduce")
            self.bytes_sent += sent
            self.bytes_received += sent  # a ring all-reduce takes in what it sends

            def summed() -> torch.Tensor:
                work.wait()
                return flat / world
            return summed
        if world > 1 and self.exchange == "sharded":
            average = self._sharded(flat, indices, ctx, world)
            return lambda: average
        mine = select(flat, entries(flat.numel(), self.density), self.values)
        residual = flat.clone()
        residual.index_add_(0, mine.index, -decoded(mine).to(residual.dtype))
        self._store_residual(residual, indices)
        size = message_bytes(mine.values.numel(), self.values, flat.numel())
        self.bytes_sent += (world - 1) * size
        self.bytes_received += (world - 1) * size
        gathered: Callable[[], list[Selection]] = \
            (lambda: [mine]) if world == 1 else self._gather(mine, ctx)
        return lambda: sum_selections(gathered(), flat.numel(), flat.device) / world

    def _sharded(self, flat: torch.Tensor, indices: list[int], ctx: StepContext, world: int
                 ) -> torch.Tensor:
        key = tuple(indices)
        average, residual, kept, sent, received = sharded_average(
            flat, self._aggregates.get(key), self.density, self.values, ctx.group, ctx.rank,
            world)
        self._store_residual(residual, indices)
        self._aggregates[key] = kept
        self.bytes_sent += sent
        self.bytes_received += received
        return average

    def _gather(self, mine: Selection, ctx: StepContext) -> Callable[[], list[Selection]]:
        """Start the all-gather of every replica's message; returns what waits for them."""
        parts, works = [], []
        # gloo has no int16: the offsets travel as their bytes.
        for tensor in (mine.offsets.view(torch.uint8), mine.counts, mine.values,
                       mine.scale.reshape(1)):
            out = [torch.empty_like(tensor) for _ in range(ctx.world_size)]
            works.append(dist.all_gather(out, tensor, group=ctx.group, async_op=True))
            parts.append(out)

        def gathered() -> list[Selection]:
            for work in works:
                work.wait()
            return [Selection(o.view(torch.int16), c, v, s.reshape(()))
                    for o, c, v, s in zip(*parts, strict=True)]
        return gathered

    def _store_residual(self, residual: torch.Tensor, indices: list[int]) -> None:
        offset = 0
        for i in indices:
            n = self._anchors[i].numel()
            self._residuals[i] = residual[offset:offset + n].view_as(self._anchors[i]).clone()
            offset += n

    def _step_outer(self, average: torch.Tensor, indices: list[int]) -> None:
        assert self._outer is not None, "setup() was not called"
        chosen = set(indices)
        offset = 0
        for i, anchor in enumerate(self._anchors):
            if i in chosen:
                anchor.grad = average[offset:offset + anchor.numel()].view_as(anchor).to(
                    anchor.dtype, copy=True)
                offset += anchor.numel()
            else:
                anchor.grad = None  # other fragments: the optimizer leaves them as they are
        self._outer.step()
        for anchor in self._anchors:
            anchor.grad = None

    def _average_buffers(self, ctx: StepContext) -> None:
        buffers = list(ctx.model.buffers())
        if buffers and is_distributed(ctx):
            sent = average_tensors_(buffers, ctx.group, ctx.world_size, ctx.device)
            self.bytes_sent += sent
            self.bytes_received += sent  # a ring all-reduce takes in what it sends

    # -- reporting and state -----------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {"sync_every": self.sync_every, "density": self.density, "values": self.values,
                "fragments": self.fragments, "exchange": self.exchange,
                "overlap_rounds": self.overlap_rounds,
                "outer_optimizer": describe_factory(self.outer_factory)}

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "synchronizations": float(self.synchronizations),
                "bytes_received": float(self.bytes_received),
                "bytes_received_per_step": self.bytes_received / max(1, self.sync_steps)}

    def state_dict(self) -> dict[str, Any]:
        assert self._outer is not None, "setup() was not called"
        return {**super().state_dict(), "synchronizations": self.synchronizations,
                "anchors": [a.detach().clone() for a in self._anchors],
                "residuals": [None if r is None else r.clone() for r in self._residuals],
                "aggregates": [[list(k), v.clone()] for k, v in self._aggregates.items()],
                "in_flight": None if self._in_flight is None else self._in_flight.state(),
                "bytes_received": self.bytes_received,
                "outer": self._outer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output on the rank that saved it: the anchors, the
        residuals, the outer optimizer and a synchronization in flight."""
        super().load_state_dict(state)
        self.synchronizations = int(state.get("synchronizations", 0))
        self.bytes_received = int(state.get("bytes_received", 0))
        self._aggregates = {tuple(k): v.clone() for k, v in state.get("aggregates", [])}
        flight = state.get("in_flight")
        self._in_flight = None if flight is None else InFlight.from_state(flight)
        if "anchors" not in state:
            return
        with torch.no_grad():
            for anchor, saved in zip(self._anchors, state["anchors"], strict=True):
                anchor.copy_(saved)
        self._residuals = [None if r is None else r.clone().to(a.device)
                           for r, a in zip(state["residuals"], self._anchors, strict=True)]
        assert self._outer is not None, "setup() was not called"
        self._outer.load_state_dict(state["outer"])

