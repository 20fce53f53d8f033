"""Training listeners: callbacks the parent process fires once per round, not once per worker.

``iteration`` counts rounds across fit() calls (a round is one batch per worker); the loss
passed is the mean loss of the workers that trained in the round.
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from paraloom import ParallelWrapper, TrainingCheckpoint, WorkerError

__all__ = ["TrainingListener", "ScoreListener", "PerformanceListener", "CheckpointListener",
           "ValidationListener", "as_listener"]

log = logging.getLogger("paraloom")


class TrainingListener:
    """A base class for ``ParallelWrapper(listeners=[...])``: override the hooks you need
    (each does nothing by default). The hooks run in the calling process, in order: fit
    start, epoch start, every iteration (with its mean loss), epoch end, checkpoints, worker
    failures, fit end. A hook that raises stops the fit with its error."""

    def on_fit_start(self, wrapper: ParallelWrapper) -> None:
        """Before the first round of a fit(); ``wrapper.stop()`` ends the fit early."""

    def on_epoch_start(self, epoch: int) -> None:
        """Before the first round of an epoch."""

    def on_iteration(self, iteration: int, epoch: int, loss: float) -> None:
        """After a round."""

    def on_epoch_end(self, epoch: int, loss: float) -> None:
        """After the last round of an epoch; ``loss`` is the epoch's mean round loss."""

    def on_fit_end(self, wrapper: ParallelWrapper) -> None:
        """After the final synchronization; the user's model holds the result."""

    def wants_checkpoint(self, iteration: int, epoch: int, epoch_end: bool) -> bool:
        """Asked when round ``iteration`` is dealt: should a checkpoint be taken after it?"""
        return False

    def on_checkpoint(self, checkpoint: TrainingCheckpoint) -> None:
        """A ``TrainingCheckpoint`` this listener asked for, complete."""

    def on_worker_failure(self, rank: int | None, error: WorkerError, recovered: bool) -> None:
        """Worker ``rank`` failed (None: which one is unknown); ``recovered``: training goes on
        from the last restore point (``max_failures=``), else ``error`` is raised next."""


class _CallableListener(TrainingListener):
    def __init__(self, fn: Callable[[int, int, float], object]) -> None:
        self.fn = fn

    def on_iteration(self, iteration: int, epoch: int, loss: float) -> None:
        self.fn(iteration, epoch, loss)


def as_listener(obj: object) -> TrainingListener:
    """A TrainingListener, or a callable ``fn(iteration, epoch, loss)`` wrapped as one."""
    if isinstance(obj, TrainingListener):
        return obj
    if callable(obj):
        return _CallableListener(obj)
    raise TypeError(f"a listener must be a TrainingListener or a callable (iteration, epoch, "
                    f"loss); got {type(obj).__name__}")


def iteration_of(path: Path) -> int:
    """The iteration in a CheckpointListener's file name; -1 for another name."""
    try:
        return int(path.stem.rsplit("-iter", 1)[1])
    except (IndexError, ValueError):
        return -1


def run_of(path: Path) -> str | None:
    """The run a checkpoint file belongs to ("" if written before runs had ids, None if it
    cannot be read), from its header alone."""
    import json

    from safetensors import safe_open

    from paraloom.safetensors_files import TRAINING_HEADER_KEY

    try:
        with safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {})[TRAINING_HEADER_KEY])
        return str(header.get("run", "")) if isinstance(header, dict) else None
    except Exception:  # safetensors' own error type: unreadable, or not a checkpoint
        return None


def _positive(name: str, value: int | None) -> int | None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r}; expected an int >= 1 or None")
    return value


class ScoreListener(TrainingListener):
    """Log the loss every ``frequency`` iterations (and keep the history in ``scores``)."""

    def __init__(self, frequency: int = 10, logger: logging.Logger | None = None) -> None:
        self.frequency = _positive("frequency", frequency) or 1
        self.logger = logger or log
        self.scores: list[tuple[int, int, float]] = []

    def on_iteration(self, iteration: int, epoch: int, loss: float) -> None:
        if iteration % self.frequency == 0:
            self.scores.append((iteration, epoch, loss))
            self.logger.info("iteration %d (epoch %d): loss %.6f", iteration, epoch, loss)


