"""Many small DataFrame partitions are merged before a fit or an evaluation: each partition is a
Python task that costs Spark 50-100 ms, so 300 rows in 200 partitions took 30 s to fit or
evaluate on two cores (2 s merged). Every row is still trained on and counted."""

from __future__ import annotations

import uuid

import pytest
import torch
from torch import nn

from paraloom.spark import ParameterAveragingTrainingMaster, SharedTrainingMaster, SparkModel
from paraloom.spark.data.plans import compacted

pytestmark = pytest.mark.timeout(300)

ROWS = 120


@pytest.fixture(scope="module")
def frame(spark):
    """120 rows in 40 partitions of three rows each: ``repartition(40)`` of a small table."""
    rows = [([float(i % 7), float(i % 5), 1.0, float(i % 3)], i % 3) for i in range(ROWS)]
    df = spark.createDataFrame(rows, "features array<double>, label long").repartition(40)
    df.cache().count()  # the cache filled: what is measured is the fit's or evaluation's own
    return df


def _tasks(spark, run) -> tuple[object, list[int]]:
    """What ``run()`` returns, and the tasks run by each stage of the jobs it started (in any
    thread or job group): Spark numbers stages in order, so they lie between two marker jobs'."""
    sc = spark.sparkContext
    tracker = sc.statusTracker()

    def marker() -> int:
        group = uuid.uuid4().hex
        sc.setJobGroup(group, "marker")
        try:
            sc.parallelize([0], 1).count()
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)
        (job,) = tracker.getJobIdsForGroup(group)
        (stage,) = tracker.getJobInfo(job).stageIds
        return stage

    first = marker()
    result = run()
    infos = [tracker.getStageInfo(s) for s in range(first + 1, marker())]
    return result, [i.numCompletedTasks for i in infos if i is not None]


def _net(spark, master):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return SparkModel(spark, model, master, loss_fn=nn.CrossEntropyLoss(),
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_small_partitions_merge_into_twice_the_cores(frame):
    assert frame.rdd.getNumPartitions() == 40
    merged = compacted(frame)
    assert merged.rdd.getNumPartitions() == 4  # local[2]: twice the two cores
    assert sorted(merged.collect()) == sorted(frame.collect())  # nothing lost or repeated


def test_merging_runs_no_job_so_a_shuffle_before_it_runs_once(spark, frame):
    """The partition count comes from the plan: df.rdd.getNumPartitions() of a shuffled frame
    runs the shuffle (adaptive execution), and the fit or evaluation then ran it again."""
    shuffled = frame.select("features", "label").repartition(40)  # not cached
    merged, tasks = _tasks(spark, lambda: compacted(shuffled))
    assert tasks == []
    assert merged.rdd.getNumPartitions() == 4


def test_an_rdd_a_frame_of_unknown_size_or_one_of_large_partitions_is_kept(spark, frame):
    rdd = frame.rdd
    assert compacted(rdd) is rdd
    from_rdd = spark.createDataFrame(rdd, frame.schema)  # Spark cannot estimate its size
    assert from_rdd.rdd.getNumPartitions() == 40
    assert compacted(from_rdd) is from_rdd
    assert compacted(frame, partition_bytes=1) is frame  # each byte a partition: 40 is fewer
    few = frame.repartition(4)
    assert compacted(few) is few  # not more than twice the cores


def test_evaluate_on_many_partitions_runs_few_tasks_and_counts_every_row(spark, frame):
    net = _net(spark, ParameterAveragingTrainingMaster(batch_size_per_worker=8, workers=2))
    merged, tasks = _tasks(spark, lambda: net.evaluate(frame))
    assert tasks and max(tasks) <= 4, tasks
    assert int(merged.confusion.sum()) == ROWS
    whole = net.evaluate(frame.repartition(2))  # the same rows in two partitions
    assert torch.equal(torch.as_tensor(merged.confusion), torch.as_tensor(whole.confusion))
    _, tasks = _tasks(spark, lambda: net.evaluate(frame, metrics=("classification", "roc")))
    assert tasks and max(tasks) <= 4, tasks


@pytest.mark.parametrize("master", [ParameterAveragingTrainingMaster, SharedTrainingMaster])
def test_fit_on_many_partitions_reads_them_in_few_tasks_and_trains_every_row(spark, frame,
                                                                             master):
    net = _net(spark, master(batch_size_per_worker=8, workers=2))
    summary, tasks = _tasks(spark, lambda: net.fit(frame, epochs=1))
    assert summary["samples"] == ROWS
    assert sum(summary["rows_per_worker"]) == ROWS and min(summary["rows_per_worker"]) >= 56
    assert tasks and max(tasks) <= 4, tasks


def test_repartition_never_names_the_frames_own_partitions(spark, frame):
    net = _net(spark, ParameterAveragingTrainingMaster(batch_size_per_worker=8, workers=2,
                                                       repartition="never"))
    with pytest.raises(ValueError, match="the data has 40 partitions and workers=2"):
        net.fit(frame, epochs=1)

