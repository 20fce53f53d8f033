"""SharedGradients: the step hooks of threshold-encoded update sharing.

Each step, every replica:

1. lets the optimizer step and takes its update (learning rate, momentum etc. applied, as in
   DL4J), divided by the number of replicas when ``combine="mean"``, into its residual. With
   ``gradients_at="shared"`` (DL4J's rule) the optimizer stepped from the shared parameters
   (``old``), which the parameters are put back to; with ``gradients_at="local"`` (the dgc
   recipe) the parameters hold the *local view* (``view.py``), the shared parameters plus the
   replica's own unsent updates (its residual, whole), from a fit's first step to its end:
   the forward, backward and optimizer step run there, and the residual is what the moved
   view holds beyond ``old``;
2. encodes the residual (``encoder.py``) with the tau its threshold algorithm chooses
   (threshold, gap16 or bitmap message, see ``paraloom.sync.encoding``), subtracts exactly
   what the message carries (and, whole, from the local view), zeroes the optimizer's
   momentum where the message moved an element if asked (``momentum_masking``, see
   ``paraloom.sync.momentum``), and lets the post-processor (e.g. ``ResidualClipping``) act
   (what it drops leaves the local view too);
3. all-gathers every replica's message (``exchange.py``) and adds their decoded sum, in rank
   order, to ``old`` and to the parameters. With ``overlap=True`` the all-gather starts here
   and is collected at the next step's step 1, so it runs while that step's forward and
   backward compute: until then the replica's own message stays whole in its local view, and
   its peers' messages reach it one step late.

Every replica applies the same messages in the same order to the same ``old``, so the replicas
stay bit-identical after every step; no replica ever applies its own raw update. The optimizer
state (momentum, Adam moments) stays local to each replica, as in DL4J. Accumulating the
optimizer's update (velocity times learning rate) rather than the raw gradient is DGC's
"momentum correction". Computing the gradient at the local view is the error reset of CSER
(Xie et al., 2020) and the local iterate of Qsparse-local-SGD (Basu et al., 2019): a replica's
gradient sees where its own updates are taking it, not a model that lags them by the residual.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from paraloom.sync.base import StepContext, Synchronizer, is_distributed
from paraloom.sync.collectives import any_rank, broadcast_tensors_
from paraloom.sync.encoding import Encoded, Steps, decode, decode_into, empty_message, moved_index
from paraloom.sync.momentum import mask_momentum_
from paraloom.sync.sharing.encoder import MessageEncoder
from paraloom.sync.sharing.exchange import (
    Exchanged,
    Started,
    exchange_messages,
    peers,
    start_exchange,
)
from paraloom.sync.sharing.recipe import RecipeOptions, SharingRecipe
from paraloom.sync.sharing.state import ReplicaTensors, Restored
from paraloom.sync.sharing.view import (
    accumulate_update_,
    parameter_names,
    residual_from_view_,
    set_local_view_,
    summed_residuals,
)
from paraloom.sync.thresholds import ResidualPostProcessor, ThresholdAlgorithm

__all__ = ["SharedGradients"]


class SharedGradients(RecipeOptions, Synchronizer):
    """Threshold-encoded update sharing with residuals (``training_mode="shared_gradients"``).

    ``recipe`` is a ``SharingRecipe`` (every option, documented there), or the name of its
    preset: ``"dgc"`` (the default: DGC's top-k at the dense recipe's learning rate, gradients
    at the local view, each exchange overlapped with the next step) or ``"dl4j"`` (DL4J's
    ParallelWrapper exactly). The other keywords are the recipe's options, for a recipe given
    by name: ``SharedGradients(FixedThreshold(1e-3), recipe="dl4j", combine="mean")`` is
    ``SharedGradients(recipe=SharingRecipe("dl4j", FixedThreshold(1e-3), combine="mean"))``.

    Raises what ``SharingRecipe`` raises for a bad option, ``TypeError`` for options given
    beside a ``SharingRecipe``, and (at ``setup``) ``ValueError`` for a model with no
    trainable parameter, parameters on several devices, or ``overlap=True`` with messages of
    varying size. Checkpoints and restore points save the exchange in flight, so resume stays
    exact.

    During a fit the trainable parameters' data are views of one flat tensor, when they share
    a dtype and a plain (contiguous) layout, so that each step's work on them is one operation;
    at the fit's end each parameter gets storage of its own again. A ``p.data`` taken before
    ``fit()`` is then no longer the parameter's (take ``p`` itself, or read it afterwards).
    """

    name = "shared_gradients"
    takes_complex = False

    def __init__(self, threshold_algorithm: ThresholdAlgorithm | None = None,
                 residual_post_processor: ResidualPostProcessor | None = None, *,
                 recipe: str | SharingRecipe = "dgc", combine: str | None = None,
                 momentum_masking: bool | None = None, gradients_at: str | None = None,
                 encoding: str = "auto", broadcast_buffers: bool = True,
                 overlap: bool | None = None) -> None:
        super().__init__()
        options = {"threshold_algorithm": threshold_algorithm,
                   "residual_post_processor": residual_post_processor, "combine": combine,
                   "momentum_masking": momentum_masking, "gradients_at": gradients_at,
                   "encoding": encoding, "broadcast_buffers": broadcast_buffers,
                   "overlap": overlap}
        self.recipe = SharingRecipe.given(recipe, options)
        self._encoder = MessageEncoder(self.recipe)
        self.setup_bytes_sent = self.finish_bytes_sent = 0
        self._unsent: Tensor | None = None  # after finish: see returned_parameters
        self._replica: ReplicaTensors | None = None
        self._names: list[list[str]] = []  # each parameter's state_dict keys, for a saved view
        self._holding = False
        """Whether the parameters hold the local view (from the first step of a fit to its
        end); the shared parameters are then ``old``."""
        self._restored = Restored()
        self._residual_restored = False
        self._started: Started | None = None
        """With ``overlap``: the exchange of the last step's messages, still running (its
        peers' messages not yet in the parameters, this replica's own whole in the view)."""
        self._own: tuple[Encoded, Steps | None] | None = None
        """The message this replica put in ``_started``, and its steps (None once restored:
        it is then read back from the exchange)."""
        self._masked = 0
        self._seconds = {"local_view": 0.0, "encoding": 0.0, "exchange": 0.0, "applying": 0.0}
        """Time spent per phase of the exchange, for ``stats()``."""

    # -- the recipe's options, as attributes ----------------------------------------------------
    @property
    def threshold_algorithm(self) -> ThresholdAlgorithm:
        """This replica's threshold algorithm (its own copy of the recipe's, with its tau)."""
        return self._encoder.threshold_algorithm

    @property
    def residual_post_processor(self) -> ResidualPostProcessor | None:
        """The recipe's residual post-processor (e.g. ``ResidualClipping``), or None."""
        return self.recipe.residual_post_processor

    # -- lifecycle ---------------------------------------------------------------------------
    def setup(self, ctx: StepContext) -> None:
        # A fit that failed without abort_step or finish left the local view: whatever the
        # model holds now (it may be a state loaded since) is taken as it is.
        self._holding = False
        self._started = self._own = self._unsent = None
        params = [p for p in ctx.model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("shared_gradients: the model has no parameters that require grad; "
                             "expected at least one trainable parameter")
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"shared_gradients: parameters on several devices "
                             f"{sorted(map(str, devices))}; expected one device per replica")
        self._replica = ReplicaTensors.for_model(params, list(ctx.model.buffers()),
                                                 self._replica, self._residual_restored)
        self._names = parameter_names(ctx.model, params)
        self._replica.lay()
        self.recipe.check_overlap(self._replica.residual.numel())
        self._adopt_restored()
        self._residual_restored = False  # the next fit's check starts clean
        if is_distributed(ctx):
            self._broadcast_start(ctx)

    def _broadcast_start(self, ctx: StepContext) -> None:
        """Like DDP at construction: every replica starts from rank 0's parameters, unless
        none was written since the last exchange left them identical (a warm fit() that sent
        no new state): then only the buffers, which each replica's forward updates."""
        replica = self._require_setup()
        with torch.no_grad():
            tensors = list(replica.buffers)
            if any_rank(replica.stamps != replica.current_stamps(), ctx):
                tensors = [p.detach() for p in replica.params] + tensors
            self.setup_bytes_sent += broadcast_tensors_(tensors, ctx.group, ctx.world_size)
        replica.broadcast_done()

    # -- per step ----------------------------------------------------------------------------
    def before_step(self, ctx: StepContext) -> None:
        """With ``gradients_at="local"``, at a fit's first step: the parameters become the
        local view, where every forward and backward of the fit runs (later steps keep it
        there, moved as the residual moves)."""
        if self.gradients_at != "local":
            return
        replica = self._require_setup()
        if self._holding and replica.stamps == replica.current_stamps():
            return
        started = time.perf_counter()
        with torch.no_grad():
            # Not holding, or something wrote the parameters since: they are the shared ones.
            replica.save_old()
            view = self._restored.take_view()
            if view is not None:
                for p, saved in zip(replica.params, view, strict=True):
                    p.copy_(saved)
            else:
                set_local_view_(replica.parts, replica.old_parts, replica.residual_parts,
                                self._reach(ctx))
                if self._started is not None:  # the own message in flight: whole in the view
                    msg, steps = self._own_in_flight(ctx)
                    decode_into(msg, replica.parts, replica.part_bounds, steps=steps,
                                factor=self._reach(ctx))
        replica.stamps = replica.current_stamps()
        self._holding = True
        self._seconds["local_view"] += time.perf_counter() - started

    def after_backward(self, ctx: StepContext) -> None:
        replica = self._require_setup()
        if not self._holding:  # holding the local view, old already mirrors the shared ones
            with torch.no_grad():
                replica.save_old()
        replica.old_saved = True

    def after_step(self, ctx: StepContext) -> None:
        replica = self._require_setup()
        if not replica.old_saved:
            raise RuntimeError("shared_gradients: after_step without after_backward; expected "
                               "the loop to call after_backward before optimizer.step()")
        replica.old_saved = False
        flags = self._changed_flags(ctx)  # before the collected exchange broadcasts buffers
        self._collect(ctx)
        started = time.perf_counter()
        view = replica.parts if self._holding else None
        with torch.no_grad():
            scale = self.recipe.update_scale(ctx.world_size)
            if view is not None:  # the optimizer moved the local view: the residual follows
                residual_from_view_(view, replica.old_parts, replica.residual_parts, scale)
            else:
                accumulate_update_(replica.parts, replica.old_parts, replica.residual_parts,
                                   scale)
            msg, nonfinite, steps = self._encode(ctx, view)
            self._seconds["encoding"] += time.perf_counter() - started
            self._exchange(msg, nonfinite, flags, ctx, steps)
        self.threshold_algorithm.update(msg.moved / msg.numel)

    def _encode(self, ctx: StepContext, view: list[Tensor] | None
                ) -> tuple[Encoded, int, Steps | None]:
        """This step's message, taken out of the residual (and, without overlap, out of the
        local ``view``); with the count of non-finite residual elements and its steps."""
        replica = self._require_setup()
        msg, found, steps = self._encoder.encode(replica.residual)
        # Exact: see encoding's module docstring.
        decode(msg, replica.residual, sign=-1, steps=steps)
        if view is not None and not self.overlap:  # the local view loses it whole
            decode_into(msg, view, replica.part_bounds, steps=steps, factor=-self._reach(ctx))
        if self.momentum_masking:
            self._masked += mask_momentum_(ctx.optimizer, replica.params, replica.bounds,
                                           moved_index(msg, steps=steps))
        # A peak is NaN or inf exactly when its chunk holds one: only then count them.
        nonfinite = 0 if bool(torch.isfinite(found.peaks).all()) else \
            int((~torch.isfinite(replica.residual)).sum())
        self._encoder.post_process(replica.residual, found, msg.tau, self.sync_steps,
                                   replica.part_bounds, view, self._reach(ctx))
        self._encoder.record(msg)
        return msg, nonfinite, steps

    def idle_step(self, ctx: StepContext) -> None:
        if self._restored.view is not None:  # resumed, idle at once: hold the view from
            self.before_step(ctx)               # here, as the uninterrupted run held it
        replica = self._require_setup()
        replica.old_saved = False
        msg = empty_message(replica.residual.numel(), replica.residual.device)
        flags = self._changed_flags(ctx)
        with torch.no_grad():
            if not self._holding:
                replica.save_old()  # the parameters are "old": this replica did not step
            self._collect(ctx)
            self._exchange(msg, 0, flags, ctx)

    def abort_step(self, ctx: StepContext) -> None:
        # The exchange in flight is left to the process group: the fit fails, and a peer
        # that died would make waiting for it hang.
        self._started = self._own = None
        self._settle(unlay=True)

    def finish(self, ctx: StepContext) -> None:
        """End the fit: the last exchange in, the shared parameters back in the model, and
        (``gradients_at="local"``) ``returned_parameters`` made, with one dense all-reduce."""
        if self._restored.view is not None:  # resumed with no round left: hold the view, as
            self.before_step(ctx)              # the uninterrupted run held it at its end
            self._restored.view = None  # never set over a later fit's parameters
        self._collect(ctx)
        self._settle(unlay=True)
        if self.gradients_at == "local":
            self._unsent = self._summed(ctx, self._reach(ctx) / ctx.world_size)

    def _summed(self, ctx: StepContext, factor: float) -> Tensor:
        """Every replica's residual summed, times ``factor`` (one dense all-reduce)."""
        total = summed_residuals(self._require_setup().residual, ctx.group, ctx.world_size)
        self.finish_bytes_sent += self.collective_bytes(total, ctx.world_size)
        return total.mul_(factor)

    def returned_parameters(self) -> dict[int, Tensor]:
        """After ``finish``, with ``gradients_at="local"``: the mean of the replicas' local
        views (where their losses ran), by ``id``, for ``fit()`` to return; the replicas keep
        their residuals for the next fit. ``"shared"``: none."""
        if self._unsent is None or self._replica is None:
            return {}
        return self._replica.plus(self._unsent)

    def flush_residuals(self, ctx: StepContext) -> None:
        """After ``finish``: every replica's unsent updates written into the parameters (the
        local views' mean; ``"shared"``: their sum, as messages bring them), residuals emptied.
        Spark's shared master calls it: its residuals would be lost with the stage's tasks."""
        if self._unsent is None:
            self._unsent = self._summed(ctx, 1.0)
        self._require_setup().apply_residual_(self._unsent)
        self._unsent = None

    def shared_parameters(self, ctx: StepContext) -> dict[int, Tensor]:
        """While the parameters hold the local view: ``old``, by ``id`` of its parameter."""
        if not self._holding or self._replica is None:
            return {}
        return {id(p): old for p, old in zip(self._replica.params, self._replica.old,
                                             strict=True)}

    # -- the exchange --------------------------------------------------------------------------
    def _changed_flags(self, ctx: StepContext) -> list[bool]:
        """Which buffers some forward wrote since the last broadcast (none when not sent)."""
        replica = self._require_setup()
        if not (self.broadcast_buffers and is_distributed(ctx)):
            return []
        replica.refresh_buffers(ctx.model)
        return replica.changed_buffers()

    def _exchange(self, msg: Encoded, nonfinite: int, flags: list[bool], ctx: StepContext,
                  steps: Steps | None = None) -> None:
        """Exchange ``msg`` (whose parsed ``steps`` the caller may give) and apply every
        replica's message, or with ``overlap`` start the exchange, to collect at the next
        step."""
        replica = self._require_setup()
        if self.overlap:
            group, world_size, _ = peers(ctx)
            started = start_exchange(msg, nonfinite, group, world_size, flags,
                                     self.recipe.capacity(msg.numel) or 0)
            self._started, self._own = started, (msg, steps)
            self.bytes_sent += started.bytes_sent
            self.sync_steps += 1
            replica.stamps = replica.current_stamps()  # the post-processor wrote the view
            return
        started_at = time.perf_counter()
        if is_distributed(ctx):
            got = exchange_messages(msg, nonfinite, ctx.group, ctx.world_size, flags,
                                    self.recipe.capacity(msg.numel))
        else:
            got = Exchanged([msg], [nonfinite], [], 0)
        self._seconds["exchange"] += time.perf_counter() - started_at
        self.bytes_sent += got.bytes_sent
        self.sync_steps += 1
        self._apply(got, ctx, steps)

    @torch.no_grad()
    def _collect(self, ctx: StepContext) -> None:
        """With ``overlap``: wait for the exchange started at the last step and apply it (this
        replica's own message leaves the view whole, as every message reaches ``old``)."""
        if self._started is None:
            return
        started_at = time.perf_counter()
        got = self._started.wait()
        if len(got.messages) != peers(ctx)[1]:
            raise ValueError(f"shared_gradients: a restored exchange holds "
                             f"{len(got.messages)} replicas' messages for "
                             f"{ctx.world_size} replicas; expected a checkpoint of as many "
                             f"workers")
        self._seconds["exchange"] += time.perf_counter() - started_at
        replica = self._require_setup()
        if self._holding:
            msg, steps = self._own_in_flight(ctx)
            decode_into(msg, replica.parts, replica.part_bounds, steps=steps,
                        factor=-self._reach(ctx))
        own_steps = self._own[1] if self._own is not None else None
        self._started = self._own = None
        self._apply(got, ctx, own_steps)

    def _own_in_flight(self, ctx: StepContext) -> tuple[Encoded, Steps | None]:
        """This replica's message in the exchange in flight, and its steps when known."""
        if self._own is not None:
            return self._own
        assert self._started is not None
        return self._started.wait().messages[peers(ctx)[2]], None

    def _apply(self, got: Exchanged, ctx: StepContext, steps: Steps | None = None) -> None:
        """Apply every replica's message to the parameters and ``old`` (``steps``: this
        replica's message's, when known), then broadcast the buffers some replica wrote."""
        replica = self._require_setup()
        started_at = time.perf_counter()
        self._refuse_nonfinite(got.nonfinite)
        # Rank order: the same float sums on every replica; old gets the same sums, so it
        # mirrors the parameters (beneath the local view, when they hold it).
        me = peers(ctx)[2]
        for rank, message in enumerate(got.messages):
            own = steps if rank == me else None
            if replica.old_flat is not None:
                decode_into(message, replica.parts, replica.part_bounds,
                            mirror=replica.old_flat, steps=own)
            else:
                decode_into(message, replica.parts, replica.part_bounds, steps=own)
                decode_into(message, replica.old_parts, replica.part_bounds, steps=own)
        replica.stamps = replica.current_stamps()
        # Only the buffers some replica wrote (BatchNorm statistics, not a constant mask): the
        # flags came with the headers, so every replica broadcasts the same ones.
        written = [b for b, flag in zip(replica.buffers, got.changed, strict=False) if flag]
        if written:
            self.bytes_sent += broadcast_tensors_(written, ctx.group, ctx.world_size)
            replica.broadcast_done(got.changed)
        self._seconds["applying"] += time.perf_counter() - started_at

    def _refuse_nonfinite(self, bad: list[int]) -> None:
        """Raise FloatingPointError, with the parameters at their last consistent values,
        when some replica's update held non-finite elements (``bad``: their counts)."""
        if not any(bad):
            return
        self._require_setup().residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        self._settle()
        ranks = [rank for rank, count in enumerate(bad) if count]
        raise FloatingPointError(
            f"shared_gradients: the update of replica(s) {ranks} has non-finite values "
            f"({[bad[r] for r in ranks]} elements) at sync step {self.sync_steps}; the "
            f"parameters were left at their last consistent values. Lower the learning "
            f"rate or clip gradients")

    # -- internals ---------------------------------------------------------------------------
    def _reach(self, ctx: StepContext) -> float:
        """The factor on the residual in the local view: the residual holds ``scale`` times
        this replica's unsent updates, the local view adds them whole."""
        return 1.0 / self.recipe.update_scale(ctx.world_size)

    def _settle(self, unlay: bool = False) -> None:
        """Put the shared parameters back in the model if it holds the local view (the end
        of a fit, or a step that failed midway); ``unlay`` (the end of a fit): then each
        parameter gets its own storage back."""
        if self._holding and self._replica is not None:
            with torch.no_grad():
                self._replica.put_back_shared()
            self._holding = False
        if unlay and self._replica is not None:
            self._replica.unlay()

    def _require_setup(self) -> ReplicaTensors:
        if self._replica is None:
            raise RuntimeError("shared_gradients: a step hook ran before setup(); expected "
                               "setup(ctx) once per fit() before the first step")
        return self._replica

    def _adopt_restored(self) -> None:
        """Take what a loaded state left for the model: the exchange in flight and the
        residual now, the local view (checked here) at the next step."""
        self._started, self._own = self._restored.take_started(self._replica), None
        if self._replica is not None and self._restored.take_residual(self._replica):
            self._residual_restored = True  # a restore's residual: setup keeps it

    # -- reporting ---------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Adds tau and sparsity (fraction of elements moved) of this replica's last message,
        and the seconds per step spent setting the local view, encoding (residual, threshold,
        message, masking), exchanging and applying the messages."""
        out = super().stats()
        out.update({f"seconds_{phase}_per_step": seconds / max(1, self.sync_steps)
                    for phase, seconds in self._seconds.items()})
        out.update(self._encoder.stats())
        out.update(setup_bytes_sent=float(self.setup_bytes_sent),
                   finish_bytes_sent=float(self.finish_bytes_sent),
                   momentum_masked=float(self._masked))
        if self._replica is not None:
            out["residual_norm"] = float(self._replica.residual.norm())
        return out

    def config(self) -> dict[str, Any]:
        return self.recipe.config()

    def state_dict(self) -> dict[str, Any]:
        """Counters, threshold, format, this replica's residual, while the parameters hold
        it its local view (with each parameter's ``state_dict`` keys, for
        ``TrainingCheckpoint.model_state``), and with ``overlap`` the exchange in flight,
        waited for (restore them on this rank).

        The residual is the part of this replica's updates not yet sent: restoring one
        replica's state into every replica would apply that part once per replica. The local
        view is saved as it is (the shared parameters plus the residual, rounded as the steps
        left it), so that a resumed run's forward runs where the saved run's would have.
        """
        state = super().state_dict()
        state.update(self._encoder.state_dict())
        if self._replica is not None:
            state["residual"] = self._replica.residual.detach().clone()
            if self._holding:  # where the next step's forward runs, bit for bit
                state["local_view"] = [p.detach().clone() for p in self._replica.params]
                state["local_view_names"] = self._names
        if self._started is not None:  # every replica's messages, applied at the next step
            state["in_flight"] = self._started.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output on the rank that saved it; the residual, the
        local view and the exchange in flight are adopted at setup when the replica is not
        set up yet."""
        super().load_state_dict(state)
        self._encoder.load_state_dict(state)
        in_flight = state.get("in_flight")
        self._restored = Restored(state.get("residual"), state.get("local_view"),
                                  None if in_flight is None else Started.from_state(in_flight))
        if self._replica is not None:
            self._adopt_restored()
