"""Metrics that merge across workers and partitions: DL4J's Evaluation, RegressionEvaluation
and ROC (one implementation for local and Spark evaluation)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict

import numpy as np
import torch
from torch import nn

from paraloom.data import split_batch, to_device
from paraloom.forward import batch_total, forward

__all__ = ["Evaluation", "RegressionEvaluation", "ROC", "evaluate", "evaluate_regression"]


class ClassificationMetrics(TypedDict):
    """What ``Evaluation.metrics()`` returns (precision, recall and F1 are macro means)."""

    accuracy: float
    precision: float
    recall: float
    f1: float
    loss: float
    count: int
    confusion_matrix: list[list[int]]
    """Rows: actual class, columns: predicted class."""


class PerColumn(TypedDict):
    mse: list[float]
    mae: list[float]
    r2: list[float]


class RegressionMetrics(TypedDict):
    """What ``RegressionEvaluation.metrics()`` returns (means over the columns)."""

    mse: float
    mae: float
    rmse: float
    r2: float
    loss: float
    count: int
    per_column: PerColumn


class ROCMetrics(TypedDict):
    """What ``ROC.metrics()`` returns."""

    auc: float
    auc_per_class: list[float]
    count: int
    bins: int


def class_labels(targets: torch.Tensor, outputs: torch.Tensor, classes: int) -> torch.Tensor:
    """Labels as class indices (n,) in [0, classes): indices as they are, one-hot (or
    class-probability) rows shaped like ``outputs`` by their argmax, as DL4J and Keras give
    them; a ValueError naming the range otherwise."""
    labels = targets.detach().cpu()
    if labels.dim() == 2 and labels.shape[1] > 1 and labels.shape == outputs.shape:
        labels = labels.argmax(dim=1)
    if labels.is_floating_point() and not bool((labels == labels.round()).all()):
        raise ValueError("labels must be class indices (whole numbers) or one-hot rows; got "
                         "fractional values (a regression target? use RegressionEvaluation)")
    labels = labels.reshape(-1).long()
    rows = int(outputs.shape[0]) if outputs.dim() else 1
    if labels.numel() != rows:
        raise ValueError(f"{labels.numel()} labels for {rows} rows of outputs; give one label "
                         "(or one-hot row) per row")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= classes):
        raise ValueError(f"labels must be class indices in [0, {classes}) (the model gives "
                         f"{classes} class scores) or one-hot rows; got {int(labels.min())} .. "
                         f"{int(labels.max())}. Check the label column, or the model's output "
                         f"size")
    return labels


@dataclass
class Evaluation:
    """A confusion matrix and a loss sum; ``merge`` adds two, so it can be tree-aggregated."""

    num_classes: int
    confusion: torch.Tensor = field(init=False)
    loss_sum: float = 0.0
    count: int = 0
    threshold: float = 0.0
    """Where one score per row turns class 1: 0 for a logit, 0.5 for a probability (a
    sigmoid output trained with BCELoss)."""

    def __post_init__(self) -> None:
        if self.num_classes < 2:
            raise ValueError(f"num_classes={self.num_classes}; expected >= 2 (a binary model's "
                             "one score per row counts 2 classes)")
        self.confusion = torch.zeros(self.num_classes, self.num_classes, dtype=torch.int64)

    def update(self, logits: torch.Tensor, targets: torch.Tensor, loss_sum: float = 0.0) -> None:
        """Count one batch of predictions (rows of logits or probabilities) against labels.

        One score per row (shape ``(n,)`` or ``(n, 1)``) is a binary logit, as for
        ``BCEWithLogitsLoss`` and ``ROC``: class 1 where it is above ``threshold`` (0; 0.5 for
        probabilities). Labels are class indices, or one-hot rows shaped like the logits.
        """
        scores = logits.detach()
        if scores.is_floating_point() and bool(torch.isnan(scores).any()):
            raise ValueError("the model's outputs hold NaN: no class can be read from them "
                             "(NaN or inf in the input features? a diverged model? check the "
                             "data, then the training loss)")
        if scores.dim() == 1 or scores.shape[1] == 1:
            pred = (scores.reshape(-1) > self.threshold).long().cpu()
        else:
            if scores.shape[1] > self.num_classes:
                raise ValueError(f"the model gives {scores.shape[1]} class scores per row but "
                                 f"the evaluation counts {self.num_classes} classes; give "
                                 f"num_classes={scores.shape[1]} (or leave it out)")
            pred = scores.argmax(dim=1).cpu()
        targets = class_labels(targets, logits, self.num_classes)
        idx = targets * self.num_classes + pred
        self.confusion += torch.bincount(idx, minlength=self.num_classes ** 2).view(
            self.num_classes, self.num_classes)
        self.loss_sum += float(loss_sum)
        self.count += int(targets.numel())

    def merge(self, other: Evaluation) -> Evaluation:
        """The sum of two evaluations (in place on self, returned for reduce/treeAggregate)."""
        if other.num_classes != self.num_classes:
            raise ValueError(f"cannot merge evaluations of {self.num_classes} and "
                             f"{other.num_classes} classes")
        self.confusion += other.confusion
        self.loss_sum += other.loss_sum
        self.count += other.count
        return self

    @property
    def accuracy(self) -> float:
        """The share of rows classified right (0.0 with no rows)."""
        return float(self.confusion.diag().sum()) / max(1, int(self.confusion.sum()))

    def _per_class(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cm = self.confusion.double()
        tp = cm.diag()
        precision = tp / cm.sum(0).clamp(min=1)
        recall = tp / cm.sum(1).clamp(min=1)
        f1 = 2 * precision * recall / (precision + recall).clamp(min=1e-12)
        return precision, recall, f1

    def metrics(self) -> ClassificationMetrics:
        """Accuracy, macro precision/recall/F1 (averaged over the classes that occur among the
        labels or the predictions, as scikit-learn's ``average="macro"``; a class the data
        never shows has no score to average), mean loss, and the confusion matrix as lists."""
        precision, recall, f1 = self._per_class()
        seen = (self.confusion.sum(0) + self.confusion.sum(1)) > 0
        if not bool(seen.any()):
            seen = torch.ones_like(seen)
        return {"accuracy": self.accuracy, "precision": float(precision[seen].mean()),
                "recall": float(recall[seen].mean()), "f1": float(f1[seen].mean()),
                "loss": self.loss_sum / max(1, self.count), "count": self.count,
                "confusion_matrix": self.confusion.tolist()}

    def report(self) -> str:
        """A printable summary with the confusion matrix (rows: actual, columns: predicted)."""
        m = self.metrics()
        width = max(5, len(str(int(self.confusion.max()))) + 1)
        head = "".join(f"{c:>{width}}" for c in range(self.num_classes))
        rows = [f"{r:>3} |" + "".join(f"{v:>{width}}" for v in row)
                for r, row in enumerate(self.confusion.tolist())]
        return "\n".join([
            f"accuracy  {m['accuracy']:.4f}   precision {m['precision']:.4f}   "
            f"recall {m['recall']:.4f}   F1 {m['f1']:.4f}   ({m['count']} examples)",
            "confusion matrix (rows: actual, columns: predicted)",
            "    |" + head, *rows])


@dataclass
class RegressionEvaluation:
    """Per-column sums from which MSE, MAE, RMSE and R² follow; ``merge`` adds two states."""

    columns: int
    count: int = 0
    loss_sum: float = 0.0
    sum_sq_error: np.ndarray = field(init=False)
    sum_abs_error: np.ndarray = field(init=False)
    mean_target: np.ndarray = field(init=False)
    m2_target: np.ndarray = field(init=False)
    """The targets' sum of squared deviations from their mean: merged as Chan et al. do, so
    R² holds for targets far from zero (E[y²] - E[y]² loses it to rounding there)."""

    def __post_init__(self) -> None:
        if self.columns < 1:
            raise ValueError(f"columns={self.columns}; expected >= 1")
        for name in ("sum_sq_error", "sum_abs_error", "mean_target", "m2_target"):
            setattr(self, name, np.zeros(self.columns, dtype=np.float64))

    def _as_2d(self, t: torch.Tensor, rows: int) -> np.ndarray:
        return t.detach().to("cpu", torch.float64).reshape(
            rows, -1 if rows else self.columns).numpy()

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, loss_sum: float = 0.0) -> None:
        """Count one batch of predictions against targets (same number of values per row)."""
        rows = int(targets.shape[0]) if targets.dim() else 1
        if outputs.dim() and int(outputs.shape[0]) != rows:
            raise ValueError(f"outputs {tuple(outputs.shape)} and targets "
                             f"{tuple(targets.shape)} have different numbers of rows; give "
                             "one target row per output row")
        pred, true = self._as_2d(outputs, rows), self._as_2d(targets, rows)
        if pred.shape != true.shape or pred.shape[1] != self.columns:
            raise ValueError(f"outputs {tuple(outputs.shape)} and targets {tuple(targets.shape)} "
                             f"do not match {self.columns} column(s) per row")
        err = pred - true
        self.sum_sq_error += (err ** 2).sum(0)
        self.sum_abs_error += np.abs(err).sum(0)
        mean = true.mean(0) if rows else np.zeros(self.columns)
        self._add_moments(rows, mean, ((true - mean) ** 2).sum(0))
        self.loss_sum += float(loss_sum)

    def _add_moments(self, count: int, mean: np.ndarray, m2: np.ndarray) -> None:
        """Merge another set of targets' count, mean and M2 into these (Chan et al.)."""
        total = self.count + count
        if count == 0:
            return
        delta = mean - self.mean_target
        self.m2_target = self.m2_target + m2 + delta ** 2 * (self.count * count / total)
        self.mean_target = self.mean_target + delta * (count / total)
        self.count = total

    def merge(self, other: RegressionEvaluation) -> RegressionEvaluation:
        """The sum of two states (in place on self, returned for reduce / treeAggregate)."""
        if other.columns != self.columns:
            raise ValueError(f"cannot merge regression evaluations of {self.columns} and "
                             f"{other.columns} columns")
        self.sum_sq_error += other.sum_sq_error
        self.sum_abs_error += other.sum_abs_error
        self._add_moments(other.count, other.mean_target, other.m2_target)
        self.loss_sum += other.loss_sum
        return self

    def metrics(self) -> RegressionMetrics:
        """Mean over columns of MSE, MAE, RMSE and R², the per-column lists, mean loss, count."""
        n = max(1, self.count)
        mse = self.sum_sq_error / n
        mae = self.sum_abs_error / n
        variance = self.m2_target / n
        with np.errstate(divide="ignore", invalid="ignore"):
            # A constant target column: 1 for exact predictions, else 0 (scikit-learn's too);
            # NaN where a prediction or target was, and (as scikit-learn) for under 2 rows.
            r2 = np.where(variance > 0, 1 - mse / np.where(variance > 0, variance, 1),
                          np.where(mse == 0, 1.0, 0.0))
            r2 = np.where((self.count > 1) & ~np.isnan(mse + variance), r2, np.nan)
        return {"mse": float(mse.mean()), "mae": float(mae.mean()),
                "rmse": float(np.sqrt(mse).mean()), "r2": _mean_counted(r2, self.count),
                "loss": self.loss_sum / n, "count": self.count,
                "per_column": {"mse": mse.tolist(), "mae": mae.tolist(), "r2": r2.tolist()}}

    def report(self) -> str:
        """One printable line."""
        m = self.metrics()
        return (f"MSE {m['mse']:.6g}   MAE {m['mae']:.6g}   RMSE {m['rmse']:.6g}   "
                f"R² {m['r2']:.4f}   ({m['count']} examples, {self.columns} column(s))")


