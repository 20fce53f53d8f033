"""Evaluation metrics against scikit-learn's on the same predictions, at the edges: classes the
data never shows, targets far from zero, a constant target, one-logit binary models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import f1_score, precision_score, r2_score, recall_score
from torch import nn

from paraloom.evaluation import Evaluation, RegressionEvaluation, evaluate


def _one_hot_logits(pred: np.ndarray, classes: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.from_numpy(pred), classes).float()


@pytest.mark.parametrize("present", [[0, 1, 2], [4], [0, 3, 7, 9]])
def test_macro_scores_average_over_the_classes_the_data_shows(present: list[int]) -> None:
    rng = np.random.default_rng(len(present))
    labels = rng.choice(present, size=200)
    pred = np.where(rng.random(200) < 0.7, labels, rng.choice(present + [5], size=200))
    ev = Evaluation(10)
    ev.update(_one_hot_logits(pred, 10), torch.from_numpy(labels))
    m = ev.metrics()
    for name, score in (("precision", precision_score), ("recall", recall_score),
                        ("f1", f1_score)):
        want = score(labels, pred, average="macro", zero_division=0)
        assert m[name] == pytest.approx(want, abs=1e-12), name  # type: ignore[literal-required]


def test_fractional_labels_are_refused() -> None:
    with pytest.raises(ValueError, match="whole numbers"):
        Evaluation(3).update(torch.randn(4, 3), torch.tensor([0.5, 1.0, 2.0, 0.0]))


def test_a_label_outside_the_classes_names_the_range_also_with_a_loss() -> None:
    # The loss function would fail first, with its own "Target 7 is out of bounds".
    batches = [(torch.randn(2, 3), torch.tensor([0, 7]))]
    with pytest.raises(ValueError, match=r"class indices in \[0, 4\)"):
        evaluate(nn.Linear(3, 4), batches, loss_fn=nn.CrossEntropyLoss())


@pytest.mark.parametrize("offset", [0.0, 1e7, 1e8])
def test_r2_holds_for_targets_far_from_zero_across_merges(offset: float) -> None:
    rng = np.random.default_rng(0)
    true = offset + rng.normal(size=(300, 2))
    pred = true + 0.3 * rng.normal(size=(300, 2))
    parts = [RegressionEvaluation(2) for _ in range(3)]
    for part, rows in zip(parts, np.array_split(np.arange(300), 3), strict=True):
        part.update(torch.from_numpy(pred[rows]), torch.from_numpy(true[rows]))
    merged = parts[0].merge(parts[1]).merge(parts[2])
    assert merged.count == 300
    assert merged.metrics()["r2"] == pytest.approx(r2_score(true, pred), abs=1e-9)


def test_a_constant_target_scores_as_scikit_learn_does() -> None:
    true = np.stack([np.full(50, 3.0), np.linspace(0, 1, 50)], axis=1)
    pred = true + 0.01
    ev = RegressionEvaluation(2)
    ev.update(torch.from_numpy(pred), torch.from_numpy(true))
    assert ev.metrics()["r2"] == pytest.approx(r2_score(true, pred), abs=1e-12)
    exact = RegressionEvaluation(1)
    exact.update(torch.full((5, 1), 2.0), torch.full((5, 1), 2.0))
    assert exact.metrics()["r2"] == 1.0


@pytest.mark.parametrize("shape", [(1,), ()])
def test_evaluate_takes_a_one_logit_binary_model(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 3)
    y = (x[:, 0] > 0).long()
    model = nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[5.0, 0.0, 0.0]]))
        model.bias.zero_()
    head = model if shape else nn.Sequential(model, nn.Flatten(0))
    ev = evaluate(head, [(x[:32], y[:32]), (x[32:], y[32:])])
    assert ev.num_classes == 2 and ev.accuracy == 1.0
