"""ParallelWrapper's options, grouped by concern: each a small frozen dataclass with defaults.

- ``StepOptions``: what each replica does in a step besides forward and backward (the
  learning-rate schedule, gradient clipping, gradient accumulation, ``torch.compile``);
- ``FaultTolerance``: how long a wait may take, and how many worker failures a fit survives;
- ``LoopOptions``: how the parent runs a fit (batches dealt ahead, the progress bar, scores).

Every option also works as a keyword of ``ParallelWrapper`` itself
(``ParallelWrapper(..., max_failures=2)`` is ``faults=FaultTolerance(max_failures=2)``):
``WrapperKeywords`` lists those keywords, with the synchronizers' options, and
``split_keywords`` sorts them into the groups.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from paraloom._warnings import warn
from paraloom.clipping import GradientClipping
from paraloom.training.schedules import SchedulerFactory

if TYPE_CHECKING:
    from paraloom.sync.sharing import SharingRecipe
    from paraloom.sync.thresholds import ResidualPostProcessor, ThresholdAlgorithm

__all__ = ["FaultTolerance", "LoopOptions", "StepOptions", "WrapperKeywords", "refuse_misplaced",
           "split_keywords"]


@dataclass(frozen=True)
class StepOptions:
    """What each replica does in a step besides forward and backward.

    Raises ``TypeError`` for an ``lr_scheduler`` that is a scheduler object (or not callable),
    ``ValueError`` for a clipping value that is not a number > 0 or an unknown algorithm.
    """

    lr_scheduler: SchedulerFactory | None = None
    """A function that builds the scheduler on each replica's optimizer, e.g.
    ``lambda opt: OneCycleLR(opt, max_lr=0.1, total_steps=N)``; every replica steps it after
    every round. None: the learning rate changes only as you change it between epochs."""
    gradient_clip_val: float | None = None
    """Clip the gradients before each optimizer step (Lightning's name); None: no clipping."""
    gradient_clip_algorithm: str = "norm"
    """``"norm"``: scale to a global 2-norm of at most the value; ``"value"``: clamp each
    element to ``[-value, value]``."""
    accumulate: int = 1
    """Gradient accumulation (Lightning's ``accumulate_grad_batches``): each replica adds up
    the gradients of ``accumulate`` rounds' batches (each loss divided by ``accumulate``) and
    the replicas exchange and step once, so an exchange serves ``accumulate`` times the
    samples. The last step of an epoch takes what the epoch's last rounds accumulated. The
    schedule steps, and ``averaging_frequency`` counts, once per optimizer step. 1: step every
    round."""
    compile: bool | Mapping[str, Any] = False
    """``torch.compile`` each replica's model (True), or the keywords for it (e.g.
    ``{"mode": "max-autotune"}`` or ``{"backend": "aot_eager"}``). The first rounds then
    include the compilation: ``stats()["compile_seconds"]`` reports it apart. False: eager."""

    def __post_init__(self) -> None:
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) \
                or self.accumulate < 1:
            raise ValueError(f"accumulate={self.accumulate!r}; expected an int >= 1 (batches "
                             "whose gradients add up before each exchange and optimizer step)")
        if not isinstance(self.compile, bool | Mapping):
            raise TypeError(f"compile={self.compile!r}; expected True, False or a dict of "
                            "torch.compile keywords such as {'mode': 'max-autotune'}")
        if isinstance(self.compile, Mapping):
            known = set(inspect.signature(torch.compile).parameters) - {"model"}
            unknown = sorted(map(str, set(self.compile) - known))
            if unknown:
                raise TypeError(f"compile= has unknown torch.compile keyword(s) {unknown}; "
                                f"it takes {sorted(known)}")
        scheduler = self.lr_scheduler
        if scheduler is not None and (isinstance(scheduler, LRScheduler)
                                      or not callable(scheduler)):
            raise TypeError(f"lr_scheduler={scheduler!r}; expected a function that builds "
                            f"the scheduler on each replica's optimizer, e.g. lambda opt: "
                            f"OneCycleLR(opt, max_lr=0.1, total_steps=N) (a scheduler object "
                            f"steps your optimizer, which no replica trains with: step it in a "
                            f"listener's on_epoch_end instead)")
        GradientClipping.of(self.gradient_clip_val, self.gradient_clip_algorithm)

    @property
    def clipping(self) -> GradientClipping | None:
        """The clipping these options ask for, or None."""
        return GradientClipping.of(self.gradient_clip_val, self.gradient_clip_algorithm)

    @property
    def compile_options(self) -> dict[str, Any] | None:
        """The keywords for ``torch.compile``, or None for an eager model."""
        if isinstance(self.compile, Mapping):
            return dict(self.compile)
        return {} if self.compile else None