def _log_odds(logits: torch.Tensor) -> torch.Tensor:
    """``log(p / (1 - p))`` of each class's softmax probability ``p``, from ``(rows, classes)``
    logits. ``1 - p`` of a row's top class is its other classes' share, taken from their
    logits: computed from ``p``, it rounds to 0 once the top logit leads by about 37."""
    log_p = torch.log_softmax(logits, dim=1)
    odds = log_p - torch.log(-torch.expm1(log_p))  # exact where p <= 1/2: all but the top
    top = logits.argmax(dim=1, keepdim=True)
    rest = torch.logsumexp(logits.scatter(1, top, float("-inf")), dim=1, keepdim=True)
    return odds.scatter_(1, top, logits.gather(1, top) - rest)


_ROC_LOG_ODDS = 1000.0
"""ROC's bins span log-odds of -1000..1000; scores past them share the outermost bins."""


@dataclass
class ROC:
    """ROC AUC from fixed-bin score histograms per class (binary, or one-vs-rest).

    A row's score for a class is its one-vs-rest log-odds, ``log(p / (1 - p))`` of the
    softmax of ``(rows, classes)`` logits (or of the probabilities given), or the logit itself
    for one logit per row (binary; class 1's score), computed from the logits so that a
    confident model's scores do not all round to 1. Each class keeps a histogram of its
    scores over ``bins`` bins for the rows of that class and for the others, equal in
    ``sign(x) * log1p(|x|)`` over log-odds of -1000..1000 (fine near 0, wider in the tails);
    ``merge`` adds histograms, so memory is ``2 * classes * bins`` counts whatever the data
    size. AUC counts pairs in one bin as ties (half), so it is exact up to the fraction of
    positive/negative pairs whose scores share a bin (with 10,000 bins, against
    scikit-learn's exact AUC: 0.0000 for logits of scale 1 and 10, 0.0002 at 20, where bins
    equal in probability were 0.012 and 0.036 off).
    """

    num_classes: int
    bins: int = 10_000
    count: int = 0
    loss_sum: float = 0.0
    probabilities: bool = False
    """One score per row is class 1's probability (a sigmoid's output, as trained with
    BCELoss), scored by its log-odds; default: a logit."""
    positive: np.ndarray = field(init=False)
    negative: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        if self.num_classes < 2 or self.bins < 2:
            raise ValueError(f"ROC(num_classes={self.num_classes}, bins={self.bins}); expected "
                             f">= 2 of each")
        self.positive = np.zeros((self.num_classes, self.bins), np.int64)
        self.negative = np.zeros((self.num_classes, self.bins), np.int64)

    def _scores(self, outputs: torch.Tensor) -> np.ndarray:
        """Each row's one-vs-rest log-odds per class, ``(rows, classes)``."""
        out = outputs.detach().to("cpu", torch.float64)
        if out.dim() == 1 or out.shape[1] == 1:
            z = out.reshape(-1)
            if self.probabilities:
                if bool(((z < 0) | (z > 1)).any()):
                    raise ValueError("ROC(probabilities=True) got scores outside [0, 1]; give "
                                     "probabilities (a sigmoid's output), or leave "
                                     "probabilities=False for logits")
                z = torch.logit(z)  # 0 and 1 give -inf and inf: the outermost bins
            return torch.stack([-z, z], dim=1).numpy()
        is_prob = bool((out >= 0).all() and (out <= 1).all()
                       and torch.allclose(out.sum(1), torch.ones(len(out), dtype=out.dtype)))
        if is_prob:
            log_p = out.log()
            return (log_p - torch.log(-torch.expm1(log_p))).numpy()  # log p - log(1 - p)
        return _log_odds(out).numpy()

    def _bins_of(self, log_odds: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            t = np.sign(log_odds) * np.log1p(np.minimum(np.abs(log_odds), _ROC_LOG_ODDS))
        at = ((t / np.log1p(_ROC_LOG_ODDS) + 1) / 2 * self.bins).astype(np.int64)
        clipped: np.ndarray = np.clip(at, 0, self.bins - 1)
        return clipped

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, loss_sum: float = 0.0) -> None:
        """Count one batch of logits (or probabilities) against class labels (indices, or
        one-hot rows)."""
        scores = self._scores(outputs)
        if scores.shape[1] != self.num_classes:
            raise ValueError(f"outputs give {scores.shape[1]} class scores but this ROC counts "
                             f"{self.num_classes} classes")
        if np.isnan(scores).any():  # softmax of an inf logit is NaN too
            raise ValueError("the model's outputs hold NaN (or inf logits): they have no rank "
                             "for a ROC curve (NaN or inf in the input features? a diverged "
                             "model? check the data, then the training loss)")
        labels = class_labels(targets, outputs, self.num_classes).numpy()
        at = self._bins_of(scores)
        for c in range(self.num_classes):
            mine = labels == c
            self.positive[c] += np.bincount(at[mine, c], minlength=self.bins)
            self.negative[c] += np.bincount(at[~mine, c], minlength=self.bins)
        self.count += len(labels)
        self.loss_sum += float(loss_sum)

    def merge(self, other: ROC) -> ROC:
        """The sum of two states (in place on self)."""
        if (other.num_classes, other.bins, other.probabilities) != (
                self.num_classes, self.bins, self.probabilities):
            raise ValueError(f"cannot merge ROC states of {self.num_classes} and "
                             f"{other.num_classes} classes ({self.bins} / {other.bins} bins, "
                             f"probabilities={self.probabilities} / {other.probabilities})")
        self.positive += other.positive
        self.negative += other.negative
        self.count += other.count
        self.loss_sum += other.loss_sum
        return self

    def auc(self, cls: int = 1) -> float:
        """Area under class ``cls``'s one-vs-rest ROC curve (class 1 for binary); NaN if that
        class (or every other) is absent."""
        pos, neg = self.positive[cls].astype(np.float64), self.negative[cls].astype(np.float64)
        if not pos.sum() or not neg.sum():
            return float("nan")
        below = np.cumsum(neg) - neg  # negatives in lower bins
        return float((pos * (below + 0.5 * neg)).sum() / (pos.sum() * neg.sum()))

    def metrics(self) -> ROCMetrics:
        """AUC (binary: class 1's; else the macro mean over classes present), per class."""
        per_class = [self.auc(c) for c in range(self.num_classes)]
        present = [a for a in per_class if a == a]
        auc = per_class[1] if self.num_classes == 2 else (
            float(np.mean(present)) if present else float("nan"))
        return {"auc": auc, "auc_per_class": per_class, "count": self.count,
                "bins": self.bins}

    def report(self) -> str:
        """One printable line."""
        return (f"AUC {self.metrics()['auc']:.4f}   ({self.count} examples, "
                f"{self.num_classes} classes)")


