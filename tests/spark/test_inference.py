"""Distributed evaluation and inference equal the same computations done locally."""

from __future__ import annotations

import numpy as np
import pytest
import spark_helpers as h
import torch
from torch import nn
from torch.utils.data import DataLoader

from paraloom.evaluation import evaluate
from paraloom.models import LeNet
from paraloom.spark import ParameterAveragingTrainingMaster, SparkModel

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model(digits_train):
    """A LeNet trained for two epochs in this process: predictions worth comparing."""
    torch.manual_seed(0)
    net = LeNet(image_size=8)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):
        for x, y in DataLoader(digits_train, batch_size=32, shuffle=True):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    return net.eval()


def spark_model(spark, model, **options) -> SparkModel:
    return SparkModel(spark, model, ParameterAveragingTrainingMaster(workers=2),
                      loss_fn=nn.CrossEntropyLoss(), **options)


def test_evaluate_equals_local_metrics(spark, sc, model, digits_test):
    local = evaluate(model, DataLoader(digits_test, batch_size=64),
                     loss_fn=nn.CrossEntropyLoss()).metrics()
    from pyspark.ml.functions import array_to_vector

    frame = h.dataframe(spark, "test")
    vectors = frame.select(array_to_vector("features").alias("features"), "label")
    for data, options in ((h.rdd(sc, "test", 3), {}),
                          (frame, {"feature_shape": (1, 8, 8)}),
                          (vectors, {"feature_shape": (1, 8, 8)})):  # Spark ML vectors too
        remote = spark_model(spark, model, **options).evaluate(data, batch_size=50).metrics()
        assert remote["confusion_matrix"] == local["confusion_matrix"]
        assert remote["count"] == local["count"] == 359
        for key in ("accuracy", "precision", "recall", "f1"):
            assert remote[key] == local[key]
        assert remote["loss"] == pytest.approx(local["loss"], rel=1e-5)
    assert 0.5 < local["accuracy"] < 1  # a partly trained model: the comparison means something


def test_evaluate_loss_is_a_mean_per_row_with_a_summed_loss(spark, sc, model, digits_test):
    local = evaluate(model, DataLoader(digits_test, batch_size=64),
                     loss_fn=nn.CrossEntropyLoss()).metrics()
    net = SparkModel(spark, model, ParameterAveragingTrainingMaster(workers=2),
                     loss_fn=nn.CrossEntropyLoss(reduction="sum"))
    remote = net.evaluate(h.rdd(sc, "test", 3), batch_size=50).metrics()
    assert remote["loss"] == pytest.approx(local["loss"], rel=1e-5)  # not times 50 rows


def test_evaluate_regression_equals_local(spark, sc):
    torch.manual_seed(0)
    linear = nn.Linear(3, 2)
    g = np.random.default_rng(0)
    x = g.normal(size=(101, 3)).astype(np.float32)
    y = (x @ g.normal(size=(3, 2)) + 0.1 * g.normal(size=(101, 2))).astype(np.float32)
    rows = sc.parallelize(list(zip(x, y, strict=True)), 3)
    net = SparkModel(spark, linear, ParameterAveragingTrainingMaster(workers=2),
                     loss_fn=nn.MSELoss())
    metrics = net.evaluate_regression(rows, batch_size=16).metrics()
    with torch.no_grad():
        pred = linear(torch.from_numpy(x)).double().numpy()
    mse = ((pred - y) ** 2).mean(0)
    assert metrics["count"] == 101
    assert metrics["mse"] == pytest.approx(mse.mean(), rel=1e-6)
    assert metrics["r2"] == pytest.approx((1 - mse / y.var(0)).mean(), rel=1e-6)


