"""What a training task sends the driver: one frozen dataclass per kind of record.

A SharedTrainingMaster barrier task yields exactly one ``TaskRecord``:

* ``WorkerFinished``: the worker trained to the end of the fit; its ``WorkerReport``, and from
  rank 0 the final parameters and optimizer state;
* ``WorkerFailed``: a Python error, this worker's own or one that a peer posted on the error
  board and this worker relays (``cause_rank``), so that the driver names the cause;
* ``WorkerRerun``: Spark re-ran this partition alone after the other workers had finished the
  fit (see ``board.py``): it trained nothing and reports nothing.

The driver reads a stage's records with ``shared.stage_outcome``: rank 0's state and every
report, or the ``SparkTrainingError`` to raise.

A ParameterAveragingTrainingMaster task yields one ``AveragingSums``, which ``treeAggregate``
adds up (``averaging_task.add_results``) into the driver's average for that averaging round; a
failed averaging task raises instead, and Spark retries it.

Records reach the driver through Spark's serializer (a pickle of these module-level classes,
which the driver imports too), so they hold plain values, numpy vectors and bytes: the state is
``pack``ed (safetensors), never a pickled tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paraloom.spark.runtime.state import Layout, OptimizerSkeleton
from paraloom.spark.stats import WorkerStats

__all__ = ["WorkerReport", "WorkerFinished", "WorkerFailed", "WorkerRerun", "TaskRecord",
           "AveragingSums", "SparseDelta"]


# -- from a SharedTrainingMaster barrier task --------------------------------------------------
@dataclass(frozen=True)
class WorkerReport:
    """One worker's account of its part of a fit, for the summary and the stats."""

    rank: int
    rounds_per_epoch: int
    """Rounds every worker takes part in per epoch: the most minibatches any partition holds."""
    steps: int
    """Optimizer steps this worker took in this stage attempt (none before a resume)."""
    samples: int
    loop_seconds: float
    """Seconds in the training loop (rendezvous, loading and the final sync left out)."""
    rows: int
    """Rows of this worker's partition."""
    losses: dict[int, tuple[float, int]]
    """Per epoch: (loss times rows summed over this worker's batches, rows)."""
    sync: dict[str, float]
    """The synchronizer's counters (``Synchronizer.stats()``)."""
    digest: str
    """``state_digest`` of the final parameters: equal on every worker when they agree."""
    device: str
    resumed_from_step: int | None
    """The step of the checkpoint this attempt resumed from; None for a fresh start."""
    peak_rss: int
    """Peak resident memory of the task's Python process, in bytes."""
    rendezvous: str
    """Where rank 0's store listened: ``"host:port"``."""
    stats: WorkerStats | None = None
    """Phase timings, with ``fit(collect_stats=True)``."""
    first_step_s: float | None = None
    """Seconds from the fit's start on the driver to this worker's first step."""


@dataclass(frozen=True)
class WorkerFinished:
    """A worker trained to the end of the fit."""

    rank: int
    report: WorkerReport
    state: bytes = b""
    """Rank 0: the final parameters and optimizer state, ``pack``ed; other ranks: empty."""


@dataclass(frozen=True)
class WorkerFailed:
    """A worker's task ended in a Python error: its own, or a peer's that it relays."""

    rank: int
    message: str
    """``"ExceptionType: text"``."""
    traceback: str
    symptom: bool
    """The error only shows that a peer failed (a collective broke; see
    ``training.failures.is_symptom``), or it is relayed: not the cause to report first."""
    cause_rank: int | None = None
    """The rank whose error this is, when relayed (that rank may not report itself)."""


@dataclass(frozen=True)
class WorkerRerun:
    """Spark re-ran this partition alone (``tasks`` of the ``world_size`` barrier tasks) after
    the other workers had finished the fit; nothing was trained."""

    rank: int
    tasks: int


TaskRecord = WorkerFinished | WorkerFailed | WorkerRerun
"""What a SharedTrainingMaster barrier task yields (exactly one)."""


# -- from a ParameterAveragingTrainingMaster task ----------------------------------------------
@dataclass(frozen=True)
class SparseDelta:
    """A task's compressed pseudo-gradient (the master's ``encoding``): a
    ``pseudo_gradients.Selection`` as numpy arrays, and the length of the dense vector."""

    offsets: np.ndarray
    """int16: offset - 32768 within blocks of 65,536 entries, ascending."""
    counts: np.ndarray
    """int32: entries per block."""
    values: np.ndarray
    """int8, float16 or float32 wire values."""
    scale: float
    numel: int

    @property
    def nbytes(self) -> int:
        """Bytes of the message on the wire."""
        return self.offsets.nbytes + self.counts.nbytes + self.values.nbytes + 4


@dataclass(frozen=True)
class AveragingSums:
    """One averaging task's result, or the sum of several (``averaging_task.add_results``).

    A task sends its plain vectors (float32 for a float32 model: half the bytes) with
    ``weighted=False``; the sums, inside ``treeAggregate`` and on the driver, hold float64
    vectors multiplied by the examples each task trained, so that the total divided by ``n``
    is the example-weighted average. A task whose partition has no minibatch left in this
    averaging round sends ``n=0`` and no vectors.
    """

    n: int
    """Examples trained."""
    loss_sum: float = 0.0
    """Loss times rows, summed over the minibatches."""
    steps: int = 0
    model: np.ndarray | None = None
    """The parameters and buffers, ``flatten``ed."""
    layout: Layout | None = None
    optimizer: np.ndarray | None = None
    """With ``save_updater=True``: the optimizer state's tensors, ``flatten``ed."""
    optimizer_layout: Layout | None = None
    skeleton: OptimizerSkeleton | None = None
    """The rest of the optimizer state (``split_optimizer_state``)."""
    bytes_received: int = 0
    bytes_sent: int = 0
    peak_rss: int = 0
    """The most any task's Python process held, in bytes."""
    stats: tuple[WorkerStats, ...] = ()
    """Phase timings of every task summed in, with ``fit(collect_stats=True)``."""
    weighted: bool = False
    """Whether the vectors are float64 sums already multiplied by ``n``."""
    pseudo: np.ndarray | None = None
    """DiLoCo (an ``outer_optimizer`` or ``encoding``): the pseudo-gradient of the trainable
    parameters (start of round minus trained), dense; ``model`` then holds only the buffers."""
    delta: SparseDelta | None = None
    """DiLoCo with a top-k encoding: the task's message instead of ``pseudo`` (``weighted``
    turns it into a dense ``pseudo``)."""
