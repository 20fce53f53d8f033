"""Termination conditions for early stopping."""

from __future__ import annotations

import math
import time

__all__ = ["EpochTerminationCondition", "IterationTerminationCondition", "MaxEpochs",
           "ScoreImprovement", "BestScore", "MaxTime", "MaxScore"]


class EpochTerminationCondition:
    """Checked after each epoch with that epoch's score (NaN when it was not evaluated)."""

    def initialize(self) -> None:
        """Reset before a run."""

    def terminate(self, epoch: int, score: float, higher_is_better: bool) -> bool:
        raise NotImplementedError


class IterationTerminationCondition:
    """Checked after each round with its mean loss."""

    stops_on_nonfinite = False
    """True if a NaN/inf loss raised in a worker counts as this condition, not an error."""

    def initialize(self) -> None:
        """Reset before a run."""

    def terminate(self, iteration: int, loss: float) -> bool:
        raise NotImplementedError


class MaxEpochs(EpochTerminationCondition):
    """Stop after ``max_epochs`` epochs."""

    def __init__(self, max_epochs: int) -> None:
        if max_epochs < 1:
            raise ValueError(f"max_epochs={max_epochs}; expected >= 1")
        self.max_epochs = max_epochs

    def terminate(self, epoch: int, score: float, higher_is_better: bool) -> bool:
        return epoch + 1 >= self.max_epochs

    def __repr__(self) -> str:
        return f"MaxEpochs({self.max_epochs})"


class ScoreImprovement(EpochTerminationCondition):
    """Stop when the score has not improved by more than ``min_delta`` for ``patience`` epochs."""

    def __init__(self, patience: int, min_delta: float = 0.0) -> None:
        if patience < 1 or min_delta < 0:
            raise ValueError(f"patience={patience}, min_delta={min_delta}; expected patience "
                             ">= 1 and min_delta >= 0")
        self.patience = patience
        self.min_delta = min_delta

    def initialize(self) -> None:
        self.best = math.nan
        self.stale = 0

    def terminate(self, epoch: int, score: float, higher_is_better: bool) -> bool:
        if math.isnan(score):
            return False
        gain = (score - self.best) if higher_is_better else (self.best - score)
        if math.isnan(self.best) or gain > self.min_delta:
            self.best, self.stale = score, 0
            return False
        self.stale += 1
        return self.stale >= self.patience

    def __repr__(self) -> str:
        return f"ScoreImprovement(patience={self.patience}, min_delta={self.min_delta})"


class BestScore(EpochTerminationCondition):
    """Stop once the score reaches ``target`` (or better)."""

    def __init__(self, target: float) -> None:
        self.target = target

    def terminate(self, epoch: int, score: float, higher_is_better: bool) -> bool:
        if math.isnan(score):
            return False
        return score >= self.target if higher_is_better else score <= self.target

    def __repr__(self) -> str:
        return f"BestScore({self.target})"


class MaxTime(IterationTerminationCondition):
    """Stop after ``seconds`` of training (monotonic clock, from the end of the first round:
    the workers' start is not counted; scoring between epochs is)."""

    def __init__(self, seconds: float) -> None:
        if seconds <= 0:
            raise ValueError(f"seconds={seconds}; expected > 0")
        self.seconds = seconds
        self.started: float | None = None

    def initialize(self) -> None:
        self.started = None

    def terminate(self, iteration: int, loss: float) -> bool:
        if self.started is None:
            self.started = time.monotonic()
            return False
        return time.monotonic() - self.started >= self.seconds

    def __repr__(self) -> str:
        return f"MaxTime({self.seconds})"


class MaxScore(IterationTerminationCondition):
    """Stop when the loss exceeds ``max_score`` or is NaN/inf: training diverged."""

    stops_on_nonfinite = True

    def __init__(self, max_score: float = math.inf) -> None:
        self.max_score = max_score

    def terminate(self, iteration: int, loss: float) -> bool:
        return not math.isfinite(loss) or loss > self.max_score

    def __repr__(self) -> str:
        return f"MaxScore({self.max_score})"