_MIN_HEARTBEAT_S = 0.25  # 2.5 beats of the workers' heartbeat (every 0.1 s): none is missed
_MAX_TIMEOUT_S = 1e8  # about 3 years: the most torch.distributed's timeouts convert


def _seconds(name: str, value: object, alternative: str) -> None:
    """Refuse a time that is not a number of seconds > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}={value!r}; expected seconds > 0 as a number{alternative}")
    if not value > 0:
        raise ValueError(f"{name}={value!r}; expected seconds > 0{alternative}")


@dataclass(frozen=True)
class FaultTolerance:
    """How long a wait may take, and how many worker failures a fit survives.

    Raises ``TypeError`` for a time that is not a number, ``ValueError`` for one that is not
    > 0 (None turns a watch off), or a ``max_failures`` or ``spares`` that is not an int >= 0.
    """

    max_failures: int = 0
    """Worker failures (a crash, a hang, an exception in a replica) one ``fit()`` survives by
    replacing the failed worker (on CPUs the others keep their processes; on GPUs every
    worker is replaced) and beginning every replica again from the last restore point, with
    results exactly as without the failure. 0: the first failure raises ``WorkerError``."""
    timeout: float = 300.0
    """Seconds any single wait may take: a queue, a join, a collective, the rendezvous store,
    a spare still starting (the workers' own start is bounded separately, at 120 s); at most
    1e8."""
    heartbeat_timeout: float | None = 2.0
    """Seconds without a heartbeat from a worker process before it counts as hung (its
    heartbeat runs on its own thread, every 0.1 s, so a slow step is not a hang; at least
    0.25). None: no watch."""
    step_timeout: float | None = None
    """Seconds one round may take on a worker before it counts as hung. None: ``timeout``."""
    spares: int = 1
    """With ``max_failures > 0``: workers started ahead, in the background, past their
    imports, that take a failed worker's place instead of one started then; a used spare is
    replaced 1 s later. On CPUs each spare is one process that takes the failed worker's
    rank; on GPUs (where every worker is replaced) each is a whole pool of ``workers``
    processes in a process group of their own. Each holds memory (and, on GPUs, a CUDA
    context per device) while it waits. 0: a recovery starts the processes itself (about
    0.1 s more per failure)."""

    def __post_init__(self) -> None:
        _seconds("timeout", self.timeout, "")
        if not self.timeout <= _MAX_TIMEOUT_S:
            raise ValueError(f"timeout={self.timeout!r}; expected at most {_MAX_TIMEOUT_S:g} "
                             "seconds (torch.distributed's collectives take no longer ones; "
                             "step_timeout=None and heartbeat_timeout=None turn the watches "
                             "off)")
        for name in ("heartbeat_timeout", "step_timeout"):
            value = getattr(self, name)
            if value is not None:
                _seconds(name, value, ", or None to turn this watch off")
        if self.heartbeat_timeout is not None and self.heartbeat_timeout < _MIN_HEARTBEAT_S:
            raise ValueError(f"heartbeat_timeout={self.heartbeat_timeout!r}; expected at least "
                             f"{_MIN_HEARTBEAT_S} s: the workers beat every 0.1 s, so a shorter "
                             "wait takes healthy workers for dead (None turns the watch off)")
        if isinstance(self.max_failures, bool) or not isinstance(self.max_failures, int) \
                or self.max_failures < 0:
            raise ValueError(f"max_failures={self.max_failures!r}; expected an int >= 0 (0 "
                             "raises WorkerError at the first failure)")
        if isinstance(self.spares, bool) or not isinstance(self.spares, int) or self.spares < 0:
            raise ValueError(f"spares={self.spares!r}; expected an int >= 0 (0: a recovery "
                             "starts its own workers)")
        if self.spares > 1 and self.max_failures == 0:
            warn(f"spares={self.spares} with max_failures=0: spares stand in for "
                 "failed workers, and the first failure ends the fit; give "
                 "max_failures= to use them", UserWarning)


@dataclass(frozen=True)
class LoopOptions:
    """How the parent process runs a fit.

    Raises ``TypeError`` for a ``prefetch_buffer`` that is not an int or flags that are not
    bools, ``ValueError`` for a negative ``prefetch_buffer``.
    """

    prefetch_buffer: int = 16
    """Batches per worker read ahead of the training (DL4J's prefetchBuffer): the reader
    holds up to ``prefetch_buffer * workers`` batches, and the parent deals up to about
    ``prefetch_buffer`` batches in all (at least two rounds) ahead of the replicas'
    replies. 0: no reading ahead."""
    progress: bool = True
    """Show a tqdm progress bar with the loss and samples/s."""
    report_score_after_averaging: bool = False
    """Log the loss of each round that ended with every replica synchronized ("Averaged
    score: ..." on the ``paraloom.score`` logger, as DL4J's reportScoreAfterAveraging): an
    averaging, or a DiLoCo synchronization of the whole model (with ``fragments`` > 1 none
    is). Listeners and the bar see every round either way."""

    def __post_init__(self) -> None:
        if isinstance(self.prefetch_buffer, bool) or not isinstance(self.prefetch_buffer, int):
            raise TypeError(f"prefetch_buffer={self.prefetch_buffer!r}; expected an int >= 0 "
                            "(batches per worker read ahead)")
        if self.prefetch_buffer < 0:
            raise ValueError(f"prefetch_buffer={self.prefetch_buffer}; expected >= 0")
        for name in ("progress", "report_score_after_averaging"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r}; expected True or False")

    def queue_depth(self, workers: int) -> int:
        """Rounds a worker's queue holds: how far the parent deals ahead of the replies."""
        return max(2, -(-self.prefetch_buffer // workers))


class WrapperKeywords(TypedDict, total=False):
    """The keywords ``ParallelWrapper`` takes besides its named parameters: each option of
    ``StepOptions``, ``FaultTolerance`` and ``LoopOptions``, and the training mode's own."""

    lr_scheduler: SchedulerFactory | None
    gradient_clip_val: float | None
    gradient_clip_algorithm: str
    accumulate: int
    compile: bool | Mapping[str, Any]
    max_failures: int
    timeout: float
    heartbeat_timeout: float | None
    step_timeout: float | None
    spares: int
    prefetch_buffer: int
    progress: bool
    report_score_after_averaging: bool
    # "averaging" (paraloom.sync.Averaging)
    averaging_frequency: int
    average_updaters: bool
    # "shared_gradients" (paraloom.sync.SharingRecipe)
    recipe: str | SharingRecipe
    threshold_algorithm: ThresholdAlgorithm | None
    residual_post_processor: ResidualPostProcessor | None
    combine: str | None
    momentum_masking: bool | None
    gradients_at: str | None
    encoding: str
    broadcast_buffers: bool
    overlap: bool | None
    # "diloco" (paraloom.sync.DiLoCo)
    sync_every: int
    outer_optimizer: Callable[[Iterable[Tensor]], Optimizer] | None
    density: float
    values: str
    fragments: int
    exchange: str
    overlap_rounds: int
    # "allreduce" (paraloom.sync.AllReduce, then DistributedDataParallel's own keywords as of
    # torch 2.13: AllReduce refuses those this torch's DDP does not take)
    comm_hook: str | None
    powersgd_rank: int | None
    powersgd_warmup: int | None
    comm_hook_options: dict[str, Any] | None
    bucket_cap_mb: float | None
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    static_graph: bool
    dim: int
    init_sync: bool
    check_reduction: bool
    delay_all_reduce_named_params: object
    param_to_hook_all_reduce: object
    mixed_precision: object
    skip_all_reduce_unused_params: bool
    bucket_cap_mb_list: list[int] | None
    batched_grad_copy: bool
    forward_sync_buffers: bool | None


_Group = TypeVar("_Group", StepOptions, FaultTolerance, LoopOptions)


def _merged(given: _Group | None, cls: type[_Group], keywords: dict[str, Any],
            parameter: str) -> _Group:
    """``given`` (or the defaults) with the flat keywords of its fields applied on top."""
    if given is not None and not isinstance(given, cls):
        raise TypeError(f"{parameter}={given!r}; expected a {cls.__name__}(...)")
    names = {f.name for f in dataclasses.fields(cls)}
    mine = {key: keywords.pop(key) for key in list(keywords) if key in names}
    base = given if given is not None else cls()
    return dataclasses.replace(base, **mine) if mine else base


def split_keywords(keywords: dict[str, Any], *, steps: StepOptions | None,
                   faults: FaultTolerance | None, loop: LoopOptions | None
                   ) -> tuple[StepOptions, FaultTolerance, LoopOptions, dict[str, Any]]:
    """The three option groups, each from its object (or defaults) with its flat keywords
    applied, and the keywords left for the synchronizer."""
    rest = dict(keywords)
    return (_merged(steps, StepOptions, rest, "steps"),
            _merged(faults, FaultTolerance, rest, "faults"),
            _merged(loop, LoopOptions, rest, "loop"), rest)


def refuse_misplaced(keywords: dict[str, Any], fit: Callable[..., object]) -> None:
    """Refuse ``fit()``'s arguments (epochs=, batch_size=, ...) given to the constructor."""
    fit_arguments = set(inspect.signature(fit).parameters) - {"self", "data"}
    misplaced = sorted(fit_arguments & set(keywords))
    if misplaced:
        names = ", ".join(f"{k}=" for k in misplaced)
        verbs = ("is not a ParallelWrapper option; it goes", "are not ParallelWrapper options; "
                 "they go")[len(misplaced) > 1]
        example = ", ".join(f"{k}={keywords[k]!r}" for k in misplaced)
        raise TypeError(f"{names} {verbs} to fit(): wrapper.fit(data, {example})")