class PerformanceListener(TrainingListener):
    """Log samples/s, batches/s and the ETA every ``frequency`` iterations."""

    def __init__(self, frequency: int = 50, logger: logging.Logger | None = None) -> None:
        self.frequency = _positive("frequency", frequency) or 1
        self.logger = logger or log
        self.wrapper: ParallelWrapper | None = None
        self.reports: list[dict[str, float]] = []

    def on_fit_start(self, wrapper: ParallelWrapper) -> None:
        self.wrapper = wrapper

    def on_iteration(self, iteration: int, epoch: int, loss: float) -> None:
        if iteration % self.frequency or self.wrapper is None:
            return
        p = self.wrapper.live_stats()
        elapsed = max(p["seconds"], 1e-9)
        report = {"iteration": iteration, "samples_per_s": p["samples"] / elapsed,
                  "batches_per_s": p["batches"] / elapsed, "eta_s": float("nan")}
        if p.get("total_batches"):
            left = p["total_batches"] - p["batches"]
            report["eta_s"] = left / max(report["batches_per_s"], 1e-9)
        self.reports.append(report)
        self.logger.info("iteration %d: %.0f samples/s, %.1f batches/s, ETA %.0f s", iteration,
                         report["samples_per_s"], report["batches_per_s"], report["eta_s"])


class CheckpointListener(TrainingListener):
    """Write exact-resume checkpoints every N iterations and/or epochs, keeping the last K.

    Files are ``{directory}/{prefix}-epoch{E}-iter{I}.safetensors``, written atomically;
    ``fit(..., resume_from=directory)`` continues from the newest written. ``keep_last``
    counts this run's earlier checkpoints in the directory too (written before a resume, or
    by an earlier fit), so crash after crash it holds at most ``keep_last`` of them; another
    run's are kept, with a warning when their iterations are higher. Two CheckpointListeners
    of one wrapper need their own ``prefix`` or directory (``ValueError`` otherwise).
    """

    def __init__(self, directory: str | Path, *, every_n_iterations: int | None = None,
                 every_n_epochs: int | None = 1, keep_last: int = 3,
                 prefix: str = "checkpoint") -> None:
        self.directory = Path(directory).expanduser()  # as the files' writer expands it
        self.every_n_iterations = _positive("every_n_iterations", every_n_iterations)
        self.every_n_epochs = _positive("every_n_epochs", every_n_epochs)
        self.keep_last = _positive("keep_last", keep_last) or 1
        if self.every_n_iterations is None and self.every_n_epochs is None:
            raise ValueError("give every_n_iterations= and/or every_n_epochs=")
        self.prefix = prefix
        self.written: list[Path] = []
        self._adopted = False  # whether this fit looked at the directory's earlier files

    def wants_checkpoint(self, iteration: int, epoch: int, epoch_end: bool) -> bool:
        by_iteration = self.every_n_iterations and (iteration + 1) % self.every_n_iterations == 0
        by_epoch = epoch_end and self.every_n_epochs and (epoch + 1) % self.every_n_epochs == 0
        return bool(by_iteration or by_epoch)

    def on_fit_start(self, wrapper: ParallelWrapper) -> None:
        from paraloom.extra_state import split_extra_state
        from paraloom.safetensors_files import check_storable

        tensors, _ = split_extra_state(wrapper.model.state_dict(), "CheckpointListener")
        check_storable(tensors, "CheckpointListener")  # before training
        self._adopted = False  # the directory is looked at again at the fit's first checkpoint
        mine = (self.directory.resolve(), self.prefix)
        for other in wrapper.listeners:
            if other is not self and isinstance(other, CheckpointListener) and \
                    (other.directory.resolve(), other.prefix) == mine:
                raise ValueError(f"two CheckpointListeners write {str(self.directory)!r} with "
                                 f"prefix={self.prefix!r}: each one's keep_last would remove "
                                 "the other's files; give each its own prefix= or directory")

    def on_checkpoint(self, checkpoint: TrainingCheckpoint) -> None:
        name = f"{self.prefix}-epoch{checkpoint.epoch}-iter{checkpoint.iteration}.safetensors"
        if not self._adopted:
            self._adopt(checkpoint.iteration, checkpoint.run)
        started = time.perf_counter()
        path = checkpoint.save(self.directory / name)
        if path in self.written:
            self.written.remove(path)
        self.written.append(path)
        log.debug("checkpoint %s written in %.3f s", path, time.perf_counter() - started)
        for old in self.written[:-self.keep_last]:
            old.unlink(missing_ok=True)
        self.written = self.written[-self.keep_last:]

    def _adopt(self, iteration: int, run: str) -> None:
        """Count this run's earlier checkpoints in the directory (before a resume, an earlier
        fit) in ``keep_last``, and warn about files of later iterations (another run's)."""
        self._adopted = True
        found = sorted(self.directory.glob(f"{self.prefix}-epoch*-iter*.safetensors"),
                       key=iteration_of)
        earlier = [p for p in found if 0 <= iteration_of(p) < iteration and run_of(p) == run]
        self.written = [*earlier, *(p for p in self.written if p not in earlier)]
        later = [p.name for p in found if iteration_of(p) >= iteration]
        if later:
            warnings.warn(f"CheckpointListener: {str(self.directory)!r} already holds "
                          f"checkpoints past this one (iteration {iteration}): {later[-3:]}, "
                          "from another run or a later point of this one. resume_from=directory "
                          "takes the newest written, this run's from now on; give each run its "
                          "own directory", UserWarning,
                          stacklevel=2)


