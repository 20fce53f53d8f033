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


class _Scores(nn.Module):
    """Returns its input: any scores can be evaluated."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_sigmoid_probabilities_are_class_1_above_one_half_with_bceloss() -> None:
    """Local evaluate counted every probability above 0 as class 1 (Spark cut at 0.5)."""
    from paraloom.early_stopping import AccuracyCalculator

    probs = torch.tensor([[0.1], [0.4], [0.6], [0.9]])
    data = [(probs, torch.tensor([0.0, 0.0, 1.0, 1.0]))]
    assert evaluate(_Scores(), data, loss_fn=nn.BCELoss()).accuracy == 1.0
    assert evaluate(_Scores(), data).accuracy == 0.5  # a logit: above 0
    assert AccuracyCalculator(data, threshold=0.5).score(_Scores()) == 1.0


def test_outputs_that_cannot_be_counted_are_refused() -> None:
    labels = torch.tensor([0, 1, 2, 0])
    with pytest.raises(ValueError, match="hold NaN.*NaN or inf in the input features"):
        evaluate(_Scores(), [(torch.full((4, 3), float("nan")), labels)])
    with pytest.raises(ValueError, match="3 class scores per row but the evaluation counts 2"):
        evaluate(_Scores(), [(torch.eye(4, 3), labels)], num_classes=2)  # counted in other rows
    with pytest.raises(ValueError, match="4 labels for 6 rows"):
        evaluate(_Scores(), [(torch.randn(6, 3), labels)])


def test_loss_and_mse_calculators_weigh_rows_not_batches() -> None:
    from paraloom.early_stopping import LossCalculator, MSECalculator
    from paraloom.evaluation import evaluate_regression

    torch.manual_seed(0)
    x, y = torch.randn(100, 1), torch.randn(100)  # (n,) targets for (n, 1) outputs
    data = [(x[:90], y[:90]), (x[90:], y[90:])]
    want = float(((x.reshape(-1) - y) ** 2).mean())
    assert MSECalculator(data).score(_Scores()) == pytest.approx(want, rel=1e-6)
    assert evaluate_regression(_Scores(), data).metrics()["mse"] == pytest.approx(want, rel=1e-6)

    class Two(nn.Module):
        def forward(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return v, v

    pairs = [(x[:90], (x[:90] + 1, x[:90])), (x[90:], (x[90:] + 3, x[90:]))]
    loss = LossCalculator(pairs, [nn.MSELoss(), nn.MSELoss()]).score(Two())
    assert loss == pytest.approx((90 * 1 + 10 * 9) / 100)  # per row: 1.8, not (1 + 9) / 2


def test_regression_r2_and_empty_batches() -> None:
    from paraloom.evaluation import evaluate_regression

    y = torch.arange(6.0).reshape(3, 2)
    out = y.clone()
    out[0, 1] = float("nan")
    assert np.isnan(evaluate_regression(_Scores(), [(out, y)]).metrics()["r2"])  # like the MSE
    empty = (torch.zeros(0, 2), torch.zeros(0, 2))
    assert evaluate_regression(_Scores(), [empty, (y, y)]).metrics()["count"] == 3
    with pytest.raises(ValueError, match="different numbers of rows"):
        evaluate_regression(_Scores(), [(y.reshape(2, 3), y)])


def test_r2_is_undefined_where_scikit_learn_leaves_it() -> None:
    """A NaN target in a column, a NaN prediction of a constant column and a single row read
    0.0 (a NaN variance failed `variance > 0` into the constant column's rule)."""
    y = torch.tensor([[float("nan"), 1.0], [2.0, 1.0], [3.0, 1.0]])
    out = torch.tensor([[0.0, float("nan")], [2.0, 1.0], [3.0, 1.0]])
    state = RegressionEvaluation(2)
    state.update(out, y)
    assert np.isnan(state.metrics()["per_column"]["r2"]).all()
    assert np.isnan(state.metrics()["r2"])
    one = RegressionEvaluation(1)
    one.update(torch.tensor([[1.0]]), torch.tensor([[2.0]]))
    assert np.isnan(one.metrics()["r2"])  # scikit-learn: undefined for under two samples
    two = RegressionEvaluation(1)
    two.update(torch.tensor([[1.0], [2.5]]), torch.tensor([[1.0], [3.0]]))
    assert two.metrics()["r2"] == pytest.approx(r2_score([1.0, 3.0], [1.0, 2.5]))


def test_an_empty_batch_counts_nothing_in_a_regression_state() -> None:
    state = RegressionEvaluation(2)
    state.update(torch.zeros(0, 2), torch.zeros(0, 2))  # a raw reshape error before
    assert state.count == 0 and np.isnan(state.metrics()["r2"])


def test_a_class_count_below_two_is_refused_by_name() -> None:
    data = [(torch.randn(4, 1), torch.tensor([0, 1, 1, 0]))]
    for bad in (1, 0, -1):  # a reshape error, silently "auto", and a raw torch error
        with pytest.raises(ValueError, match=f"num_classes={bad}; expected >= 2"):
            evaluate(_Scores(), data, num_classes=bad)
    with pytest.raises(ValueError, match="expected >= 2"):
        Evaluation(0)


def test_bce_losses_take_integer_labels_of_either_shape() -> None:
    logits = torch.tensor([[-1.0], [2.0], [0.5], [-3.0]])
    labels = torch.tensor([0, 1, 0, 0])
    want = float(nn.BCEWithLogitsLoss()(logits, labels.reshape(4, 1).float()))
    for shaped in (labels, labels.reshape(4, 1)):  # (n, 1) long labels: a dtype error before
        ev = evaluate(_Scores(), [(logits, shaped)], loss_fn=nn.BCEWithLogitsLoss())
        assert ev.metrics()["loss"] == pytest.approx(want)
        assert ev.accuracy == 0.75


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_loss_is_a_mean_per_row_whatever_the_losss_reduction(reduction: str) -> None:
    from paraloom.early_stopping import LossCalculator

    torch.manual_seed(1)
    logits, labels = torch.randn(100, 3), torch.randint(0, 3, (100,))
    data = [(logits[:64], labels[:64]), (logits[64:], labels[64:])]  # unequal batches
    want = float(nn.functional.cross_entropy(logits, labels))
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    assert evaluate(_Scores(), data, loss_fn=loss_fn).metrics()["loss"] == pytest.approx(want)
    assert LossCalculator(data, loss_fn).score(_Scores()) == pytest.approx(want)
    summed = [nn.CrossEntropyLoss(reduction=reduction), nn.CrossEntropyLoss()]

    class Two(nn.Module):
        def forward(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return v, v

    pairs = [(x, (y, y)) for x, y in data]
    assert LossCalculator(pairs, summed).score(Two()) == pytest.approx(2 * want)
