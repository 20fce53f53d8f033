"""ROC AUC from mergeable score histograms equals scikit-learn's exact AUC to ~1e-4."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from paraloom.evaluation import ROC, RegressionEvaluation


def test_binary_auc_from_one_logit_matches_sklearn_and_merges_like_one_pass():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (5000,), generator=g)
    logits = y.float() * 1.2 + torch.randn(5000, generator=g)  # overlapping classes
    whole, parts = ROC(2), [ROC(2) for _ in range(3)]
    whole.update(logits, y)
    for part, idx in zip(parts, torch.arange(5000).chunk(3), strict=True):
        part.update(logits[idx], y[idx])
    merged = parts[0].merge(parts[1]).merge(parts[2])
    exact = roc_auc_score(y.numpy(), torch.sigmoid(logits).numpy())
    assert 0.7 < exact < 0.9
    assert whole.metrics()["auc"] == pytest.approx(exact, abs=1e-4)
    assert merged.metrics() == whole.metrics()
    np.testing.assert_array_equal(merged.positive, whole.positive)


@pytest.mark.parametrize("scale", [10.0, 20.0])
def test_a_confident_models_auc_matches_sklearn(scale):
    """Softmax of large logits rounds most probabilities to 0 or 1: bins equal in probability
    counted them as ties, 0.012 (scale 10) and 0.036 (20) below the exact AUC."""
    g = torch.Generator().manual_seed(2)
    y = torch.randint(0, 3, (4000,), generator=g)
    logits = scale * (torch.randn(4000, 3, generator=g)
                      + 1.0 * torch.nn.functional.one_hot(y, 3))
    roc = ROC(3)
    roc.update(logits, y)
    for c in range(3):
        exact = roc_auc_score((y == c).numpy(), (logits[:, c] - torch.logsumexp(
            logits[:, [k for k in range(3) if k != c]], 1)).numpy())
        assert roc.metrics()["auc_per_class"][c] == pytest.approx(exact, abs=5e-4)


def test_one_vs_rest_auc_per_class_and_macro_match_sklearn():
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 4, (3000,), generator=g)
    logits = torch.randn(3000, 4, generator=g) + 1.5 * torch.nn.functional.one_hot(y, 4)
    roc = ROC(4)
    roc.update(logits, y)
    probs = torch.softmax(logits, 1).numpy()
    m = roc.metrics()
    assert m["auc"] == pytest.approx(roc_auc_score(y.numpy(), probs, multi_class="ovr"),
                                     abs=1e-4)
    for c in range(4):
        assert m["auc_per_class"][c] == pytest.approx(
            roc_auc_score((y == c).numpy(), probs[:, c]), abs=1e-4)
    roc.update(torch.tensor(probs[:10]), y[:10])  # probabilities are taken as they are
    assert roc.count == 3010
    with pytest.raises(ValueError, match=r"class indices in \[0, 4\)"):
        roc.update(logits[:2], torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="cannot merge ROC states"):
        roc.merge(ROC(3))


def test_absent_class_gives_nan_and_regression_is_the_shared_implementation():
    roc = ROC(3)
    roc.update(torch.randn(10, 3), torch.zeros(10, dtype=torch.long))
    assert all(a != a for a in roc.metrics()["auc_per_class"])
    pytest.importorskip("pyspark")
    from paraloom.spark.evaluation import RegressionEvaluation as SparkRegression

    assert SparkRegression is RegressionEvaluation


def test_one_hot_labels_count_as_their_class_and_bad_labels_name_the_range():
    from paraloom.evaluation import Evaluation

    g = torch.Generator().manual_seed(2)
    y = torch.randint(0, 3, (300,), generator=g)
    logits = torch.nn.functional.one_hot(y, 3).float() + torch.randn(300, 3, generator=g)
    one_hot = torch.nn.functional.one_hot(y, 3).float()  # DL4J's and Keras's labels
    by_index, by_row = Evaluation(3), Evaluation(3)
    by_index.update(logits, y)
    by_row.update(logits, one_hot)
    assert 0.5 < by_row.accuracy < 1.0
    assert by_row.metrics() == by_index.metrics()
    roc_index, roc_row = ROC(3), ROC(3)
    roc_index.update(logits, y)
    roc_row.update(logits, one_hot)
    assert roc_row.metrics() == roc_index.metrics()
    for bad in (y * 2, y - 1):  # a label past the model's classes, a negative one
        with pytest.raises(ValueError, match=r"class indices in \[0, 3\).* got -?\d+ \.\. \d+"):
            Evaluation(3).update(logits, bad)


def test_a_confident_two_logit_model_keeps_its_ranks():
    """Two logits leading by over ~37: 1 - p rounded to 0, the log-odds to inf, and every such
    row shared the outermost bin (0.0065 under the exact AUC here)."""
    g = torch.Generator().manual_seed(3)
    y = torch.randint(0, 2, (2000,), generator=g)
    z = 60.0 * (torch.randn(2000, generator=g) + 0.5 * y)
    roc = ROC(2)
    roc.update(torch.stack([-z / 2, z / 2], dim=1), y)
    assert roc.metrics()["auc"] == pytest.approx(roc_auc_score(y.numpy(), z.numpy()), abs=2e-4)


def test_sigmoid_probabilities_are_ranked_by_their_log_odds():
    """Probabilities read as logits crowd a few hundred bins around 0: 0.7296 for 0.7502."""
    g = torch.Generator().manual_seed(4)
    y = torch.randint(0, 2, (4000,), generator=g)
    p = torch.sigmoid(10.0 * (torch.randn(4000, generator=g) + 0.5 * y)).reshape(-1, 1)
    roc = ROC(2, probabilities=True)
    roc.update(p, y)
    assert roc.metrics()["auc"] == pytest.approx(roc_auc_score(y.numpy(), p.numpy()), abs=2e-4)
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        roc.update(torch.tensor([[1.5]]), torch.tensor([1]))
    with pytest.raises(ValueError, match="probabilities=True / False"):
        roc.merge(ROC(2))  # scores of another scale
