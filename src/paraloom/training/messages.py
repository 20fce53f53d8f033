"""The messages between a launcher and its replicas: one frozen dataclass per message.

To a replica, in order: ``Begin``; then per round one of ``Round`` (a batch), ``IndexRound``
(indices into the dataset sent with ``Begin``), ``LoaderRound`` (the next batch of the
replica's own DataLoader, whose epoch a ``LoaderEpoch`` starts) or ``IdleRound`` (no batch in
a short last round), or a ``RoundBatch`` of several of them in order, with an
``EndAccumulation`` at an epoch's end with gradient accumulation, a
``CheckpointRequest`` after a round when a listener wants a checkpoint and a
``RestorePointRequest`` when the pool keeps restore points to recover from failures; then
``Finish``; ``Stop`` ends a worker process. ``Pickled`` wraps ``Begin``, ``Round`` or a
``RoundBatch`` of them, pickled by the parent (classes by value, tensors in shared memory)
because they carry user objects.

From a replica: ``Ready`` once started; ``StepDone`` per round (a ``RoundsDone`` of them per
``RoundBatch``); ``CheckpointReply`` and ``RestorePoint`` per request; ``Finished`` after
``Finish``; ``Failed`` instead of any of them when it fails.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch

from paraloom.data import IndexedDataset
from paraloom.training.loaders import LoaderSpec
from paraloom.training.packing import BufferedState, PackedTensors

__all__ = [
    "Begin", "Hyperparameters", "EndAccumulation", "Round", "IndexRound", "LoaderEpoch",
    "LoaderRound", "IdleRound",
    "RoundMessage", "RoundBatch", "RoundsDone", "CheckpointRequest",
    "RestorePointRequest", "Finish", "Stop", "Regroup", "Pickled", "ToReplica", "Ready", "StepDone",
    "CheckpointReply", "RestorePoint", "ReplicaResult", "Finished", "Failed", "Answer", "Reply",
    "ModelState", "ReplicaState",
]

ModelState = dict[str, torch.Tensor]
"""A model's ``state_dict()``: parameters and buffers by name."""
ReplicaState = dict[str, Any]
"""Everything needed to continue one replica exactly (``Replica.full_state()``): weights,
optimizer, synchronizer, step and RNG states. Stored per rank in a training checkpoint."""


# -- to a replica ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Begin:
    """Start a fit(): the user's model state, the dataset for index rounds, and where to resume.
    ``state`` None: keep the parameters this replica holds (a warm fit() of an unchanged
    model)."""

    state: ModelState | None
    dataset: IndexedDataset | None = None
    resume: ReplicaState | PackedTensors | None = None
    """This rank's state from a checkpoint or a restore point (packed); replaces ``state`` and
    ``optimizer_state``."""
    optimizer_state: dict[str, Any] | None = None
    """The user's optimizer ``state_dict()`` (a learning rate changed between fits applies)."""
    seed: int | None = None
    """Seeds the replica's RNG as ``seed + rank`` (ignored when resuming)."""
    loader: LoaderSpec | None = None
    """The data source each replica loads itself (``LoaderEpoch`` / ``LoaderRound``)."""
    hyperparameters: list[dict[str, Any]] | None = None
    """Each optimizer param group's settings, applied when ``optimizer_state`` is None (a warm
    fit() whose optimizer state the replicas already hold)."""
    continue_schedule: bool = False
    """Keep the ``lr_scheduler`` the replica stepped in the previous fit() (training driven
    epoch by epoch, ``initial_epoch > 0``), rather than start a fresh schedule."""


@dataclass(frozen=True)
class Hyperparameters:
    """The user's optimizer settings (each param group's, without its parameters), changed by a
    listener during a fit, e.g. a learning-rate scheduler stepped in ``on_epoch_end``: applied
    before the next round, which the parent deals only after every earlier round is done."""

    settings: list[dict[str, Any]]


@dataclass(frozen=True)
class EndAccumulation:
    """An epoch ended part way through a gradient accumulation (``accumulate=k``): step on
    the gradients its rounds added up, as every replica does at once."""


@dataclass(frozen=True)
class Round:
    """Train on one batch: ``(inputs, targets)``, its tensors in shared memory."""

    round_id: int
    batch: Any


@dataclass(frozen=True)
class IndexRound:
    """Train on the batch made of these rows of the dataset sent with ``Begin``."""

    round_id: int
    indices: list[int]


@dataclass(frozen=True)
class LoaderEpoch:
    """Start ``epoch`` of the replica's own DataLoader (``Begin.loader``).

    For a map-style dataset ``batches`` are this replica's batches of indices, in order: the
    ``first``-th batch of the epoch, then every ``stride``-th (batch ``k`` loads with the RNGs
    seeded ``seed + k``); None for a stream, whose loader generator is seeded ``seed + rank``.
    """

    epoch: int
    seed: int
    batches: list[list[int]] | None = None
    first: int = 0
    stride: int = 1


@dataclass(frozen=True)
class LoaderRound:
    """Train on the batch at ``position`` of this replica's share of ``epoch``; a stream that
    has ended takes part idly."""

    round_id: int
    epoch: int
    position: int


@dataclass(frozen=True)
class IdleRound:
    """No batch for this replica this round: take part in the synchronization only."""

    round_id: int