def test_binary_one_logit_model_gets_classification_roc_and_regression_in_one_pass(spark):
    """DL4J's evaluateROC on a sigmoid output: one logit per row, double 0/1 labels (as
    BCEWithLogitsLoss wants them), every metric in one pass, equal to the local ones."""
    from sklearn.metrics import roc_auc_score

    torch.manual_seed(0)
    linear = nn.Linear(4, 1)
    g = np.random.default_rng(0)
    x = g.normal(size=(300, 4)).astype(np.float32)
    with torch.no_grad():
        logit = linear(torch.from_numpy(x)).reshape(-1).numpy()
    y = (logit + g.normal(size=300) > 0).astype(np.float64)  # overlapping classes
    frame = spark.createDataFrame([(r.tolist(), float(v)) for r, v in zip(x, y, strict=True)],
                                  "features array<float>, label double").repartition(3)
    net = SparkModel(spark, linear, ParameterAveragingTrainingMaster(workers=2),
                     loss_fn=nn.BCEWithLogitsLoss(), label_dtype=torch.float32)
    # (n, 1) outputs against (n,) labels: a loss that squeezes, as users write for BCE
    net.loss_fn = lambda out, target: nn.functional.binary_cross_entropy_with_logits(
        out.squeeze(1), target)
    found = net.evaluate(frame, metrics=["classification", "roc"], batch_size=64)
    classes, roc = found["classification"].metrics(), found["roc"].metrics()
    assert classes["count"] == roc["count"] == 300
    assert classes["accuracy"] == pytest.approx(float(((logit > 0) == y).mean()))
    assert 0.7 < roc["auc"] < 0.99
    assert roc["auc"] == pytest.approx(roc_auc_score(y, logit), abs=1e-3)
    assert net.evaluate(frame).accuracy == classes["accuracy"]  # the default metric too


def test_predict_dataframe_equals_local_outputs(spark, model, digits_test):
    net = spark_model(spark, model, feature_shape=(1, 8, 8))
    df = h.dataframe(spark, "test").repartition(3)
    scored = net.predict(df, features="features", output="prediction", batch_size=40)
    assert scored.columns == ["features", "label", "prediction"]
    rows = scored.collect()
    x = torch.tensor(np.array([r["features"] for r in rows], dtype=np.float32)).view(-1, 1, 8, 8)
    with torch.no_grad():
        expected = model(x)
    got = torch.tensor(np.array([r["prediction"] for r in rows], dtype=np.float32))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    classes = net.predict(df, output="cls", argmax=True).select("features", "cls").collect()
    x = torch.tensor(np.array([r["features"] for r in classes], dtype=np.float32))
    with torch.no_grad():
        assert [r["cls"] for r in classes] == model(x.view(-1, 1, 8, 8)).argmax(1).tolist()


def test_predict_rdd_keeps_order_and_keys(spark, sc, model, digits_test):
    net = spark_model(spark, model)
    x, _ = digits_test.tensors
    features = sc.parallelize([row.numpy() for row in x], 4)
    with torch.no_grad():
        expected = model(x)
    got = np.stack(net.predict(features, batch_size=32).collect())
    torch.testing.assert_close(torch.from_numpy(got), expected, rtol=1e-5, atol=1e-5)
    keyed = sc.parallelize([(f"id{i}", row.numpy()) for i, row in enumerate(x)], 3)
    classes = dict(net.predict(keyed, keyed=True, argmax=True).collect())
    assert classes == {f"id{i}": int(c) for i, c in enumerate(expected.argmax(1))}