def _predictions(model: nn.Module, data: Iterable[object], caller: str
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(outputs, targets) of each ``(inputs, targets)`` batch, the model in eval mode meanwhile
    and on its own device; ValueError naming ``caller`` for data without batches."""
    was_training = model.training
    model.eval()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    batches = 0
    try:
        with torch.no_grad():
            for batch in data:
                inputs, targets = to_device(split_batch(batch), device)
                batches += 1
                yield forward(model, inputs), targets
    finally:
        model.train(was_training)
    if not batches:
        raise ValueError(f"{caller}() got no batches")


class _Counts(Protocol):
    def update(self, outputs: torch.Tensor, targets: torch.Tensor, loss_sum: float = 0.0,
               /) -> None: ...


def update_with_loss(state: _Counts, outputs: torch.Tensor, targets: torch.Tensor,
                     loss: Callable[[], torch.Tensor] | None) -> None:
    """``state.update`` with the batch's loss sum ``loss()`` (0 without ``loss``; made by
    ``batch_total``). Where ``loss()`` raises, ``state.update`` runs first, so that its own
    error is the one raised where it has one: a label outside the classes is named with their
    range, not as the loss function's IndexError (on CUDA, a device-side assert)."""
    total = 0.0
    if loss is not None:
        try:
            with torch.no_grad():
                total = float(loss())
        except Exception:
            state.update(outputs, targets)
            raise
    state.update(outputs, targets, total)


