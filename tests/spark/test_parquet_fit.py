"""fit_paths on local[2]: each task streams its share of the Parquet row groups into training,
both masters in one barrier stage; a killed task's stage re-runs and resumes exactly."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import spark_helpers as h
import torch
from spark_helpers import accuracy
from torch import nn

from paraloom.datasets import digits
from paraloom.models import LeNet
from paraloom.spark import (
    ParameterAveragingTrainingMaster,
    SharedTrainingMaster,
    SparkModel,
)
from paraloom.spark.runtime.state import state_digest

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def digits_parquet(tmp_path_factory) -> str:
    """The digits' 1,438 training rows in three files of 100-row row groups."""
    path = tmp_path_factory.mktemp("digits") / "train"
    path.mkdir()
    x, y = digits("train").tensors
    flat = x.reshape(len(x), -1).numpy()
    for i, rows in enumerate(np.array_split(np.arange(len(y)), 3)):
        offsets = pa.array(np.arange(0, 64 * len(rows) + 1, 64, dtype=np.int32))
        table = pa.table({"features": pa.ListArray.from_arrays(
            offsets, pa.array(flat[rows].ravel())), "label": pa.array(y[rows].numpy())})
        pq.write_table(table, path / f"part-{i}.parquet", row_group_size=100)
    return str(path)


def _net(spark, master, **options) -> SparkModel:
    torch.manual_seed(0)
    model = LeNet(image_size=8)
    options = {"loss_fn": nn.CrossEntropyLoss(), "feature_shape": (1, 8, 8), **options}
    return SparkModel(spark, model, master,
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                      **options)


@pytest.mark.parametrize("name", ["averaging", "shared"])
def test_both_masters_learn_from_parquet_in_one_stage(spark, digits_parquet, digits_test, name):
    master = (ParameterAveragingTrainingMaster(32, 5, 2) if name == "averaging"
              else SharedTrainingMaster(32, 2, timeout=60))
    net = _net(spark, master)
    summary = net.fit_paths(digits_parquet, epochs=4)
    assert summary["stages"] == "one" and summary["stage_attempts"] == 1
    assert summary["rows_per_worker"] == [719, 719]  # the rows split to one row
    assert summary["samples"] == 4 * 1438
    assert summary["seconds_to_first_step"] > 0
    assert accuracy(net.model, digits_test) >= 0.9
    if name == "averaging":
        assert summary["rounds"] == 4 * 23 // 5 + 1  # every 5 steps, and once at the end
        assert summary["bytes_sent_per_step_per_worker"] > 0


def test_a_killed_task_reruns_and_resumes_to_the_same_parameters(spark, digits_parquet,
                                                                 tmp_path):
    master = ParameterAveragingTrainingMaster(32, 4, 2, checkpoint_dir=str(tmp_path / "ck"))
    clean = _net(spark, master)
    clean.fit_paths(digits_parquet, epochs=2, seed=3)
    marker = tmp_path / "killed"
    crashed = _net(spark, master, loss_fn=h.Crash(at=30, marker=str(marker)))
    summary = crashed.fit_paths(digits_parquet, epochs=2, seed=3)
    assert marker.exists()  # rank 1's Python worker really died in the first attempt
    assert summary["stage_attempts"] == 2
    assert summary["samples"] < 2 * 1438  # the re-run resumed; it did not start over
    # The same rows in the same order, from the checkpoint taken at an averaging:
    assert state_digest(crashed.model.state_dict()) == state_digest(clean.model.state_dict())


def test_bad_input_fails_on_the_driver_before_any_job(spark, digits_parquet, tmp_path,
                                                      monkeypatch):
    import paraloom.spark.training.averaging_stage as stage

    def no_stage(*args, **kwargs):
        raise AssertionError("a training stage started")

    monkeypatch.setattr(stage, "run_barrier_stage", no_stage)
    net = _net(spark, ParameterAveragingTrainingMaster(32, 5, 2))
    before = state_digest(net.model.state_dict())
    with pytest.raises(ValueError, match=r"column 'pixels' is not in .*part-0\.parquet"):
        net.fit_paths(digits_parquet, features="pixels")
    with pytest.raises(ValueError, match="no Parquet files"):
        net.fit_paths(str(tmp_path))
    with pytest.raises(ValueError, match=r"reshape|shape"):
        _net(spark, ParameterAveragingTrainingMaster(32, 5, 2),
             feature_shape=(1, 7, 7)).fit_paths(digits_parquet)
    assert state_digest(net.model.state_dict()) == before


def test_precision_runs_every_task_in_bf16_autocast(spark, digits_parquet, digits_test):
    with pytest.raises(ValueError, match="precision='half' is not known"):
        _net(spark, ParameterAveragingTrainingMaster(32, 5, 2), precision="half")
    net = _net(spark, ParameterAveragingTrainingMaster(32, 5, 2), precision="bf16-mixed")
    summary = net.fit_paths(digits_parquet, epochs=4)
    assert summary["samples"] == 4 * 1438
    assert next(net.model.parameters()).dtype == torch.float32  # mixed: fp32 weights
    assert accuracy(net.model, digits_test) >= 0.85