class ValidationListener(TrainingListener):
    """Score the weights of every ``every_n_epochs``-th epoch's end during one ``fit()``
    (Lightning's validation loop): ``score(model)`` gets a copy of your model holding them
    (``TrainingCheckpoint.model_state()``: the replicas' mean, in shared gradients of their
    local views; in allreduce replica 0's, whose BatchNorm statistics ``fit()`` returns), so
    it may run it freely.

    ``scores`` maps each scored epoch to its score, also logged. Your own model keeps the
    start weights until ``fit()`` returns, so a listener that scores it sees those. Each
    score pulls every replica's state, as a checkpoint does, and runs in this process
    while the workers train on.
    """

    def __init__(self, score: Callable[[nn.Module], float], *, every_n_epochs: int = 1,
                 logger: logging.Logger | None = None) -> None:
        if not callable(score):
            raise TypeError(f"score={score!r}; expected a function of the model, e.g. "
                            "lambda m: paraloom.evaluate(m, val_loader).accuracy")
        self.score = score
        self.every_n_epochs = _positive("every_n_epochs", every_n_epochs) or 1
        self.logger = logger or log
        self.scores: dict[int, float] = {}
        self._model: nn.Module | None = None
        self._copy: nn.Module | None = None
        self._epochs: dict[int, int] = {}  # by checkpoint iteration: the epoch it ends

    def on_fit_start(self, wrapper: ParallelWrapper) -> None:
        if wrapper.model is not self._model:  # another wrapper's model: copy it afresh
            self._model, self._copy = wrapper.model, None

    def wants_checkpoint(self, iteration: int, epoch: int, epoch_end: bool) -> bool:
        wanted = epoch_end and (epoch + 1) % self.every_n_epochs == 0
        if wanted:
            self._epochs[iteration + 1] = epoch  # a checkpoint counts the rounds done
        return wanted

    def on_checkpoint(self, checkpoint: TrainingCheckpoint) -> None:
        import torch

        if self._model is None:
            return
        if self._copy is None:
            self._copy = copy.deepcopy(self._model)
        self._copy.load_state_dict(checkpoint.model_state())
        epoch = self._epochs.pop(checkpoint.iteration, checkpoint.epoch)
        with torch.no_grad():
            self.scores[epoch] = float(self.score(self._copy.eval()))
        self.logger.info("epoch %d: validation score %.6f", epoch, self.scores[epoch])
