"""EarlyStoppingParallelTrainer: train epoch by epoch, score the model, keep the best.

Conditions, score calculators and savers are small classes; any callable works as a score
calculator. Scores are recorded under the epoch that produced them (DL4J stores them one epoch
off), and iteration conditions are checked once per round, not once per worker.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from paraloom._warnings import warn
from paraloom.errors import WorkerError
from paraloom.listeners import TrainingListener
from paraloom.training.conditions import (
    EpochTerminationCondition,
    IterationTerminationCondition,
    MaxEpochs,
)
from paraloom.training.resume import TrainingCheckpoint
from paraloom.training.savers import InMemoryModelSaver, LocalDirectorySaver, ModelSaver
from paraloom.training.scores import ScoreCalculator, as_score_calculator
from paraloom.training.wrapper import ParallelWrapper

__all__ = ["EarlyStoppingConfig", "EarlyStoppingResult", "EarlyStoppingParallelTrainer"]

log = logging.getLogger("paraloom")


@dataclass
class EarlyStoppingConfig:
    """When to stop, how to score, where to keep the best model."""

    epoch_conditions: list[EpochTerminationCondition] = field(default_factory=list)
    iteration_conditions: list[IterationTerminationCondition] = field(default_factory=list)
    score_calculator: ScoreCalculator | Callable[[nn.Module], float] | None = None
    """A ScoreCalculator or a callable model -> float (lower is better unless declared)."""
    model_saver: ModelSaver = field(default_factory=InMemoryModelSaver)
    evaluate_every_n_epochs: int = 1
    save_last_model: bool = False

    def __post_init__(self) -> None:
        if self.score_calculator is None:
            raise ValueError("EarlyStoppingConfig needs score_calculator= (e.g. "
                             "AccuracyCalculator(test_loader) or a callable model -> float)")
        self.score_calculator = as_score_calculator(self.score_calculator)
        if not self.epoch_conditions and not self.iteration_conditions:
            raise ValueError("give at least one termination condition, e.g. "
                             "epoch_conditions=[MaxEpochs(20), ScoreImprovement(patience=3)]")
        if not any(isinstance(c, MaxEpochs) for c in self.epoch_conditions) and \
                not self.iteration_conditions:
            log.warning("no MaxEpochs condition: training stops only when the score stops "
                        "improving")
        if self.evaluate_every_n_epochs < 1:
            raise ValueError(f"evaluate_every_n_epochs={self.evaluate_every_n_epochs}; "
                             "expected >= 1")


@dataclass
class EarlyStoppingResult:
    """How early stopping ended, and the best model it kept."""

    termination_reason: str
    """"epoch_condition", "iteration_condition" or "error"."""
    termination_details: str
    best_epoch: int
    best_score: float
    scores: dict[int, float]
    """Score of every evaluated epoch, keyed by that epoch."""
    total_epochs: int
    best_model: nn.Module | None


class _IterationWatch(TrainingListener):
    """Checks iteration conditions once per round and stops the wrapper."""

    def __init__(self, conditions: list[IterationTerminationCondition]) -> None:
        self.conditions = conditions
        self.wrapper: ParallelWrapper | None = None
        self.triggered: IterationTerminationCondition | None = None

    def on_fit_start(self, wrapper: ParallelWrapper) -> None:
        self.wrapper = wrapper

    def on_iteration(self, iteration: int, epoch: int, loss: float) -> None:
        if self.triggered is not None:
            return
        for condition in self.conditions:
            if condition.terminate(iteration, loss):
                self.triggered = condition
                if self.wrapper is not None:
                    self.wrapper.stop()
                return


@dataclass
class _Progress:
    """The scores so far and the best of them."""

    scores: dict[int, float] = field(default_factory=dict)
    """Score of every evaluated epoch."""
    per_epoch: list[float | None] = field(default_factory=list)
    """Every epoch's score in order, None where it was not evaluated (what a checkpoint
    records)."""
    best_epoch: int = -1
    best_score: float = math.nan

    def record(self, epoch: int, score: float | None, calc: ScoreCalculator) -> bool:
        """Add ``epoch``'s score; whether it is the best so far. A NaN score is the worst (as
        Lightning's): any real score replaces it."""
        self.per_epoch.append(score)
        if score is None:
            return False
        score = float(score)
        self.scores[epoch] = score
        if self.best_epoch < 0 or (not math.isnan(score) and (
                math.isnan(self.best_score) or calc.better(score, self.best_score))):
            self.best_epoch, self.best_score = epoch, score
            return True
        return False


