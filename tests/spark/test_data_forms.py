"""The general cases of Spark input: fit_paths on the shared master, keyword inputs with given
shapes, Spark ML vectors from Parquet, pre-batched prediction, and clear errors on bad columns."""

from __future__ import annotations

import numpy as np
import pytest
import spark_helpers as h
import torch
from torch import nn

from paraloom.spark import NetworkSettings, SharedTrainingMaster, SparkModel

pytestmark = pytest.mark.timeout(300)

BOTTOM = [f"b{i}" for i in range(32)]
INPUTS = {"top": "top", "bottom": BOTTOM}  # model(top=..., bottom=...)
LABEL = ("label", "brightness")


@pytest.fixture(scope="module")
def fitted(spark, tmp_path_factory):
    """A shared-master fit_paths from Parquet whose ``top`` column is a Spark ML vector (64
    values read as (4, 8) by feature_shape), with the rendezvous in a port range on "lo"."""
    from pyspark.ml.functions import array_to_vector

    path = str(tmp_path_factory.mktemp("vectors") / "train")
    frame = h.two_tower_dataframe(spark, "train")
    frame.withColumn("top", array_to_vector("top")).repartition(3).write.parquet(path)
    first = h.free_ports(20)
    torch.manual_seed(0)
    model = h.Shaped()
    master = SharedTrainingMaster(32, workers=2, network=NetworkSettings(
        port_range=(first, first + 19), interface="lo"))
    net = SparkModel(spark, model, master, loss_fn=[nn.CrossEntropyLoss(), nn.MSELoss()],
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                     feature_shape={"top": (4, 8)})
    summary = net.fit_paths(path, epochs=3, inputs=INPUTS, label=LABEL)
    return net, summary, first


