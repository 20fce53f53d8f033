"""Multi-input, multi-output models on Spark: fit, evaluate and predict from DataFrames and RDDs."""

from __future__ import annotations

import numpy as np
import pytest
import spark_helpers as h
import torch
from sklearn.metrics import roc_auc_score
from torch import nn

from paraloom.spark import ParameterAveragingTrainingMaster, SparkModel

pytestmark = pytest.mark.timeout(300)

INPUTS = ("top", [f"b{i}" for i in range(32)])  # an array column, and 32 columns assembled


@pytest.fixture(scope="module")
def fitted(spark, tmp_path_factory):
    """A fit from a Parquet directory (DL4J's fitPaths): the executors read and decode it."""
    path = str(tmp_path_factory.mktemp("parquet") / "train")
    h.two_tower_dataframe(spark, "train").repartition(3).write.parquet(path)
    torch.manual_seed(0)
    model = h.TwoTowers()
    net = SparkModel(spark, model,
                     ParameterAveragingTrainingMaster(32, averaging_frequency=25, workers=2),
                     loss_fn=[nn.CrossEntropyLoss(), nn.MSELoss()],  # one per output, summed
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    summary = net.fit_paths(path, epochs=4, inputs=INPUTS, label=("label", "brightness"))
    return net, summary


def _local(model: nn.Module, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    top, bottom, _, _ = h.two_tower_columns(split)
    with torch.no_grad():
        return model.eval()(torch.from_numpy(top), torch.from_numpy(bottom))


def test_two_inputs_two_outputs_learn_both_targets(spark, fitted):
    net, summary = fitted
    assert summary["samples"] == 4 * 1438  # every row of the three Parquet files, every epoch
    assert summary["epoch_losses"][-1] < summary["epoch_losses"][0] / 2
    test = h.two_tower_dataframe(spark, "test")
    both = net.evaluate(test, inputs=INPUTS, label=("label", "brightness"), output=0,
                        metrics=["classification", "roc"])  # one pass for both
    classes, roc = both["classification"], both["roc"].metrics()
    brightness = net.evaluate_regression(test, inputs=INPUTS, label=("label", "brightness"),
                                         output=1).metrics()
    logits, bright = _local(net.model, "test")
    _, _, label, target = h.two_tower_columns("test")
    # the distributed metrics are the local ones, and the model learned both heads
    assert classes.accuracy == pytest.approx(float((logits.argmax(1).numpy() == label).mean()))
    assert classes.accuracy >= 0.9
    assert brightness["count"] == len(label) == 359
    assert brightness["mse"] == pytest.approx(float(((bright.numpy() - target) ** 2).mean()),
                                              rel=1e-4)
    assert brightness["r2"] > 0.4  # learned beyond the mean (r2 = 0)
    exact = roc_auc_score(label, torch.softmax(logits, 1).numpy(), multi_class="ovr")
    assert roc["count"] == 359 and roc["auc"] == pytest.approx(exact, abs=1e-3)
    assert roc["auc"] > 0.95
    # the loss is the model's (both heads' losses summed, as fit's), the mean over rows, at any
    # batch size: the rows of a batch, not the number of its targets, weigh each batch
    local_loss = (nn.CrossEntropyLoss()(logits, torch.from_numpy(label))
                  + nn.MSELoss()(bright, torch.from_numpy(target))).item()
    for batch_size in (8, 512):
        found = net.evaluate(test, inputs=INPUTS, label=("label", "brightness"), output=0,
                             batch_size=batch_size).metrics()["loss"]
        assert found == pytest.approx(local_loss, rel=1e-3), batch_size


def test_predict_gives_one_column_per_output_equal_to_local(spark, fitted):
    net, _ = fitted
    test = h.two_tower_dataframe(spark, "test")
    out = net.predict(test, inputs=INPUTS, output=("digit", "bright")).select(
        "digit", "bright", "top").collect()
    logits, bright = _local(net.model, "test")
    order = {tuple(np.float32(v) for v in top): i for i, top in
             enumerate(h.two_tower_columns("test")[0].tolist())}
    at = [order[tuple(np.float32(v) for v in row["top"])] for row in out]
    assert len(out) == 359
    np.testing.assert_allclose(np.array([r["digit"] for r in out]), logits[at].numpy(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array([r["bright"][0] for r in out]), bright[at].numpy(),
                               rtol=1e-5, atol=1e-5)
    for output in ("prediction", ("digit",)):  # a one-tuple is one column, as one name is
        with pytest.raises(Exception, match=r"returned 2 outputs but output= names one column"
                                            r".*\(2 names\)"):
            net.predict(test, inputs=INPUTS, output=output).collect()


def test_keyword_inputs_and_rdd_multidatasets_give_the_same_answers(spark, sc, fitted):
    net, _ = fitted
    keyed = SparkModel(spark, h.ByName(net.model), net.master, loss_fn=net.loss_fn)
    test = h.two_tower_dataframe(spark, "test")
    by_name = keyed.evaluate(test, inputs={"bottom": INPUTS[1], "top": "top"},
                             label=("label", "brightness"), output=0)
    by_position = net.evaluate(test, inputs=INPUTS, label=("label", "brightness"), output=0)
    assert by_name.metrics()["confusion_matrix"] == by_position.metrics()["confusion_matrix"]
    assert by_name.metrics()["loss"] == pytest.approx(by_position.metrics()["loss"], rel=1e-5)
    # DL4J's RDD<MultiDataSet>: ((input, input), (target, target)) elements
    top, bottom, label, bright = h.two_tower_columns("test")
    rdd = sc.parallelize(list(zip(zip(top, bottom, strict=True),
                                  zip(label.tolist(), bright.tolist(), strict=True),
                                  strict=True)), 3)
    from_rdd = net.evaluate(rdd, output=0)
    assert from_rdd.metrics()["confusion_matrix"] == by_position.metrics()["confusion_matrix"]
    outputs = net.predict(rdd.map(lambda pair: pair[0])).collect()  # a tuple per row
    logits, bright = _local(net.model, "test")
    np.testing.assert_allclose(np.stack([o[0] for o in outputs]), logits.numpy(), atol=1e-5)
    np.testing.assert_allclose(np.concatenate([o[1] for o in outputs]), bright.numpy(),
                               atol=1e-5)


def test_multi_output_evaluation_needs_an_output_index(spark, fitted):
    net, _ = fitted
    test = h.two_tower_dataframe(spark, "test").limit(20)
    with pytest.raises(Exception, match="returned 2 outputs; evaluate one at a time with output"):
        net.evaluate(test, inputs=INPUTS, label=("label", "brightness"))
    with pytest.raises(ValueError, match="either features= .* or inputs="):
        net.evaluate(test, features="top", inputs=INPUTS)
    with pytest.raises(TypeError, match=r"inputs\[1\]=3"):
        net.evaluate(test, inputs=("top", 3))
    with pytest.raises(ValueError, match=r"no column\(s\) \['nope'\]"):
        net.evaluate(test, inputs=("top", "nope"))
    # Two losses and one label column: it failed in the workers ("target batch_size (0)").
    with pytest.raises(ValueError, match=r"2 losses .* label='label' names one column"):
        net.fit(test, inputs=INPUTS, label="label")
    with pytest.raises(ValueError, match=r"2 losses .* label='label' names one column"):
        net.fit_paths("/no/such/path", inputs=INPUTS, label="label")


def test_an_rdd_of_multidatasets_trains_with_a_loss_per_output_and_no_label_names(
        spark, sc, fitted):
    """It was refused: "label='label' names one column", where an RDD has no columns."""
    import copy

    net, _ = fitted
    model = copy.deepcopy(net.model)
    fresh = SparkModel(spark, model, net.master, loss_fn=net.loss_fn,
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    top, bottom, label, bright = h.two_tower_columns("test")
    rdd = sc.parallelize(list(zip(zip(top, bottom, strict=True),
                                  zip(label.tolist(), bright.tolist(), strict=True),
                                  strict=True)), 2)
    summary = fresh.fit(rdd, epochs=1)
    assert summary["samples"] == 359
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                     net.model.state_dict().values(),
                                                     strict=True))  # it trained
