"""Models whose outputs the other Spark tests' models do not give: a dict of outputs, bfloat16,
a 3-d output, a one-tuple; and Parquet paths that Spark reads but fit_paths does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from spark_helpers import DictOut, Released, ScoreAndProbability, Tagger
from torch import nn

from paraloom import WorkerError
from paraloom.spark import ParameterAveragingTrainingMaster, SharedTrainingMaster, SparkModel

pytestmark = pytest.mark.timeout(300)


def _frame(spark, n: int = 64):
    x = np.random.default_rng(0).normal(size=(n, 4)).astype(np.float32)
    rows = [(r.tolist(), int(r[0] > 0), float(r[1])) for r in x]
    return x, spark.createDataFrame(rows, "features array<float>, cls long, reg double")


def test_a_dict_output_model_trains_with_a_loss_per_output_and_evaluates_by_key(spark):
    """compute_loss took only tuples for a list of losses ("2 loss functions were given but
    the model returned {'cls': ..., 'reg': ...}"), and evaluate(output='cls') met tuple
    targets with a key (TypeError)."""
    x, frame = _frame(spark)
    torch.manual_seed(0)
    model = DictOut()
    net = SparkModel(spark, model, ParameterAveragingTrainingMaster(16, workers=2),
                     loss_fn=[nn.CrossEntropyLoss(), nn.MSELoss()],
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    summary = net.fit(frame, label=("cls", "reg"), epochs=3)
    assert summary["epoch_losses"][-1] < summary["epoch_losses"][0]
    with torch.no_grad():
        out = model.eval()(torch.from_numpy(x))
    labels = torch.tensor([int(r[0] > 0) for r in x])
    accuracy = float((out["cls"].argmax(1) == labels).float().mean())
    by_key = net.evaluate(frame, label=("cls", "reg"), output="cls")
    by_index = net.evaluate(frame, label=("cls", "reg"), output=0)
    assert by_key.accuracy == by_index.accuracy == pytest.approx(accuracy)
    reg = net.evaluate_regression(frame, label=("cls", "reg"), output="reg").metrics()
    target = torch.from_numpy(x[:, 1:2])
    assert reg["mse"] == pytest.approx(float(((out["reg"] - target) ** 2).mean()), rel=1e-4)
    # one label column: the loss is the evaluated output's own
    alone = net.evaluate(frame, label="cls", output="cls").metrics()["loss"]
    assert alone == pytest.approx(float(nn.CrossEntropyLoss()(out["cls"], labels)), rel=1e-4)
    with pytest.raises(WorkerError, match=r"output='nope'.*\['cls', 'reg'\]"):
        net.evaluate(frame, label=("cls", "reg"), output="nope")


def test_a_bfloat16_model_predicts_float32_and_one_name_in_a_tuple_is_one_column(spark, sc):
    x, frame = _frame(spark, 8)
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(torch.bfloat16)
    net = SparkModel(spark, model, ParameterAveragingTrainingMaster(workers=1),
                     feature_dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(torch.from_numpy(x).to(torch.bfloat16)).float().numpy()
    rows = net.predict(frame, output=("p",)).collect()  # numpy has no bfloat16
    np.testing.assert_allclose(np.array([r.p for r in rows]), expected)
    got = net.predict(sc.parallelize(list(x), 2)).collect()
    np.testing.assert_allclose(np.stack(got), expected)


def test_argmax_over_a_three_dimensional_output_is_refused_not_taken_over_positions(spark, sc):
    """It returned the argmax over dim 1, the positions, for an RDD (silently wrong), and an
    Arrow error for a DataFrame."""
    x, frame = _frame(spark, 8)
    net = SparkModel(spark, Tagger(), ParameterAveragingTrainingMaster(workers=1))
    with pytest.raises(Exception, match=r"argmax=True needs outputs of shape \(rows, classes\)"):
        net.predict(sc.parallelize(list(x), 1), argmax=True).collect()
    with pytest.raises(Exception, match=r"returned shape \(8, 2, 3\)"):
        net.predict(frame.coalesce(1), argmax=True).collect()
    flat = net.predict(frame).collect()  # without argmax: each row's output, flattened
    assert len(flat[0].prediction) == 6


def test_fit_paths_names_globs_and_partition_columns_with_the_way_out(spark, tmp_path):
    frame = spark.createDataFrame([([1.0, 2.0], 0, 2023), ([3.0, 4.0], 1, 2024)],
                                  "features array<float>, label long, year int")
    path = str(tmp_path / "hive")
    frame.write.partitionBy("year").parquet(path)
    net = SparkModel(spark, nn.Linear(2, 2), ParameterAveragingTrainingMaster(workers=1),
                     loss_fn=nn.CrossEntropyLoss(),
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(ValueError, match="not globs.*spark.read.parquet"):
        net.fit_paths(f"{path}/year=*/*.parquet")
    with pytest.raises(ValueError, match="'year' is a partition column.*spark.read.parquet"):
        net.fit_paths(path, features=["features", "year"])


def test_a_dict_outputs_probability_counts_class_one_above_one_half_by_key(spark):
    """evaluate(output='prob') on a dict output trained with BCELoss took the threshold 0 (a
    logit's): the key was not matched to its loss, so every row counted as class 1."""
    x, frame = _frame(spark)
    model = ScoreAndProbability()
    with torch.no_grad():
        p = model(torch.from_numpy(x))["prob"].reshape(-1).numpy()
    labels = np.array([int(r[0] > 0) for r in x])
    expected = float(((p > 0.5) == labels).mean())
    assert 0 < (p > 0.5).sum() < len(p) and expected != labels.mean()
    net = SparkModel(spark, model, ParameterAveragingTrainingMaster(16, workers=2),
                     loss_fn=[nn.MSELoss(), nn.BCELoss()])
    assert net.evaluate(frame, label=("reg", "cls"), output="prob").accuracy == \
        pytest.approx(expected)
    found = net.evaluate(frame, label=("reg", "cls"), output="prob", metrics=["classification"])
    assert found["classification"].accuracy == pytest.approx(expected)
    assert net.evaluate(frame, label=("reg", "cls"), output=1).accuracy == pytest.approx(expected)


@pytest.mark.parametrize("master", [
    ParameterAveragingTrainingMaster(16, workers=2),
    ParameterAveragingTrainingMaster(16, workers=2, averaging_frequency=2,
                                     outer_optimizer="nesterov"),  # DiLoCo
    SharedTrainingMaster(16, workers=2),
], ids=["averaging", "diloco", "shared"])
def test_a_model_with_extra_state_trains_predicts_and_evaluates(spark, master):
    """get_extra_state()'s dict failed packing the model ('dict' object has no attribute
    'detach'), and the averaged state lost it (Missing key(s): "_extra_state")."""
    x, frame = _frame(spark)
    torch.manual_seed(0)
    model = Released()
    model.release = "b"
    net = SparkModel(spark, model, master, loss_fn=nn.CrossEntropyLoss(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    before = model.fc.weight.detach().clone()
    net.fit(frame, label="cls", epochs=2)
    assert model.release == "b" and not torch.equal(model.fc.weight, before)
    with torch.no_grad():
        want = model.eval()(torch.from_numpy(x)).numpy()
    got = np.stack([r["out"] for r in net.predict(frame, output="out").collect()])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert net.evaluate(frame, label="cls").metrics()["count"] == 64


def test_column_names_match_as_spark_matches_them_ignoring_case(spark):
    """A CSV header's Features and Label: Spark's df.select('features') reads them (its
    caseSensitive is false by default), fit, evaluate and predict refused them."""
    x, frame = _frame(spark)
    upper = frame.withColumnRenamed("features", "Features").withColumnRenamed("cls", "Label")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    net = SparkModel(spark, model, ParameterAveragingTrainingMaster(16, workers=2),
                     loss_fn=nn.CrossEntropyLoss(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert net.fit(upper, epochs=1)["samples"] == 64  # features= and label= by default
    assert net.evaluate(upper).metrics()["count"] == 64
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    got = np.stack([r["prediction"] for r in net.predict(upper).collect()])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    spark.conf.set("spark.sql.caseSensitive", "true")
    try:
        with pytest.raises(ValueError, match=r"no column\(s\) \['features', 'label'\]"):
            net.evaluate(upper)
    finally:
        spark.conf.set("spark.sql.caseSensitive", "false")