class EarlyStoppingParallelTrainer:
    """Train with ParallelWrapper (any mode) until a termination condition holds."""

    def __init__(self, config: EarlyStoppingConfig, model: nn.Module, train_data: Iterable[Any],
                 **wrapper_options: Any) -> None:
        if isinstance(train_data, Iterator):  # iter(data) is data: one pass, then empty
            raise ValueError(
                f"train_data is a one-shot {type(train_data).__name__}, which yields its "
                "batches once, but early stopping trains epoch after epoch until a condition "
                "holds: pass a re-iterable source (a DataLoader or a list)")
        self.config = config
        self.model = model
        self.train_data = train_data
        self.watch = _IterationWatch(config.iteration_conditions)
        listeners = [*wrapper_options.pop("listeners", ()), self.watch]
        self.wrapper = ParallelWrapper(model, listeners=listeners, **wrapper_options)

    def fit(self, resume_from: str | Path | None = None) -> EarlyStoppingResult:
        """Run to termination; the user's model ends with the last epoch's weights.

        ``resume_from``: a checkpoint (file or directory) that a ``CheckpointListener`` among
        this trainer's ``listeners`` wrote; training goes on from it exactly, with the scores
        recorded before its epoch, the conditions brought to where they stood (each is fed
        those scores again) and the best epoch so far. The best model itself is the saver's:
        ``LocalDirectorySaver`` keeps it on disk across a crash, ``InMemoryModelSaver`` does
        not (a warning says so). Raises ``ValueError`` for a checkpoint without early-stopping
        scores (a plain ``fit()``'s) and for one whose scores already meet a condition.
        """
        cfg, calc = self.config, as_score_calculator(self.config.score_calculator)
        for epoch_condition in cfg.epoch_conditions:
            epoch_condition.initialize()
        for iteration_condition in cfg.iteration_conditions:
            iteration_condition.initialize()
        self.watch.triggered = None  # a second fit() starts afresh
        progress = _Progress()
        epoch = 0 if resume_from is None else self._replay(resume_from, progress, calc)
        reason, details = "epoch_condition", ""
        started = time.monotonic()
        with self.wrapper:
            while True:
                self.wrapper._checkpoints.trainer_state = {"early_stopping": {
                    "epoch": epoch, "scores": list(progress.per_epoch)}}
                try:
                    self._fit_epoch(epoch, resume_from)
                except WorkerError as e:
                    reason, details = self._failure(e)
                    break
                resume_from = None
                if self.watch.triggered is not None:
                    reason, details = "iteration_condition", repr(self.watch.triggered)
                    break
                score = self._score_epoch(epoch, progress, calc)
                log.info("epoch %d: score %.6f (best %.6f at epoch %d, %.1f s)", epoch, score,
                         progress.best_score, progress.best_epoch, time.monotonic() - started)
                done = next((c for c in cfg.epoch_conditions
                             if c.terminate(epoch, score, calc.higher_is_better)), None)
                if done is not None:
                    details = repr(done)
                    break
                epoch += 1
        best = self._best_model(progress.best_epoch) if progress.best_epoch >= 0 else None
        return EarlyStoppingResult(reason, details, progress.best_epoch, progress.best_score,
                                   progress.scores, epoch + 1, best)

    def _fit_epoch(self, epoch: int, resume_from: str | Path | None) -> None:
        """Train ``epoch``; from ``resume_from`` where given (its epoch, which may be trained to
        its end already: then the fit only restores the checkpoint's state)."""
        if resume_from is None:
            self.wrapper.fit(self.train_data, epochs=epoch + 1, initial_epoch=epoch)
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="resume_from's checkpoint is of")
            self.wrapper.fit(self.train_data, epochs=epoch + 1, resume_from=resume_from)

    def _score_epoch(self, epoch: int, progress: _Progress, calc: ScoreCalculator) -> float:
        """Score the model after ``epoch`` where it is due (NaN where not) and save it as the
        savers are asked to."""
        cfg = self.config
        score = calc.score(self.model) if (epoch + 1) % cfg.evaluate_every_n_epochs == 0 \
            else None
        if progress.record(epoch, score, calc):
            cfg.model_saver.save_best(self.model, epoch, progress.best_score)
        value = math.nan if score is None else score
        if cfg.save_last_model:
            cfg.model_saver.save_latest(self.model, epoch, value)
        return value

    def _replay(self, resume_from: str | Path, progress: _Progress,
                calc: ScoreCalculator) -> int:
        """Bring ``progress`` and the epoch conditions to where the checkpoint's run stood;
        the epoch it was training."""
        record = TrainingCheckpoint.read_trainer_state(resume_from).get("early_stopping")
        if not isinstance(record, dict):
            raise ValueError(
                f"resume_from={str(resume_from)!r} holds no early-stopping scores: it was "
                "written by a plain fit(), so resume it with ParallelWrapper.fit(resume_from="
                "...); to resume early stopping, give this trainer listeners=["
                "CheckpointListener(directory)] and resume from that directory")
        epoch = int(record["epoch"])
        for before, score in enumerate(record["scores"]):
            progress.record(before, score, calc)
            value = math.nan if score is None else float(score)
            done = next((c for c in self.config.epoch_conditions
                         if c.terminate(before, value, calc.higher_is_better)), None)
            if done is not None:
                raise ValueError(
                    f"resume_from={str(resume_from)!r}: the scores recorded before epoch "
                    f"{epoch} meet {done!r} at epoch {before}, so the run would have stopped "
                    "there; this trainer's conditions differ from that run's. Resume with its "
                    "conditions, or start afresh")
        if progress.best_epoch >= 0:
            saver = self.config.model_saver
            if isinstance(saver, LocalDirectorySaver):
                saver._resumed_with(self.model)
            try:
                saver.best_model()
            except Exception as e:  # noqa: BLE001 - any saver's way of having none
                warn(f"resuming early stopping: the best epoch so far is {progress.best_epoch}"
                     f" (score {progress.best_score:.6g}), but {type(saver).__name__} cannot "
                     f"give its model back ({type(e).__name__}: {e}); result.best_model is a "
                     "later epoch's only if one scores better. An InMemoryModelSaver's model "
                     "ends with its process; LocalDirectorySaver keeps it on disk (with "
                     "factory= where its files cannot rebuild the model)")
        return epoch

    def _best_model(self, best_epoch: int) -> nn.Module | None:
        """The saver's best model; None, with a warning, if it cannot give it back (the scores
        and the rest of the result are kept)."""
        saver = self.config.model_saver
        try:
            return saver.best_model()
        except Exception as e:  # a saver's own error: never lose the finished run over it
            warn(f"training finished, but {type(saver).__name__}.best_model() failed "
                 f"({type(e).__name__}: {e}); result.best_model is None, the scores "
                 f"and best_epoch={best_epoch} are kept. Load the saved model yourself "
                 "(for LocalDirectorySaver: paraloom.load(path, factory=build))")
            return None

    def _failure(self, error: WorkerError) -> tuple[str, str]:
        diverged = error.remote_type == "NonFiniteLossError"
        if diverged and any(c.stops_on_nonfinite for c in self.config.iteration_conditions):
            return "iteration_condition", f"the loss became non-finite: {error.args[0]}"
        log.error("early stopping ended by an error: %s", error)
        return "error", str(error)
