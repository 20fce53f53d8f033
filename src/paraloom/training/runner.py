"""One replica driven by launcher messages: the loop every launcher shares.

``ReplicaRunner.handle`` serves the worker processes of ``ProcessPool``, the in-process
``LocalPool`` and the Spark tasks alike (see ``training.messages`` for the protocol).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paraloom.clipping import GradientClipping
from paraloom.data import IndexedDataset, batch_size, cpu_copy, split_batch
from paraloom.errors import NotPicklableError
from paraloom.extra_state import detached_state
from paraloom.forward import LossFn
from paraloom.sharding import ReplicaInfo, set_replica_info
from paraloom.sync.base import Synchronizer
from paraloom.training.buffers import with_transient
from paraloom.training.loaders import ReplicaLoader, digest
from paraloom.training.messages import (
    Answer,
    Begin,
    CheckpointReply,
    CheckpointRequest,
    EndAccumulation,
    Finish,
    Finished,
    Hyperparameters,
    IdleRound,
    IndexRound,
    LoaderEpoch,
    LoaderRound,
    ModelState,
    ReplicaResult,
    RestorePoint,
    RestorePointRequest,
    Round,
    RoundMessage,
    StepDone,
    Stop,
    ToReplica,
)
from paraloom.training.optim import OptimizerSpec
from paraloom.training.packing import (
    RESTORE_BUFFERS,
    PackedTensors,
    PackingBuffers,
    pack_tensors,
    unpack_tensors,
)
from paraloom.training.parametrized import by_value
from paraloom.training.replica import Replica, StepFn
from paraloom.training.schedules import SchedulerFactory
from paraloom.training.transport import SharedOutbox

__all__ = ["WorkerSpec", "ReplicaRunner", "pickle_spec"]


@dataclass
class WorkerSpec:
    """Everything a replica needs; pickled once (with cloudpickle) when the pool starts."""

    model: nn.Module
    optimizer: OptimizerSpec
    loss_fn: LossFn | None
    step_fn: StepFn | None
    synchronizer: Synchronizer
    precision: str = "32-true"
    clipping: GradientClipping | None = None
    lr_scheduler: SchedulerFactory | None = None
    accumulate: int = 1
    compile_options: dict[str, Any] | None = None


_PROCESS_HINT = ("Define it at module level, keep open files, locks, threads and generators "
                 "out of it (or leave them out in __getstate__), and guard your script with "
                 "`if __name__ == \"__main__\":`")


def pickle_spec(spec: WorkerSpec, *, destination: str = "the worker processes",
                hint: str = _PROCESS_HINT) -> bytes:
    """Pickle what the replicas need, by value for classes and lambdas defined in scripts;
    what cannot be pickled is named in a ``NotPicklableError``, with ``hint`` as the fix."""
    try:
        data = by_value(spec)
    except Exception as e:
        scripted = [name for name, m in spec.model.named_modules()
                    if isinstance(m, torch.jit.ScriptModule)]
        scripted = ["(the model itself)"] if "" in scripted else [
            n for n in scripted if not any(n.startswith(f"{s}.") for s in scripted)]
        if scripted:  # torch can neither pickle a TorchScript module nor train a copy of one
            hint = (f"The model holds TorchScript modules ({scripted[:3]}, made by "
                    "torch.jit.script or torch.jit.trace), which cannot travel to another "
                    "process: train the Python modules, and script them after training")
        raise NotPicklableError(f"cannot send the {_unpicklable_part(spec)} to {destination}: "
                                f"{type(e).__name__}: {e}. {hint}") from e
    return data


def _unpicklable_part(spec: WorkerSpec) -> str:
    for name in ("model", "loss_fn", "step_fn", "optimizer", "synchronizer"):
        try:
            by_value(getattr(spec, name))
        except Exception:
            return {"optimizer": "optimizer (or optimizer factory)"}.get(name, name)
    return "training setup"


class ReplicaRunner:
    """One replica driven by launcher messages."""

    def __init__(self, spec: WorkerSpec, *, rank: int = 0, world_size: int = 1,
                 device: torch.device | str = "cpu",
                 group: dist.ProcessGroup | None = None, shared_outbox: bool = False) -> None:
        self.rank = rank
        self.world_size = world_size
        self.replica = Replica(spec.model, spec.optimizer, loss_fn=spec.loss_fn,
                               step_fn=spec.step_fn, synchronizer=copy.deepcopy(spec.synchronizer),
                               device=device, group=group, rank=rank, world_size=world_size,
                               precision=spec.precision, clipping=spec.clipping,
                               lr_scheduler=spec.lr_scheduler, accumulate=spec.accumulate,
                               compile_options=spec.compile_options)
        self.dataset: IndexedDataset | None = None
        self.loader: ReplicaLoader | None = None
        self.batch_taken: Callable[[], None] | None = None
        """Called once a round's batch is in hand (the pool tells a worker hung in its data
        from one hung in its model)."""
        self.steps = 0
        # A worker process sends its final state through reused shared memory (see SharedOutbox),
        # and its restore points too (PackingBuffers).
        self.outbox = SharedOutbox() if shared_outbox else None
        self.restore_buffers = PackingBuffers(RESTORE_BUFFERS)

    def handle(self, message: ToReplica) -> Answer | None:
        """Act on one message; returns the reply to send back, if it has one."""
        match message:
            case Round() | IndexRound() | LoaderRound() | IdleRound():
                began = time.perf_counter()
                done = self.train(message)
                timing = self.replica.timing
                timing.rounds += 1
                timing.round_s += time.perf_counter() - began
                return done
            case Begin():
                self.begin(message)
            case Hyperparameters():
                self.replica.set_hyperparameters(message.settings)
            case EndAccumulation():
                self.replica.end_accumulation()
            case LoaderEpoch():
                self._own_loader().start_epoch(message.epoch, message.seed, message.batches,
                                               message.first, message.stride)
            case CheckpointRequest():
                # Packed: one segment for the parent to fetch, not one per tensor (each a
                # round trip with this process's descriptor server, which waits for the GIL
                # while the replica trains on: a worker that failed a few rounds later took
                # its checkpoint's unfetched tensors with it).
                return CheckpointReply(self.rank, message.tag,
                                       pack_tensors(self.replica.full_state(independent=False)))
            case RestorePointRequest():
                started = time.perf_counter()
                state = self.restore_buffers.pack(self.replica.full_state(independent=False))
                return RestorePoint(self.rank, message.round_id, state,
                                    time.perf_counter() - started)
            case Finish():
                return Finished(self.rank, self.finish(with_state=self.rank == 0))
            case Stop():
                pass
            case _:
                raise TypeError(f"a replica got a {type(message).__name__}; expected one of "
                                f"{ToReplica}")
        return None

    def begin(self, message: Begin) -> None:
        """Start a fit(): load the user's model state (or this rank's resume state), set up the
        synchronizer; ``seed`` (when not resuming) seeds this replica's RNG as ``seed + rank``."""
        self.dataset = message.dataset
        if self.loader is not None:
            self.loader.close()
        self.loader = None if message.loader is None else \
            ReplicaLoader(message.loader, self.rank, self.world_size)
        set_replica_info(ReplicaInfo(self.rank, self.world_size))
        self.steps = 0
        seed = None if message.seed is None or message.resume is not None \
            else message.seed + self.rank
        resume = message.resume
        if isinstance(resume, PackedTensors):
            resume = unpack_tensors(resume)
        self.replica.begin_fit(message.state, resume, message.optimizer_state, seed,
                               message.hyperparameters, message.continue_schedule)

    def train(self, message: RoundMessage) -> StepDone:
        """Train on this round's batch (or take part idly); reports the loss and rows."""
        self.replica.take_restored_rng()  # before the batch is built: augmentations draw
        if isinstance(message, IdleRound):
            self.replica.step(None)
            return StepDone(self.rank, message.round_id, None, 0, self._synchronized())
        if isinstance(message, LoaderRound):
            return self._train_loaded(message)
        began = time.perf_counter()
        batch = message.batch if isinstance(message, Round) else self._gather(message.indices)
        self._fetched()
        self.replica.timing.data_s += time.perf_counter() - began
        loss = self.replica.step(batch)
        self.steps += 1
        rows = _rows(batch)
        return StepDone(self.rank, message.round_id, loss, rows, self._synchronized(),
                        rows_agree=_rows_agree(batch, rows))

    def _train_loaded(self, message: LoaderRound) -> StepDone:
        """Train on the next batch of this replica's own DataLoader (idly once a stream ends)."""
        loader = self._own_loader()
        began = time.perf_counter()
        batch = loader.take(message.epoch, message.position)
        self._fetched()
        self.replica.timing.data_s += time.perf_counter() - began
        loss = self.replica.step(batch)
        rows = 0
        if batch is not None:
            self.steps += 1
            rows = _rows(batch)
        fingerprint = digest(batch) if batch is not None and loader.spec.stream and \
            message.position < max(1, loader.spec.num_workers) else None
        return StepDone(self.rank, message.round_id, loss, rows, self._synchronized(),
                        more=loader.has_more(), digest=fingerprint,
                        rows_agree=batch is not None and _rows_agree(batch, rows))

    def _fetched(self) -> None:
        if self.batch_taken is not None:
            self.batch_taken()

    def _own_loader(self) -> ReplicaLoader:
        if self.loader is None:
            raise RuntimeError("got a LoaderEpoch or LoaderRound before a loader: the launcher "
                               "must send the loader with Begin")
        return self.loader

    def _gather(self, indices: list[int]) -> Any:
        if self.dataset is None:
            raise RuntimeError("got an IndexRound before a dataset: the launcher must send "
                               "the dataset with Begin")
        return self.dataset.gather(indices)

    def _synchronized(self) -> bool:
        return self.replica.sync.synchronized()

    def finish(self, with_state: bool) -> ReplicaResult:
        """End of fit(): final synchronization; ``with_state`` adds the parameters and
        optimizer state to the result."""
        self.replica.finish()
        if self.loader is not None:
            self.loader.close()
        set_replica_info(None)
        stats = {**self.replica.sync.stats(), **self.replica.timing.stats()}
        if not with_state:
            return ReplicaResult(stats, self.steps)
        return ReplicaResult(stats, self.steps, *self.final_state())

    def final_state(self) -> tuple[ModelState, dict[str, Any]]:
        """CPU copies of the parameters and buffers, and of the optimizer state (in the outbox's
        shared memory, which the next fit's state overwrites, when there is one)."""
        model = self.replica.model
        returned = self.replica.sync.returned_parameters()
        weights = detached_state(model.state_dict(keep_vars=True), returned)
        state = with_transient(model, weights), self.replica.optimizer.state_dict()
        return cpu_copy(state) if self.outbox is None else self.outbox.copy(state)


def _rows(batch: Any) -> int:
    """A batch's rows, for the samples counted and the round's loss weights: its inputs', the
    first tensor's of a step_fn's batch of another structure, or (as Lightning) the first
    tensor among an object's attributes, else one."""
    for part in (lambda: split_batch(batch)[0], lambda: batch,
                 lambda: list(getattr(batch, "__dict__", {}).values())):
        try:
            return batch_size(part())
        except TypeError:
            continue
    return 1


def _rows_agree(batch: Any, rows: int) -> bool:
    """Whether ``batch`` splits into inputs and targets, the targets a tensor of ``rows``
    rows (a pre-batched item of a ``DataLoader(batch_size=None)``; a sample's target is a
    scalar or has another length than its features)."""
    try:
        targets = split_batch(batch)[1]
    except TypeError:
        return False
    return isinstance(targets, torch.Tensor) and targets.dim() > 0 and targets.shape[0] == rows
