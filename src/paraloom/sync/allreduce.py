"""Dense gradient all-reduce every step through PyTorch DDP (``training_mode="allreduce"``).

DDP buckets the gradients and all-reduces each bucket as soon as backward has produced it, so
communication overlaps with the rest of backward; every replica then holds the same averaged
gradients and takes the same optimizer step, so the replicas stay bit-identical.

A replica with no batch in a partial last round must still join the bucket all-reduces, in the
same order and sizes as its peers. ``idle_step`` runs a backward pass of ``0 * sum(params)``
through the same DDP wrapper (no user forward, no batch needed): DDP all-reduces zero
gradients for this replica, every replica receives ``sum(active gradients) / world_size``
(what DDP's own ``join()`` gives by default), and the idle replica calls ``optimizer.step()``
itself so that its parameters and optimizer state follow the others.

``comm_hook=`` registers one of PyTorch's DDP communication hooks (``paraloom.sync.comm_hooks``):
``"fp16"`` / ``"bf16"`` all-reduce each bucket in half precision, ``"powersgd"`` all-reduces
low-rank factors of the gradient matrices after a warm-up of plain all-reduce. Every rank still
receives the same averaged gradients, so the replicas stay bit-identical; an idle replica's zero
backward goes through the same hook (for PowerSGD its error feedback goes in with the zeros).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paraloom.sync.base import (
    StepContext,
    Synchronizer,
    is_distributed,
    sparse_parameters,
    zero_loss,
)
from paraloom.sync.collectives import broadcast_tensors_
from paraloom.sync.comm_hooks import PowerSGD, cast_hook, resolve_comm_hook
from paraloom.sync.ddp_buckets import BucketLayout, bucket_layout, ddp_with_layout
from paraloom.sync.ddp_errors import explain_ddp_error

__all__ = ["AllReduce"]

_DDP_OPTIONS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {
    "self", "module", "device_ids", "output_device", "process_group"}
_DDP_FLAGS = frozenset(name for name, p in inspect.signature(
    DistributedDataParallel.__init__).parameters.items() if isinstance(p.default, bool))


# What the idle step and ``step_fn`` pass through DDP to ``_Joinable``, which ignores it: with
# ``device_ids`` (a GPU), DDP's forward moves its inputs and indexes the first, so a call with
# none raises IndexError there (not on the CPU).
PLACEHOLDER_ARGS: tuple[None] = (None,)


class _Joinable(nn.Module):
    """Runs the user's model; while ``idle`` is set, a zero loss over every trainable param;
    while ``step`` is set, ``step(module)`` (a ``step_fn`` on the user's own module)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.idle = False
        self.step: Callable[[nn.Module], Any] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.idle:  # args: PLACEHOLDER_ARGS
            # Touches every trainable parameter, so DDP sees each one's (zero) gradient.
            return zero_loss(self.module)
        if self.step is not None:
            return self.step(self.module)
        return self.module(*args, **kwargs)


def _optimizer_step(ctx: StepContext) -> None:
    """Step as the loop does (gradients clipped, and with a GradScaler (fp16) through it, so
    scales stay in step)."""
    ctx.clip_gradients()
    scaler = ctx.scaler
    if scaler is None:
        ctx.optimizer.step()
    else:
        scaler.step(ctx.optimizer)
        scaler.update()


class AllReduce(Synchronizer):
    """Average gradients every step with PyTorch DDP; other keyword options go to DDP unchanged.

    For example ``AllReduce(bucket_cap_mb=10, gradient_as_bucket_view=True)``. Bytes are
    counted from what DDP all-reduces: every trainable parameter's gradient once per step
    (``2(n-1)/n`` of it on a ring), plus rank 0's buffers when DDP broadcasts them.

    ``comm_hook``: None (plain DDP), ``"fp16"`` or ``"bf16"`` (torch's compress hooks: 2 bytes
    per gradient element), or ``"powersgd"`` (torch's PowerSGD hook) with ``powersgd_rank``
    (default 1, torch's), ``powersgd_warmup`` (steps of plain all-reduce first, torch's
    ``start_powerSGD_iter``, default 1000) and ``comm_hook_options`` (other ``PowerSGDState``
    keywords, e.g. ``{"min_compression_rate": 2, "orthogonalization_epsilon": 1e-8}``). With a
    hook, bytes are counted per bucket from what the hook all-reduces.
    """

    name = "allreduce"
    passed_on = _DDP_OPTIONS
    """The keywords ``**ddp_options`` takes: DistributedDataParallel's."""

    def __init__(self, *, comm_hook: str | None = None, powersgd_rank: int | None = None,
                 powersgd_warmup: int | None = None,
                 comm_hook_options: dict[str, Any] | None = None, **ddp_options: Any) -> None:
        super().__init__()
        unknown = sorted(set(ddp_options) - _DDP_OPTIONS)
        if unknown:
            raise TypeError(f"AllReduce got unknown DDP option(s) {unknown}; expected keyword "
                            f"arguments of DistributedDataParallel: {sorted(_DDP_OPTIONS)} "
                            f"(module, devices and process group are set by paraloom), or "
                            f"comm_hook, powersgd_rank, powersgd_warmup, comm_hook_options")
        flags = [k for k in sorted(ddp_options) if k in _DDP_FLAGS
                 and not isinstance(ddp_options[k], bool)]
        if flags:
            raise TypeError(f"{flags[0]}={ddp_options[flags[0]]!r}; expected True or False "
                            "(a DistributedDataParallel flag)")
        cap = ddp_options.get("bucket_cap_mb")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float)
                                or not cap > 0):
            raise ValueError(f"bucket_cap_mb={cap!r}; expected megabytes > 0 (DDP's bucket "
                             "size: 25 by default) or None")
        self.comm_hook, self._powersgd_options = resolve_comm_hook(
            comm_hook, powersgd_rank, powersgd_warmup, comm_hook_options)
        self.comm_hook_options = dict(comm_hook_options or {})
        self.ddp_options = dict(ddp_options)
        self.setup_bytes_sent = 0
        self._ddp: DistributedDataParallel | None = None
        self._joinable: _Joinable | None = None
        self._powersgd: PowerSGD | None = None
        self._powersgd_resume: dict[str, Any] | None = None
        self._buckets: BucketLayout | None = None
        """DDP's bucket layout: a restored one, or the live DDP's once it has settled on it."""
        self._buckets_settled = False
        self._step_bytes = 0

    def check_model(self, model: nn.Module) -> None:
        """Also refuses sparse gradients (``nn.Embedding(sparse=True)``) with the ``fp16`` and
        ``powersgd`` hooks: torch's fp16 hook cannot add sparse half tensors, and
        ``powerSGD_hook`` views every gradient as a dense matrix."""
        super().check_model(model)
        empty = [name for name, p in model.named_parameters() if p.requires_grad
                 and p.numel() == 0]
        if self.comm_hook == "powersgd" and empty:
            raise ValueError(f"comm_hook='powersgd': parameter {empty[0]!r} has no elements, "
                             "and torch's powerSGD_hook cannot view it as a matrix (it fails "
                             "at the first compressed step); remove it, freeze it, or use "
                             "comm_hook='fp16'")
        if self.comm_hook in ("fp16", "powersgd") and sparse_parameters(model):
            raise ValueError(f"comm_hook={self.comm_hook!r} does not take sparse gradients, "
                             "and the model has a sparse embedding (nn.Embedding(sparse=True)"
                             " or nn.EmbeddingBag(sparse=True)); use comm_hook='bf16' or no "
                             "hook, or sparse=False")

    def wrap_model(self, model: nn.Module, ctx: StepContext) -> nn.Module:
        if not is_distributed(ctx):
            return model
        if self._ddp is not None and self._joinable is not None \
                and self._joinable.module is model:
            return self._ddp  # one DDP per model: a second one would all-reduce twice
        if self.comm_hook == "powersgd" and ctx.scaler is not None:
            raise ValueError("comm_hook='powersgd' with precision='16-mixed': loss-scaled "
                             "gradients that overflow would leave inf in PowerSGD's error "
                             "feedback for good; use precision='bf16-mixed' or '32-true', or "
                             "comm_hook='fp16'")
        self._ddp = self._joinable = None  # drop the old reducer's autograd hooks first
        self._joinable = _Joinable(model)
        device_ids = None
        if ctx.device.type == "cuda":
            index = ctx.device.index
            device_ids = [torch.cuda.current_device() if index is None else index]
        with ddp_with_layout(self._buckets):  # a restored replica adds as the lost one did
            self._ddp = DistributedDataParallel(self._joinable, device_ids=device_ids,
                                                process_group=ctx.group, **self.ddp_options)
        self._buckets_settled = False
        grads = [p for p in model.parameters() if p.requires_grad]
        state = list(model.parameters()) + list(model.buffers())
        if self.comm_hook is None:
            self._step_bytes = sum(self.collective_bytes(p, ctx.world_size) for p in grads)
        else:  # the hook counts what it all-reduces
            self._step_bytes = 0
            self._register_hook(self._ddp, model, ctx)
        if ctx.rank == 0:  # DDP broadcast rank 0's state at construction, buffers every forward
            self.setup_bytes_sent += sum(self.collective_bytes(t, ctx.world_size, "broadcast")
                                         for t in state)
            if self._ddp.broadcast_buffers:
                self._step_bytes += sum(self.collective_bytes(b, ctx.world_size, "broadcast")
                                        for b in model.buffers())
        return self._ddp

    def run_step_fn(self, step_fn: Callable[[nn.Module, Any], Any], module: nn.Module,
                    batch: Any, ctx: StepContext) -> Any:
        """``step_fn`` gets the user's own module (its methods, e.g. ``training_step``, work) and
        runs as DDP's forward, so DDP prepares its reducer and the gradients are all-reduced."""
        joinable = self._joinable
        if self._ddp is None or joinable is None or module is not self._ddp:
            return step_fn(module, batch)  # one process: the model runs unwrapped
        joinable.step = lambda model: step_fn(model, batch)
        try:
            # The batch stays out of DDP's input handling (a placeholder goes in its place).
            return self._ddp(*PLACEHOLDER_ARGS)
        finally:
            joinable.step = None

    def _register_hook(self, ddp: DistributedDataParallel, model: nn.Module,
                       ctx: StepContext) -> None:
        group = ctx.group if ctx.group is not None else dist.group.WORLD
        assert group is not None  # is_distributed: the default group exists
        world_size = ctx.world_size

        def count(numel: int, itemsize: int) -> None:
            self.bytes_sent += self.collective_nbytes(numel * itemsize, world_size)

        self._powersgd = None
        if self.comm_hook != "powersgd":
            assert self.comm_hook is not None
            ddp.register_comm_hook(group, cast_hook(self.comm_hook, count))
            return
        self._powersgd = PowerSGD(self._powersgd_options, group, list(model.parameters()), count)
        if self._powersgd_resume is not None:
            self._powersgd.load_state_dict(self._powersgd_resume)
            self._powersgd_resume = None
        ddp.register_comm_hook(self._powersgd.state, self._powersgd.hook)

    def explain(self, error: BaseException, ctx: StepContext) -> BaseException | None:
        """DDP's errors name DDP's constructor: say which ``ParallelWrapper`` option to set."""
        return explain_ddp_error(error, ctx.model)

    def accumulating(self, ctx: StepContext) -> AbstractContextManager[object]:
        """DDP's ``no_sync()``: the gradients add up locally; the step's backward reduces them."""
        if self._ddp is None:
            return contextlib.nullcontext()
        return self._ddp.no_sync()

    def after_step(self, ctx: StepContext) -> None:
        self.sync_steps += 1
        self.bytes_sent += self._step_bytes if is_distributed(ctx) else 0

    def idle_step(self, ctx: StepContext) -> None:
        self.sync_steps += 1
        if not is_distributed(ctx):
            return
        if self._ddp is None or self._joinable is None:
            raise RuntimeError("allreduce: idle_step before wrap_model; expected the loop to "
                               "run forward through the module that wrap_model returned")
        ctx.optimizer.zero_grad(set_to_none=True)
        self._joinable.idle = True
        try:
            loss = self._ddp(*PLACEHOLDER_ARGS)
        finally:
            self._joinable.idle = False
        # Joins the peers' bucket all-reduces with zero gradients (scaled like theirs in fp16).
        (ctx.scaler.scale(loss) if ctx.scaler is not None else loss).backward()
        _optimizer_step(ctx)
        self.bytes_sent += self._step_bytes

    def finish(self, ctx: StepContext) -> None:
        """Copy rank 0's buffers: each replica's last forward updated its own (e.g. BatchNorm)."""
        if not is_distributed(ctx) or self._joinable is None:
            return
        buffers = list(self._joinable.module.buffers())
        if buffers:
            self.bytes_sent += broadcast_tensors_(buffers, ctx.group, ctx.world_size)

    def stats(self) -> dict[str, float]:
        out = super().stats()
        out["setup_bytes_sent"] = float(self.setup_bytes_sent)
        return out

    def config(self) -> dict[str, Any]:
        plain = (bool, int, float, str, type(None))
        out: dict[str, Any] = {"ddp_options": {k: v if isinstance(v, plain) else repr(v)
                                               for k, v in sorted(self.ddp_options.items())}}
        if self.comm_hook is not None:  # absent without a hook: older checkpoints still match
            out["comm_hook"] = self.comm_hook
        if self.comm_hook == "powersgd":
            out["powersgd_rank"] = self._powersgd_options["matrix_approximation_rank"]
            out["powersgd_warmup"] = self._powersgd_options["start_powerSGD_iter"]
            out["comm_hook_options"] = dict(sorted(self.comm_hook_options.items()))
        return out

    def state_dict(self) -> dict[str, Any]:
        """With PowerSGD, also its state: iteration, RNG, error feedback and Q per parameter;
        and DDP's bucket layout once it has rebuilt its buckets, so that a replica restored
        from it sums each gradient in the order the lost one did (with three or more workers
        the order changes the rounding)."""
        out = super().state_dict()
        saved = self._powersgd.state_dict() if self._powersgd is not None \
            else self._powersgd_resume
        if saved is not None:
            out["powersgd"] = saved
        if self._ddp is not None and not self._buckets_settled:  # read once per DDP
            settled = bucket_layout(self._ddp)
            if settled is not None:
                self._buckets, self._buckets_settled = settled, True
        if self._buckets is not None:
            out["ddp_buckets"] = self._buckets
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters, DDP's bucket layout (for the DDP built next), and PowerSGD's
        state when this synchronizer uses PowerSGD (it applies once the hook is registered
        at setup)."""
        super().load_state_dict(state)
        buckets = state.get("ddp_buckets")
        if self._ddp is None and buckets is not None:  # the DDP that wrap_model builds next
            self._buckets = [[int(i) for i in bucket] for bucket in buckets]
        saved = state.get("powersgd")
        if saved is None or self.comm_hook != "powersgd":
            return
        if self._powersgd is not None:  # this replica's DDP is kept: restore into its hook
            self._powersgd.load_state_dict(saved)
        else:  # wrap_model, which comes next, builds the hook
            self._powersgd_resume = saved

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # A live DDP (and a hook's state, which holds the process group) stays in its process.
        state["_ddp"] = state["_joinable"] = state["_powersgd"] = None
        return state