def test_predict_tells_apart_models_that_share_their_parameters(spark):
    """Spark reuses its Python workers, which cache the model they built: the cache must know
    a model's structure, not only its parameters."""
    x = np.random.default_rng(0).normal(size=(6, 3)).astype(np.float32)
    frame = spark.createDataFrame([(row.tolist(),) for row in x], ["x"])
    for activation in (nn.ReLU(), nn.Tanh(), nn.Sigmoid()):
        torch.manual_seed(0)  # the same Linear every time: equal state_dicts
        model = nn.Sequential(nn.Linear(3, 2), activation)
        net = SparkModel(spark, model, ParameterAveragingTrainingMaster(workers=1))
        got = np.array([r["p"] for r in net.predict(frame, features="x", output="p").collect()])
        with torch.no_grad():
            expected = model(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_scalar_label_column_trains_a_one_unit_regression(spark):
    """A double label column against nn.Linear(3, 1) and MSELoss: (n,) targets against (n, 1)
    outputs would broadcast to (n, n) and learn only the mean."""
    g = np.random.default_rng(0)
    x = g.normal(size=(200, 3)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5], dtype=np.float32)
    frame = spark.createDataFrame([(r.tolist(), float(v)) for r, v in zip(x, y, strict=True)],
                                  ["x", "y"]).repartition(2)
    torch.manual_seed(0)
    linear = nn.Linear(3, 1)
    net = SparkModel(spark, linear, ParameterAveragingTrainingMaster(
        batch_size_per_worker=16, workers=2, averaging_frequency=4), loss_fn=nn.MSELoss(),
        optimizer=torch.optim.SGD(linear.parameters(), lr=0.05))
    net.fit(frame, epochs=8, features="x", label="y")
    metrics = net.evaluate_regression(frame, features="x", label="y").metrics()
    assert metrics["r2"] > 0.99
    torch.testing.assert_close(linear.weight.detach(), torch.tensor([[1.0, -2.0, 0.5]]),
                               atol=0.05, rtol=0)
    assert metrics["loss"] == pytest.approx(metrics["mse"], rel=1e-4)  # the same comparison
    # A summed elementwise loss is taken per row: it was counted once per row again (x 50).
    summed = SparkModel(spark, linear, ParameterAveragingTrainingMaster(workers=2),
                        loss_fn=nn.MSELoss(reduction="sum"))
    loss = summed.evaluate_regression(frame, features="x", label="y").metrics()["loss"]
    assert loss == pytest.approx(metrics["mse"], rel=1e-4)


