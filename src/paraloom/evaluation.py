"""Classification metrics that merge across workers and partitions (DL4J's Evaluation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paraloom.data import split_batch, to_device
from paraloom.forward import forward

__all__ = ["Evaluation", "evaluate"]


@dataclass
class Evaluation:
    """A confusion matrix and a loss sum; ``merge`` adds two, so it can be tree-aggregated."""

    num_classes: int
    confusion: torch.Tensor = field(init=False)
    loss_sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.confusion = torch.zeros(self.num_classes, self.num_classes, dtype=torch.int64)

    def update(self, logits: torch.Tensor, targets: torch.Tensor, loss_sum: float = 0.0) -> None:
        """Count one batch of predictions (rows of logits or probabilities) against labels."""
        pred = logits.argmax(dim=1).cpu()
        targets = targets.cpu().long()
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
        return float(self.confusion.diag().sum()) / max(1, int(self.confusion.sum()))

    def _per_class(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cm = self.confusion.double()
        tp = cm.diag()
        precision = tp / cm.sum(0).clamp(min=1)
        recall = tp / cm.sum(1).clamp(min=1)
        f1 = 2 * precision * recall / (precision + recall).clamp(min=1e-12)
        return precision, recall, f1

    def metrics(self) -> dict[str, Any]:
        """Accuracy, macro precision/recall/F1, mean loss, and the confusion matrix as lists."""
        precision, recall, f1 = self._per_class()
        return {"accuracy": self.accuracy, "precision": float(precision.mean()),
                "recall": float(recall.mean()), "f1": float(f1.mean()),
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


@torch.no_grad()
def evaluate(model: nn.Module, data: Any, *, num_classes: int | None = None,
             loss_fn: Any = None) -> Evaluation:
    """Evaluate a classifier on ``(inputs, targets)`` batches."""
    was_training = model.training
    model.eval()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ev: Evaluation | None = None
    try:
        for batch in data:
            inputs, targets = to_device(split_batch(batch), device)
            logits = forward(model, inputs)
            if ev is None:
                ev = Evaluation(num_classes or int(logits.shape[1]))
            loss = float(loss_fn(logits, targets)) * int(targets.shape[0]) if loss_fn else 0.0
            ev.update(logits, targets, loss)
    finally:
        model.train(was_training)
    if ev is None:
        raise ValueError("evaluate() got no batches")
    return ev