def _local(model: nn.Module, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    top, bottom, _, _ = h.two_tower_columns(split)
    with torch.no_grad():
        return model.eval()(top=torch.from_numpy(top).reshape(-1, 4, 8),
                            bottom=torch.from_numpy(bottom))


def test_shared_master_trains_keyword_inputs_from_parquet_vectors(spark, fitted):
    net, summary, first = fitted
    assert summary["samples"] == 3 * 1438 and summary["replicas_identical"]
    host, port = summary["rendezvous"].rsplit(":", 1)
    assert host == "127.0.0.1" and first <= int(port) < first + 20  # the range, lo's address
    test = h.two_tower_dataframe(spark, "test")
    found = net.evaluate(test, inputs=INPUTS, label=LABEL, output=0,
                         metrics=["classification", "roc"])
    logits, _ = _local(net.model, "test")
    label = h.two_tower_columns("test")[2]
    assert found["classification"].accuracy == pytest.approx(
        float((logits.argmax(1).numpy() == label).mean()))
    # it learned (chance is 0.1); how well is the synchronizer's business (test_training.py)
    assert summary["epoch_losses"][-1] < summary["epoch_losses"][0]
    assert found["classification"].accuracy >= 0.5 and found["roc"].metrics()["auc"] > 0.85
    from pyspark.ml.functions import array_to_vector

    vectors = test.withColumn("top", array_to_vector("top"))  # Spark ML vectors in predict too
    scored = net.predict(vectors, inputs=INPUTS, output=("digit", "shade"), argmax=False)
    digit = np.array([r.digit for r in scored.select("digit").collect()])  # in the rows' order
    np.testing.assert_allclose(digit, logits.numpy(), rtol=1e-5, atol=1e-5)


def _prebatched(spark, split: str, size: int):
    """The split as pre-batched rows of ``size`` examples: top array<array<float>>, b0 ..
    b31 array<float>, label array<long>."""
    top, bottom, label, _ = h.two_tower_columns(split)
    records = [(top[i:i + size].tolist(), *[bottom[i:i + size, j].tolist() for j in range(32)],
                label[i:i + size].tolist()) for i in range(0, len(label), size)]
    schema = ", ".join(["top array<array<float>>", *[f"b{j} array<float>" for j in range(32)],
                        "label array<long>"])
    return spark.createDataFrame(records, schema)


def test_prebatched_dataframe_rows_get_one_list_of_outputs_each(spark, fitted):
    net, _, _ = fitted
    frame = _prebatched(spark, "test", 50)  # 7 rows of 50 and one of 9
    scored = net.predict(frame, inputs=INPUTS, output=("digit", "shade"), prebatched=True)
    assert scored.schema["digit"].dataType.simpleString() == "array<array<float>>"
    rows = scored.select("label", "digit", "shade").collect()
    assert [len(r.digit) for r in rows] == [len(r.label) for r in rows]
    digit = np.concatenate([np.array(r.digit) for r in rows])
    shade = np.concatenate([np.array(r.shade)[:, 0] for r in rows])
    order = np.concatenate([np.array(r.label) for r in rows])
    logits, bright = _local(net.model, "test")
    assert np.array_equal(order, h.two_tower_columns("test")[2])  # rows kept their order here
    np.testing.assert_allclose(digit, logits.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(shade, bright.numpy(), rtol=1e-5, atol=1e-5)


def test_bad_columns_and_shapes_are_named_with_the_fix(spark, fitted):
    from pyspark.sql import functions as F

    net, _, _ = fitted
    test = h.two_tower_dataframe(spark, "test").limit(8)
    with pytest.raises(ValueError, match=r"no column\(s\) \['nope'\]"):
        net.fit(test, inputs={"top": "nope", "bottom": BOTTOM}, label=LABEL)
    named = test.withColumn("name", F.lit("seven"))
    with pytest.raises(TypeError, match=r"'name'.*do not hold numbers.*cast"):
        net.evaluate(named, inputs={"top": "top", "bottom": [*BOTTOM[:31], "name"]},
                     label=LABEL, output=0)  # before any Spark job, with the cast to make
    with pytest.raises(TypeError, match="do not hold numbers"):
        net.predict(named, inputs={"top": "top", "bottom": "name"}, output=("d", "s"))
    one_shape = SparkModel(spark, net.model, net.master, loss_fn=net.loss_fn,
                           feature_shape=(4, 8))
    with pytest.raises(ValueError, match="give a dict of shapes by input name"):
        one_shape.evaluate(test, inputs=INPUTS, label=LABEL, output=0)
    with pytest.raises(ValueError, match="one shape .or None. per input"):
        one_shape.evaluate(test, inputs=("top", BOTTOM), label=LABEL, output=0)
    too_big = SparkModel(spark, net.model, net.master, loss_fn=net.loss_fn,
                         feature_shape={"top": (5, 8)})
    with pytest.raises(Exception, match="has 32 values but feature_shape=.5, 8. needs 40"):
        too_big.evaluate(test, inputs=INPUTS, label=LABEL, output=0)


def test_decimal_columns_are_read_as_numbers(spark, fitted):
    """Exact decimals (prices, amounts; class ids as decimal(p, 0)) score as the doubles and
    longs they hold: predict and evaluate take them (fit reads columns the same way)."""
    from pyspark.sql import functions as F

    net, _, _ = fitted
    exact = h.two_tower_dataframe(spark, "test") \
        .withColumn("b31", F.col("b31").cast("decimal(12, 6)")) \
        .withColumn("label", F.col("label").cast("decimal(2, 0)"))
    assert dict(exact.dtypes)["b31"] == "decimal(12,6)"
    scored = net.predict(exact, inputs=INPUTS, output=("digit", "shade"))
    digit = np.array([r.digit for r in scored.select("digit").collect()])  # in the rows' order
    logits, _ = _local(net.model, "test")
    np.testing.assert_allclose(digit, logits.numpy(), rtol=1e-4, atol=1e-4)
    found = net.evaluate(exact, inputs=INPUTS, label=LABEL, output=0)
    label = h.two_tower_columns("test")[2]
    assert found.accuracy == pytest.approx(float((logits.argmax(1).numpy() == label).mean()))


def test_column_names_with_dots_are_taken_literally(spark):
    """CSV headers like "sepal.length" are column names, not struct fields: fit, evaluate and
    predict read them (a vector column with a dot too)."""
    from pyspark.ml.functions import array_to_vector

    from paraloom.spark import ParameterAveragingTrainingMaster

    g = np.random.default_rng(0)
    x = g.normal(size=(40, 3)).astype(np.float32)
    label = (x.sum(1) > 0).astype(np.int64)
    frame = spark.createDataFrame(
        [(float(a), float(b), [float(c)], int(y)) for (a, b, c), y in zip(x, label, strict=True)],
        "`sepal.length` double, `sepal.width` double, `petal.all` array<double>, `iris.class` long",
    ).withColumn("petal.all", array_to_vector("`petal.all`"))
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    net = SparkModel(spark, model, ParameterAveragingTrainingMaster(8, workers=2),
                     loss_fn=nn.CrossEntropyLoss(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    features = ["sepal.length", "sepal.width", "petal.all"]
    assert net.fit(frame, features=features, label="iris.class")["samples"] == 40
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
    found = net.evaluate(frame, features=features, label="iris.class")
    assert found.accuracy == pytest.approx(float((logits.argmax(1).numpy() == label).mean()))
    scored = net.predict(frame.coalesce(1), features=features, output="iris.scores")
    got = np.array([r["iris.scores"] for r in scored.collect()])
    np.testing.assert_allclose(got, logits.numpy(), rtol=1e-5, atol=1e-6)