def test_evaluate_a_double_class_label_says_to_set_label_dtype(spark):
    from paraloom.errors import WorkerError

    x = np.random.default_rng(0).normal(size=(20, 3)).astype(np.float32)
    frame = spark.createDataFrame([(r.tolist(), float(i % 2)) for i, r in enumerate(x)],
                                  ["x", "label"])
    torch.manual_seed(0)
    net = SparkModel(spark, nn.Linear(3, 2), ParameterAveragingTrainingMaster(workers=1),
                     loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(WorkerError, match=r"Spark evaluation failed: .*label_dtype=torch.long"):
        net.evaluate(frame, features="x")


def test_evaluate_a_label_outside_the_classes_names_the_range_with_a_loss_fn(spark):
    from paraloom.errors import WorkerError

    frame = spark.createDataFrame([([1.0, 2.0, 3.0], 0), ([0.5, 0.0, 1.0], 7)], ["x", "label"])
    net = SparkModel(spark, nn.Linear(3, 4), ParameterAveragingTrainingMaster(workers=1),
                     loss_fn=nn.CrossEntropyLoss())  # its IndexError would come first
    with pytest.raises(WorkerError, match=r"class indices in \[0, 4\)"):
        net.evaluate(frame, features="x")


def test_evaluate_one_hot_label_columns_like_class_indices(spark):
    """DL4J's and Keras's one-hot labels: CrossEntropyLoss trains on them, evaluate counts
    them as their class (the same metrics as the index column)."""
    g = np.random.default_rng(0)
    x = g.normal(size=(60, 3)).astype(np.float32)
    y = g.integers(0, 3, size=60)
    frame = spark.createDataFrame(
        [(r.tolist(), int(c), np.eye(3)[c].tolist()) for r, c in zip(x, y, strict=True)],
        "x array<float>, label long, onehot array<double>")
    torch.manual_seed(0)
    net = SparkModel(spark, nn.Linear(3, 3), ParameterAveragingTrainingMaster(workers=2),
                     loss_fn=nn.CrossEntropyLoss())
    by_index = net.evaluate(frame, features="x", metrics=["classification", "roc"])
    by_row = net.evaluate(frame, features="x", label="onehot",
                          metrics=["classification", "roc"])
    rows, index = by_row["classification"].metrics(), by_index["classification"].metrics()
    assert rows["count"] == 60 and rows["confusion_matrix"] == index["confusion_matrix"]
    assert rows["loss"] == pytest.approx(index["loss"], rel=1e-5)  # CE of the same classes
    assert by_row["roc"].metrics()["auc"] == by_index["roc"].metrics()["auc"]


def test_fit_on_a_double_class_label_says_to_set_label_dtype(spark):
    """fit() names the fix too, on either master (evaluate() above already did)."""
    from paraloom.spark import SharedTrainingMaster, SparkTrainingError

    x = np.random.default_rng(0).normal(size=(20, 3)).astype(np.float32)
    frame = spark.createDataFrame([(r.tolist(), float(i % 2)) for i, r in enumerate(x)],
                                  ["x", "label"])
    for master in (ParameterAveragingTrainingMaster(8, workers=1),
                   SharedTrainingMaster(8, workers=2)):
        torch.manual_seed(0)
        linear = nn.Linear(3, 2)
        net = SparkModel(spark, linear, master, loss_fn=nn.CrossEntropyLoss(),
                         optimizer=torch.optim.SGD(linear.parameters(), lr=0.1))
        fix = r"(?s)Long.*Float.*label_dtype=torch.long"
        with pytest.raises(SparkTrainingError, match=fix) as e:
            net.fit(frame, features="x")
        assert e.value.attempts == 1


def test_one_logit_model_trains_on_long_labels_and_predicts_classes_like_evaluate(spark, sc):
    """A binary model with one logit per row and BCEWithLogitsLoss: long 0/1 labels train
    (BCE needs them as floats), and predict(argmax=True) gives class 1 where the logit is
    above 0, as evaluate counts it (an argmax over one column is always 0)."""
    g = np.random.default_rng(0)
    x = g.normal(size=(80, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -1.0, 2.0, 0.5]) > 0).astype(np.int64)
    frame = spark.createDataFrame([(r.tolist(), int(v)) for r, v in zip(x, y, strict=True)],
                                  "features array<float>, label long")
    torch.manual_seed(0)
    linear = nn.Linear(4, 1)
    net = SparkModel(spark, linear, ParameterAveragingTrainingMaster(16, workers=1),
                     loss_fn=nn.BCEWithLogitsLoss(),
                     optimizer=torch.optim.SGD(linear.parameters(), lr=0.5))
    net.fit(frame, epochs=5)
    with torch.no_grad():
        logit = linear(torch.from_numpy(x)).reshape(-1).numpy()
    expected = (logit > 0).astype(np.int64)
    found = net.evaluate(frame)
    assert found.accuracy == pytest.approx(float((expected == y).mean()))
    assert found.accuracy > 0.85  # it learned
    scored = net.predict(frame.coalesce(1), argmax=True, output="cls").collect()
    assert [r.cls for r in scored] == expected.tolist()
    assert net.predict(sc.parallelize(list(x), 2), argmax=True).collect() == expected.tolist()


