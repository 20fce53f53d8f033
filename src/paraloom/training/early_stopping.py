"""EarlyStoppingParallelTrainer: train epoch by epoch, score the model, keep the best.

Conditions, score calculators and savers are small classes; any callable works as a score
calculator. Scores are recorded under the epoch that produced them (DL4J stores them one epoch
off), and iteration conditions are checked once per round, not once per worker.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
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
from paraloom.training.savers import InMemoryModelSaver, ModelSaver
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

    def fit(self) -> EarlyStoppingResult:
        """Run to termination; the user's model ends with the last epoch's weights."""
        cfg, calc = self.config, as_score_calculator(self.config.score_calculator)
        for epoch_condition in cfg.epoch_conditions:
            epoch_condition.initialize()
        for iteration_condition in cfg.iteration_conditions:
            iteration_condition.initialize()
        self.watch.triggered = None  # a second fit() starts afresh
        scores: dict[int, float] = {}
        best_epoch, best_score = -1, math.nan
        reason, details, epoch = "epoch_condition", "", -1
        started = time.monotonic()
        with self.wrapper:
            while True:
                epoch += 1
                try:
                    self.wrapper.fit(self.train_data, epochs=epoch + 1, initial_epoch=epoch)
                except WorkerError as e:
                    reason, details = self._failure(e)
                    break
                if self.watch.triggered is not None:
                    reason, details = "iteration_condition", repr(self.watch.triggered)
                    break
                score = math.nan
                if (epoch + 1) % cfg.evaluate_every_n_epochs == 0:
                    score = calc.score(self.model)
                    scores[epoch] = score
                    # A NaN score is the worst (as Lightning's): any real score replaces it.
                    if best_epoch < 0 or (not math.isnan(score) and (
                            math.isnan(best_score) or calc.better(score, best_score))):
                        best_epoch, best_score = epoch, score
                        cfg.model_saver.save_best(self.model, epoch, score)
                if cfg.save_last_model:
                    cfg.model_saver.save_latest(self.model, epoch, score)
                log.info("epoch %d: score %.6f (best %.6f at epoch %d, %.1f s)", epoch, score,
                         best_score, best_epoch, time.monotonic() - started)
                done = next((c for c in cfg.epoch_conditions
                             if c.terminate(epoch, score, calc.higher_is_better)), None)
                if done is not None:
                    details = repr(done)
                    break
        return EarlyStoppingResult(reason, details, best_epoch, best_score, scores, epoch + 1,
                                   self._best_model(best_epoch) if best_epoch >= 0 else None)

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