RoundMessage = Round | IndexRound | LoaderRound | IdleRound


@dataclass(frozen=True)
class RoundBatch:
    """Several rounds in one message, trained in order and answered with one ``RoundsDone``:
    where a step takes milliseconds, one message per round would cost the parent more CPU
    than the rounds' own work (``FitRun`` batches rounds by the steps' length)."""

    rounds: tuple[RoundMessage, ...]

    @property
    def round_id(self) -> int:
        """The last round in the batch."""
        return self.rounds[-1].round_id


@dataclass(frozen=True)
class CheckpointRequest:
    """Report this replica's full state after round ``tag`` (for a training checkpoint)."""

    tag: int


@dataclass(frozen=True)
class RestorePointRequest:
    """Report this replica's full state after round ``round_id``: the pool restarts from it
    if a worker fails later."""

    round_id: int


@dataclass(frozen=True)
class Finish:
    """End of fit(): synchronize a last time and report the result."""


@dataclass(frozen=True)
class Stop:
    """Leave the worker loop (the process then exits)."""


@dataclass(frozen=True)
class Regroup:
    """Join a new process group as ``rank`` (a spare learns its rank so) and build a new
    replica: a peer failed, and the pool replaced it without restarting this worker. What was
    queued before it is dropped; a ``Begin`` from the restore point follows."""

    generation: int
    """The group's number: its rendezvous keys carry it, apart from the earlier groups'."""
    rank: int


@dataclass(frozen=True)
class Pickled:
    """A message pickled by ``training.transport.dumps``: user classes travel by value.

    Each can be unpacked once: its tensors are shared-memory handles.
    """

    data: bytes
    round_id: int | None = None
    """The (first) round of a pickled ``Round`` or ``RoundBatch``, readable before unpickling
    (for error reports)."""
    handles: tuple[int, ...] = ()
    """The sender's keys for the file descriptors it hands over (``transport.dumps``)."""

    def unpack(self) -> ToReplica:
        message = pickle.loads(self.data)
        if not isinstance(message, ToReplica):
            raise TypeError(f"a Pickled message held a {type(message).__name__}; expected one "
                            f"of {ToReplica}")
        return message


ToReplica = (Begin | Hyperparameters | EndAccumulation | Round | IndexRound | LoaderEpoch
             | LoaderRound | IdleRound | RoundBatch | CheckpointRequest | RestorePointRequest
             | Finish | Stop | Regroup)


# -- from a replica ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The worker process has joined the process group and built its replica."""

    rank: int
    generation: int = 0
    """The group it joined (``Regroup``)."""


@dataclass(frozen=True)
class StepDone:
    """A round is done on one replica."""

    rank: int
    round_id: int
    loss: float | None
    """The batch's loss; None for an idle round."""
    rows: int
    synced: bool
    """Whether the round ended at a synchronization point (every replica holds the same
    parameters), as ``Synchronizer.synchronized()`` says."""
    more: bool = True
    """After a ``LoaderRound`` over a stream: whether this replica has another batch."""
    digest: str | None = None
    """A fingerprint of a stream's first batches (replicas that all read the same data)."""
    skipped: bool = False
    """The round was queued when ``stop()`` halted the fit: no replica trained it."""
    rows_agree: bool = False
    """Whether the batch's targets have its inputs' rows: how an item of a
    ``DataLoader(batch_size=None)`` is told to be a batch (counted ``rows``), not a sample."""


@dataclass(frozen=True)
class RoundsDone:
    """The answer to a ``RoundBatch``: each round's ``StepDone``, in order (the pool hands
    them on one by one)."""

    replies: tuple[StepDone, ...]


@dataclass(frozen=True)
class CheckpointReply:
    """One replica's full state after round ``tag``, packed: one shared-memory segment, which
    the parent fetches in one exchange with the worker as it reads the reply (not one per
    tensor, while the worker trains on and may fail)."""

    rank: int
    tag: int
    state: PackedTensors


@dataclass(frozen=True)
class RestorePoint:
    """One replica's full state after round ``round_id`` (packed: one shared-memory segment,
    passed once and reused), and the seconds taking it took."""

    rank: int
    round_id: int
    state: BufferedState | PackedTensors
    seconds: float


@dataclass(frozen=True)
class ReplicaResult:
    """What a replica reports at the end of a fit(); rank 0 adds the final state."""

    stats: dict[str, float]
    steps: int
    state: ModelState | None = None
    optimizer_state: dict[str, Any] | None = None


@dataclass(frozen=True)
class Finished:
    """A replica's answer to ``Finish``."""

    rank: int
    result: ReplicaResult


@dataclass(frozen=True)
class Failed:
    """A replica raised: where, what, and the remote traceback."""

    rank: int
    round_id: int | None
    message: str
    traceback: str
    kind: str
    """The exception's type name, e.g. ``"NonFiniteLossError"``."""


Answer = StepDone | CheckpointReply | RestorePoint | Finished
"""What a replica answers to a message; ``Pool.recv`` returns these (restore points only to
the pool that asked for them: ``training.recovery``)."""
Reply = Ready | Answer | RoundsDone | Failed
"""Everything a worker process puts on the result queue."""