def test_predict_refuses_output_names_the_dataframe_already_has(spark):
    """predict adds columns: an output named like an existing column (the label) would
    overwrite it, or with several outputs make an ambiguous DataFrame; both fail at once,
    naming the columns, as Spark ML's transform does."""
    frame = spark.createDataFrame([([1.0, 2.0], 0), ([3.0, 4.0], 1)],
                                  "features array<float>, label long")
    net = SparkModel(spark, nn.Linear(2, 2), ParameterAveragingTrainingMaster(workers=1))
    with pytest.raises(ValueError, match=r"output column\(s\) \['label'\] already exist"):
        net.predict(frame, output="label")
    with pytest.raises(ValueError, match=r"\['label'\] already exist"):
        net.predict(frame, output=("scores", "label"))
    with pytest.raises(ValueError, match="names a column twice"):
        net.predict(frame, output=("a", "a"))
    with pytest.raises(ValueError, match=r"\['Label'\] already exist"):
        net.predict(frame, output="Label")  # Spark folds case: it replaced the label column
    with pytest.raises(ValueError, match="names a column twice"):
        net.predict(frame, output=("a", "A"))
    scored = net.predict(frame, output="scores").collect()
    assert [r.label for r in scored] == [0, 1] and len(scored[0].scores) == 2
    spark.conf.set("spark.sql.caseSensitive", "true")
    try:  # a case-sensitive session keeps both
        assert net.predict(frame, output="Label").columns == ["features", "label", "Label"]
    finally:
        spark.conf.unset("spark.sql.caseSensitive")


def test_predict_and_evaluate_name_a_feature_width_the_model_does_not_take(spark, sc):
    """predict is lazy: its error reaches the action as Spark's PythonException, whose last
    lines were torch's alone ("mat1 and mat2 shapes cannot be multiplied")."""
    from pyspark.errors import PythonException

    from paraloom import WorkerError

    frame = spark.createDataFrame([([1.0] * 6, 0), ([2.0] * 6, 1)],
                                  "features array<float>, label long")
    net = SparkModel(spark, nn.Linear(4, 2), ParameterAveragingTrainingMaster(workers=1),
                     loss_fn=nn.CrossEntropyLoss())
    want = r"(?s)inputs Tensor\(\d, 6\).*got rows of 6 values where it takes 4"
    with pytest.raises(PythonException, match=want):
        net.predict(frame).collect()
    with pytest.raises(PythonException, match=want):
        net.predict(sc.parallelize([[1.0] * 6, [2.0] * 6], 1)).collect()
    with pytest.raises(WorkerError, match=want):
        net.evaluate(frame)


def test_a_batch_size_below_one_fails_before_any_job(spark, sc):
    frame = spark.createDataFrame([([1.0, 2.0], 0)], "features array<float>, label long")
    net = SparkModel(spark, nn.Linear(2, 2), ParameterAveragingTrainingMaster(workers=1))
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match=rf"batch_size={bad}; expected an int >= 1"):
            net.evaluate(frame, batch_size=bad)
        with pytest.raises(ValueError, match=rf"batch_size={bad}; expected an int >= 1"):
            net.evaluate_regression(frame, batch_size=bad)
        with pytest.raises(ValueError, match=rf"batch_size={bad}; expected an int >= 1"):
            net.predict(sc.parallelize([[1.0, 2.0]]), batch_size=bad)


def test_a_sigmoid_output_trained_with_bce_counts_class_one_above_one_half(spark, sc):
    """Keras's binary form: a sigmoid output and BCELoss. Its score is a probability, so
    evaluate and predict(argmax=True) give class 1 above 0.5 (above 0 every row would be 1)."""
    from sklearn.metrics import roc_auc_score

    g = np.random.default_rng(0)
    x = g.normal(size=(120, 4)).astype(np.float32)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    with torch.no_grad():
        p = model(torch.from_numpy(x)).reshape(-1).numpy()
    y = (p + g.normal(scale=0.1, size=120) > 0.5).astype(np.int64)
    expected = (p > 0.5).astype(np.int64)
    assert 0 < expected.sum() < 120  # both classes predicted: a threshold of 0 gives all 1
    frame = spark.createDataFrame([(r.tolist(), int(v)) for r, v in zip(x, y, strict=True)],
                                  "features array<float>, label long")
    net = SparkModel(spark, model, ParameterAveragingTrainingMaster(workers=2),
                     loss_fn=nn.BCELoss())
    found = net.evaluate(frame, metrics=["classification", "roc"])
    assert found["classification"].accuracy == pytest.approx(float((expected == y).mean()))
    assert found["roc"].metrics()["auc"] == pytest.approx(roc_auc_score(y, p), abs=1e-6)
    assert net.evaluate(frame).accuracy == found["classification"].accuracy
    scored = net.predict(frame.coalesce(1), argmax=True, output="cls").collect()
    assert [r.cls for r in scored] == expected.tolist()
    assert net.predict(sc.parallelize(list(x), 2), argmax=True).collect() == expected.tolist()