def test_prebatched_parquet_rows_train_through_a_dataframe(spark, tmp_path):
    """Rows that each hold a minibatch (DL4J's examplesPerDataSetObject) are read as a
    DataFrame, their shapes checked where they are read, not on one sample row."""
    x, y = digits("train").tensors
    flat = x.reshape(len(x), -1).numpy()
    cuts = list(range(0, len(y), 100)) + [len(y)]
    rows = [(flat[a:b], y[a:b].numpy()) for a, b in zip(cuts, cuts[1:], strict=False)]
    features = pa.array([[list(map(float, r)) for r in f] for f, _ in rows],
                        pa.list_(pa.list_(pa.float32())))
    labels = pa.array([lab.tolist() for _, lab in rows], pa.list_(pa.int64()))
    path = tmp_path / "batches"
    path.mkdir()
    pq.write_table(pa.table({"features": features, "label": labels}), path / "part-0.parquet")
    net = _net(spark, ParameterAveragingTrainingMaster(32, 5, 2))
    summary = net.fit_paths(str(path), epochs=1, prebatched=True)
    assert summary["samples"] == 1438


def test_which_dataframes_are_parquet_files_as_they_are(spark, digits_parquet, tmp_path):
    from pyspark.sql import functions as F

    from paraloom.spark.data.plans import parquet_files

    df = spark.read.parquet(digits_parquet)
    names = ["features", "label"]
    for kept in (df, df.select("features", "label"), df.alias("d"), df.hint("broadcast")):
        files = parquet_files(kept, names)
        assert files is not None and sorted(f.rsplit("/", 1)[1] for f in files) == \
            ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    for changed in (df.where("label > 0"), df.withColumnRenamed("label", "y"), df.limit(5),
                    df.withColumn("label", F.col("label") + 1), df.sample(0.5, seed=1),
                    spark.createDataFrame([([0.0] * 64, 1)], names)):
        assert parquet_files(changed, ["features"]) is None
    assert parquet_files(df, ["features", "nosuch"]) is None
    # a partition directory's column is not in the files: only the files' own columns qualify
    df.write.partitionBy("label").parquet(str(tmp_path / "by-label"))
    by_label = spark.read.parquet(str(tmp_path / "by-label"))
    assert parquet_files(by_label, names) is None
    assert parquet_files(by_label, ["features"])


def test_a_dataframe_read_from_parquet_trains_as_fit_paths_on_its_files(spark, digits_parquet):
    master = ParameterAveragingTrainingMaster(32, 5, 2)
    paths = _net(spark, master)
    paths.fit_paths(digits_parquet, epochs=2, seed=1)
    frame = _net(spark, master)
    df = spark.read.parquet(digits_parquet).select("features", "label").cache()
    summary = frame.fit(df, epochs=2, seed=1)
    assert summary["rows_per_worker"] == [719, 719]  # the files' shares, not partitions
    assert state_digest(frame.model.state_dict()) == state_digest(paths.model.state_dict())
    df.unpersist()
    # a filtered DataFrame's rows are not the files': its partitions go through Spark
    filtered = _net(spark, master)
    summary = filtered.fit(spark.read.parquet(digits_parquet).where("label >= 0"), epochs=2,
                           seed=1)
    assert summary["samples"] == 2 * 1438 and summary["rows_per_worker"] != [719, 719]


def test_files_of_unequal_sizes_are_shared_equally_where_the_master_reads_a_dataframe(
        spark, tmp_path):
    """DiLoCo's per-round master reads fit_paths through a DataFrame, whose partitions are
    Spark's bins of the files: two bins were kept as they were, [650, 50] of 700 rows."""
    g = np.random.default_rng(0)
    x = g.normal(size=(700, 4)).astype(np.float32)
    start = 0
    for i, size in enumerate([500, 7, 150, 43]):
        pq.write_table(pa.table({"features": pa.array(x[start:start + size].tolist(),
                                                      type=pa.list_(pa.float32())),
                                 "label": pa.array((x[start:start + size, 0] > 0).astype(
                                     np.int64))}), tmp_path / f"part-{i}.parquet",
                       row_group_size=64)
        start += size
    model = nn.Linear(4, 2)
    master = ParameterAveragingTrainingMaster(16, workers=2, encoding="topk")
    summary = SparkModel(spark, model, master, loss_fn=nn.CrossEntropyLoss(),
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)).fit_paths(
        str(tmp_path), epochs=1)
    assert summary["stages"] == "per_round"
    assert sum(summary["rows_per_worker"]) == 700
    assert max(summary["rows_per_worker"]) - min(summary["rows_per_worker"]) <= 4


def test_files_whose_column_names_differ_in_case_train_through_spark(spark, tmp_path):
    """Spark reads a folder whose files name a column "features" and "Features" (ignoring
    case, its default); the files' fast path looked them up exactly and refused the second."""
    g = np.random.default_rng(0)
    x = g.normal(size=(64, 4)).astype(np.float32)
    for i, (features, label) in enumerate([("features", "label"), ("Features", "Label")]):
        part = x[32 * i:32 * (i + 1)]
        pq.write_table(pa.table({features: pa.array(part.tolist(), type=pa.list_(pa.float32())),
                                 label: pa.array((part[:, 0] > 0).astype(np.int64))}),
                       tmp_path / f"part-{i}.parquet")
    df = spark.read.parquet(str(tmp_path))
    assert df.columns == ["features", "label"] and df.count() == 64
    model = nn.Linear(4, 2)
    summary = SparkModel(spark, model, ParameterAveragingTrainingMaster(16, workers=2),
                         loss_fn=nn.CrossEntropyLoss(),
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)).fit(df)
    assert summary["samples"] == 64