def _mean_counted(values: np.ndarray, count: object) -> float:
    """The mean over the columns that saw rows (NaN if none did); a NaN column (a NaN
    prediction) makes it NaN, as it makes the MSE."""
    counted = np.broadcast_to(np.asarray(count) > 0, values.shape)
    return float(values[counted].mean()) if counted.any() else float("nan")


def evaluate(model: nn.Module, data: Iterable[object], *, num_classes: int | None = None,
             loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
             threshold: float | None = None) -> Evaluation:
    """Evaluate a classifier on ``(inputs, targets)`` batches: a confusion matrix, and the
    mean of ``loss_fn`` when given. ``num_classes``: from the model's output (one score per
    row: a binary logit, 2 classes). ``threshold``: where one score per row turns class 1
    (default 0, a logit; 0.5, a probability, when ``loss_fn`` is an ``nn.BCELoss``).
    ``ValueError`` for outputs holding NaN, or more class scores than ``num_classes``."""
    ev: Evaluation | None = None
    # One score per row from a model trained with BCELoss is a probability (as Spark reads it)
    if threshold is None:
        threshold = 0.5 if isinstance(loss_fn, nn.BCELoss) else 0.0
    for logits, targets in _predictions(model, data, "evaluate"):
        if ev is None:
            scores = 1 if logits.dim() == 1 else int(logits.shape[1])
            ev = Evaluation(max(2, scores) if num_classes is None else num_classes,
                            threshold=threshold)
        shaped = targets  # BCE: labels as the outputs, (n,) for (n, 1) and in their dtype
        if isinstance(loss_fn, nn.BCELoss | nn.BCEWithLogitsLoss) \
                and targets.numel() == logits.numel():
            shaped = targets.reshape(logits.shape).to(logits.dtype)
        rows = int(targets.shape[0]) if targets.dim() else 1
        update_with_loss(ev, logits, targets, None if loss_fn is None else functools.partial(
            batch_total(loss_fn, rows), logits, shaped))
    assert ev is not None
    return ev


def evaluate_regression(model: nn.Module, data: Iterable[object]) -> RegressionEvaluation:
    """Evaluate a regression model on ``(inputs, targets)`` batches: MSE (also the loss), MAE,
    RMSE and R² per target column."""
    ev: RegressionEvaluation | None = None
    for outputs, targets in _predictions(model, data, "evaluate_regression"):
        rows = int(targets.shape[0]) if targets.dim() else 1
        if rows == 0:
            continue  # an empty batch holds nothing to count (nor its columns' number)
        if ev is None:
            ev = RegressionEvaluation(max(1, targets.numel() // max(1, rows)))
        ev.update(outputs, targets)  # checks the shapes
        ev.loss_sum += float(torch.nn.functional.mse_loss(
            outputs.reshape(targets.shape).double(), targets.double())) * rows
    if ev is None:
        raise ValueError("evaluate_regression: every batch was empty; expected rows to evaluate")
    return ev