def test_integer_ids_train_evaluate_and_predict_exactly_with_feature_dtype_long(spark, sc):
    from paraloom.errors import WorkerError

    g = np.random.default_rng(0)
    ids = g.integers(0, 30, size=(64, 3))
    labels = (ids[:, 0] >= 15).astype(np.int64)  # the first item decides the class
    frame = spark.createDataFrame([(r.tolist(), int(c)) for r, c in zip(ids, labels, strict=True)],
                                  "ids array<long>, label long")
    torch.manual_seed(0)
    plain = SparkModel(spark, h.BagOfIds(30), ParameterAveragingTrainingMaster(workers=1),
                       loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(WorkerError, match=r"(?s)'indices'.*feature_dtype=torch.long"):
        plain.evaluate(frame, features="ids")
    with pytest.raises(Exception, match=r"(?s)'indices'.*feature_dtype=torch.long"):
        plain.predict(frame, features="ids").collect()  # lazy: the user's action raises it
    model = h.BagOfIds(30)
    net = SparkModel(spark, model, ParameterAveragingTrainingMaster(16, workers=2),
                     loss_fn=nn.CrossEntropyLoss(), feature_dtype=torch.long,
                     optimizer=torch.optim.Adam(model.parameters(), lr=0.05))
    net.fit(frame, epochs=15, features="ids")
    found = net.evaluate(frame, features="ids").metrics()
    with torch.no_grad():
        logits = model(torch.from_numpy(ids))
    assert found["accuracy"] == pytest.approx(float((logits.argmax(1).numpy() == labels).mean()))
    assert found["accuracy"] >= 0.9
    assert found["loss"] == pytest.approx(nn.CrossEntropyLoss()(logits, torch.from_numpy(labels))
                                          .item(), rel=1e-4)
    # ids past float32's 2**24 reach the model exactly (a float cast would round them)
    big = np.array([[16_777_217, 123_456_789]], dtype=np.int64)
    echo = SparkModel(spark, h.IdsEcho(), ParameterAveragingTrainingMaster(workers=1),
                      feature_dtype=torch.long)
    (out,) = echo.predict(sc.parallelize(list(big), 1)).collect()
    assert np.asarray(out).tolist() == big[0].tolist()
    with pytest.raises(ValueError, match=r"feature_dtype=.*gives 2 dtypes but the rows hold one"):
        SparkModel(spark, h.BagOfIds(30), ParameterAveragingTrainingMaster(workers=1),
                   feature_dtype=(torch.long, None)).evaluate(frame, features="ids",
                                                              label="label")



def test_a_null_in_a_dataframe_fails_fit_once_naming_the_column(spark):
    """Decoded inside the barrier stage (as many partitions as workers), bad data is the
    task's own error: one attempt, the cause first (Spark would re-run the stage 4 times)."""
    from paraloom.spark import SharedTrainingMaster, SparkTrainingError

    x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    frame = spark.createDataFrame(
        [(r.tolist(), None if i == 5 else i % 3) for i, r in enumerate(x)],
        "features array<float>, label int").repartition(2)
    for master in (SharedTrainingMaster(8, workers=2),
                   ParameterAveragingTrainingMaster(8, workers=2)):
        linear = nn.Linear(4, 3)
        net = SparkModel(spark, linear, master, loss_fn=nn.CrossEntropyLoss(),
                         optimizer=torch.optim.SGD(linear.parameters(), lr=0.1))
        with pytest.raises(SparkTrainingError, match=r"failed: ValueError: column 'label' has 1 "
                                                     r"null value\(s\); drop or fill") as e:
            net.fit(frame)
        assert e.value.attempts == 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_hung_task_of_a_one_stage_averaging_fit_fails_it_after_timeout(spark):
    """The averaging master's ``timeout`` bounds each all-reduce (it was a fixed 300 s): a
    task that hangs fails its peer's wait, and the fit, after Spark's stage attempts."""
    import time

    from paraloom.spark import SparkTrainingError

    x = np.random.default_rng(0).normal(size=(64, 2)).astype(np.float32)
    x[-1, 0] = 1000.0
    frame = spark.createDataFrame([(r.tolist(), i % 2) for i, r in enumerate(x)],
                                  "features array<float>, label long").repartition(2)
    model = h.StuckOnMarkedRows()
    net = SparkModel(spark, model, ParameterAveragingTrainingMaster(8, workers=2, timeout=5),
                     loss_fn=nn.CrossEntropyLoss(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    started = time.monotonic()
    with pytest.raises(SparkTrainingError):
        net.fit(frame)
    assert time.monotonic() - started < 200  # 4 attempts of about 5 s each, not 4 x 300 s
    with pytest.raises(ValueError, match="timeout"):
        ParameterAveragingTrainingMaster(8, workers=2, timeout=0)


def test_fit_on_a_label_outside_the_classes_says_what_to_check(spark):
    from paraloom.spark import SparkTrainingError

    frame = spark.createDataFrame([([1.0, 2.0, 3.0], i % 7) for i in range(16)], ["x", "label"])
    linear = nn.Linear(3, 4)  # 4 classes; labels go up to 6
    net = SparkModel(spark, linear, ParameterAveragingTrainingMaster(8, workers=1),
                     loss_fn=nn.CrossEntropyLoss(),
                     optimizer=torch.optim.SGD(linear.parameters(), lr=0.1))
    with pytest.raises(SparkTrainingError, match=r"(?s)out of bounds.*outside the model's 4 "
                                                 r"classes \(0 to 3\)") as caught:
        net.fit(frame, features="x")
    assert "class labels must be 0" not in str(caught.value)  # the fix once, not twice


def test_predict_scores_a_streaming_dataframe(spark, model, digits_test, tmp_path):
    """predict() on Structured Streaming data is the same lazy Arrow UDF: it used to fail
    before any query started (telling a DataFrame apart read ``DataFrame.rdd``, which a
    streaming DataFrame refuses)."""
    x = digits_test.tensors[0][:40]
    spark.createDataFrame([(i, row.flatten().tolist()) for i, row in enumerate(x)],
                          "id long, features array<float>").write.parquet(str(tmp_path / "in"))
    stream = spark.readStream.schema("id long, features array<float>").parquet(
        str(tmp_path / "in"))
    scored = spark_model(spark, model, feature_shape=(1, 8, 8)).predict(stream, argmax=True)
    assert scored.isStreaming
    query = scored.writeStream.format("memory").queryName("scored_digits") \
        .trigger(availableNow=True).start()
    assert query.awaitTermination(120)
    got = {r.id: r.prediction for r in spark.sql("select * from scored_digits").collect()}
    with torch.no_grad():
        expected = model(x).argmax(1).tolist()
    assert got == dict(enumerate(expected))


def test_evaluating_no_rows_says_the_data_is_empty_for_either_kind_of_metrics(spark):
    """evaluate_regression said "evaluate() got no rows", naming the other method."""
    frame = spark.createDataFrame([], "features array<float>, label double")
    net = SparkModel(spark, nn.Linear(4, 1), ParameterAveragingTrainingMaster(workers=2),
                     loss_fn=nn.MSELoss())
    for evaluate_ in (net.evaluate, net.evaluate_regression):
        with pytest.raises(ValueError, match=r"^no rows to evaluate: the data is empty"):
            evaluate_(frame)
