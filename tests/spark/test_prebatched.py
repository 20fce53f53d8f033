"""Pre-batched rows (DL4J's examplesPerDataSetObject): one row or element holds a minibatch."""

from __future__ import annotations

import numpy as np
import pytest
import spark_helpers as h
import torch
from spark_helpers import accuracy
from torch import nn

from paraloom.datasets import digits
from paraloom.evaluation import Evaluation
from paraloom.spark import ParameterAveragingTrainingMaster, SparkModel, SparkTrainingError

pytestmark = pytest.mark.timeout(300)


def _batches(split: str, size: int):
    """The split as minibatches of ``size`` rows (the last one short): (x [n, 64], y [n])."""
    x, y = digits(split).tensors
    flat = x.reshape(len(x), 64).numpy()
    return [(flat[i:i + size], y[i:i + size].numpy()) for i in range(0, len(x), size)]


def _frame(spark, split: str, size: int):
    records = [(xb.tolist(), yb.tolist()) for xb, yb in _batches(split, size)]
    return spark.createDataFrame(records, "features array<array<float>>, label array<long>")


def _net(spark) -> SparkModel:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return SparkModel(spark, model,
                      ParameterAveragingTrainingMaster(32, averaging_frequency=12, workers=2),
                      loss_fn=nn.CrossEntropyLoss(),
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def test_prebatched_dataframe_rows_train_and_evaluate_every_example(spark, sc, digits_test):
    net = _net(spark)
    summary = net.fit(_frame(spark, "train", 100), epochs=3, prebatched=True)
    assert summary["samples"] == 3 * 1438  # every example of the 15 minibatch rows, each epoch
    test = torch.utils.data.TensorDataset(digits_test.tensors[0].reshape(-1, 64),
                                          digits_test.tensors[1])
    assert accuracy(net.model, test) >= 0.9
    evaluation = net.evaluate(_frame(spark, "test", 50), prebatched=True)
    assert isinstance(evaluation, Evaluation)
    assert evaluation.accuracy == pytest.approx(accuracy(net.model, test), abs=1e-6)
    assert int(evaluation.confusion.sum()) == len(test)
    # An RDD of (x [n, 64], y [n]) minibatches: the same metrics, and one output array each.
    rdd = sc.parallelize(_batches("test", 64), 2)
    same = net.evaluate(rdd, prebatched=True)
    assert torch.equal(same.confusion, evaluation.confusion)
    outputs = net.predict(rdd.keys(), prebatched=True, argmax=True).collect()
    assert [len(o) for o in outputs[:2]] == [64, 64]
    with torch.no_grad():
        logits = net.model(test.tensors[0])
    assert np.array_equal(np.concatenate(outputs), logits.argmax(1).numpy())
    # A DataFrame of pre-batched rows: a list of n outputs per row, in the rows' order.
    frame = _frame(spark, "test", 50).coalesce(1)
    classes = net.predict(frame, prebatched=True, argmax=True, output="digit")
    assert classes.schema["digit"].dataType.simpleString() == "array<bigint>"
    rows = classes.collect()
    assert [len(r.digit) for r in rows] == [50] * 7 + [9]
    assert np.array_equal(np.concatenate([r.digit for r in rows]), logits.argmax(1).numpy())
    scores = net.predict(frame, prebatched=True).select("prediction").collect()
    np.testing.assert_allclose(np.concatenate([np.array(r.prediction) for r in scores]),
                               logits.numpy(), rtol=1e-5, atol=1e-5)


def test_prebatched_rows_must_be_lists_of_equal_counts(spark):
    net = _net(spark)
    flat = h.dataframe(spark, "test")  # one example per row: not pre-batched
    with pytest.raises((TypeError, SparkTrainingError), match="no list per row"):
        net.evaluate(flat, prebatched=True)
    bad = spark.createDataFrame([([[0.0] * 64] * 3, [1, 2])],
                                "features array<array<float>>, label array<long>")
    with pytest.raises(Exception, match="same count"):
        net.evaluate(bad, prebatched=True)
    with pytest.raises(TypeError, match="no list per row"):  # on the driver, from the schema
        net.predict(flat.select(flat.label.alias("features")), prebatched=True)
    empty = spark.createDataFrame([([], []), ([[0.0] * 64], [3])],
                                  "features array<array<float>>, label array<long>")
    for frame in (empty, empty.limit(1)):  # with a full minibatch, or only empty ones
        rows = net.predict(frame.coalesce(1), prebatched=True, argmax=True).collect()
        assert [len(r.prediction) for r in rows] == [0, 1][:len(rows)]  # empty: an empty list
