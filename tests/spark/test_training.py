"""Both masters on local[2] with real data: accuracy, identical replicas, bytes, stats, faults."""

from __future__ import annotations

import json
import re
import time

import pytest
import spark_helpers as h
import torch
from spark_helpers import accuracy, read_page
from torch import nn

from paraloom.models import LeNet
from paraloom.spark import (
    ParameterAveragingTrainingMaster,
    SharedTrainingMaster,
    SparkModel,
    SparkTrainingError,
)
from paraloom.spark.runtime.state import state_digest

pytestmark = pytest.mark.timeout(300)


def lenet(lr: float = 0.05) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = LeNet(image_size=8)
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def shared_master(**options) -> SharedTrainingMaster:
    # The default recipe: the top ~1/320 of the residual per message, momentum masking.
    options = {"batch_size_per_worker": 32, "workers": 2, "timeout": 60,
               "rendezvous_timeout": 120, **options}
    return SharedTrainingMaster(**options)


@pytest.fixture(scope="module")
def shared_fit(spark, sc):
    """One shared-master fit on partitions of 900 and 538 rows, with stats, at the dense
    recipe's lr 0.1 that the default sharing recipe is made for."""
    model, opt = lenet(lr=0.1)
    before = state_digest(model.state_dict())
    net = SparkModel(spark, model, shared_master(repartition="never"),
                     loss_fn=nn.CrossEntropyLoss(), optimizer=opt)
    summary = net.fit(h.unequal_rdd(sc, "train", 900), epochs=10, collect_stats=True)
    return net, summary, before


def test_shared_master_learns_digits_with_identical_replicas(shared_fit, digits_test):
    net, summary, before = shared_fit
    assert accuracy(net.model, digits_test) >= 0.95
    assert summary["rows_per_worker"] == [900, 538]  # unequal partitions did not hang
    assert summary["steps_per_worker"] == [290, 170]  # 29 vs 17 minibatches per epoch
    digests = summary["replica_digests"]
    assert len(digests) == 2 and digests[0] == digests[1] != before
    assert digests[0] == state_digest(net.model.state_dict())  # the driver holds rank 0's
    assert summary["stage_attempts"] == 1 and summary["resumed_from_step"] is None


def test_shared_master_sends_under_one_percent_of_dense(shared_fit):
    _, summary, _ = shared_fit
    dense = summary["dense_bytes_per_step"]
    assert dense == pytest.approx(4 * sum(p.numel() for p in LeNet(image_size=8).parameters()))
    for sent in summary["bytes_sent_per_step"]:
        assert 0 < sent <= 0.01 * dense


def test_stats_page_has_a_timeline_per_worker(shared_fit, tmp_path):
    net, summary, _ = shared_fit
    stats = net.training_stats()
    text, page = read_page(stats.export_html(tmp_path / "stats.html"))
    assert {"0", "1"} <= set(page.timelines)
    for rank in ("0", "1"):
        assert page.timelines[rank] >= 29 * 10  # bars for every round (at least one phase each)
    for phase in ("data", "compute", "encode", "communicate", "apply", "wait"):
        assert phase in text
    assert "script" not in page.tags and page.urls == [] and "http" not in text
    totals = stats.phase_totals()
    assert totals[1]["wait"] > 0 and totals[0]["wait"] == 0  # the short partition idled
    assert totals[0]["encode"] > 0 and totals[0]["communicate"] > 0
    saved = json.loads(stats.export_json(tmp_path / "stats.json").read_text())
    assert [len(w["rounds"]["start"]) for w in saved["workers"]] == [290, 290]


def test_averaging_master_learns_digits(spark, sc, digits_test):
    model, opt = lenet()
    master = ParameterAveragingTrainingMaster(batch_size_per_worker=32, averaging_frequency=5,
                                              workers=2)
    net = SparkModel(spark, model, master, loss_fn=nn.CrossEntropyLoss(), optimizer=opt)
    summary = net.fit(h.rdd(sc, "train"), epochs=5)
    assert accuracy(model, digits_test) >= 0.95
    assert summary["rounds"] == 5 * 5  # 23 minibatches per worker and epoch, 5 per round
    assert summary["samples"] == 5 * 1438
    assert opt.state[next(iter(model.parameters()))]["momentum_buffer"].abs().sum() > 0


def test_killed_task_is_retried_and_resumes_from_checkpoint(spark, sc, tmp_path):
    model, opt = lenet()
    marker = tmp_path / "killed"
    net = SparkModel(spark, model, shared_master(checkpoint_every=10),
                     loss_fn=h.Crash(at=28, marker=str(marker)), optimizer=opt)
    summary = net.fit(h.rdd(sc, "train"), epochs=2)
    assert marker.exists()  # rank 1 really died on the first attempt
    assert summary["stage_attempts"] == 2
    assert summary["resumed_from_step"] == 23  # the end-of-epoch-0 checkpoint
    assert summary["steps_per_worker"] == [23, 23]  # only epoch 1 ran again
    assert summary["replicas_identical"]


def test_task_killed_in_every_attempt_fails_clearly(spark, sc):
    model, opt = lenet()
    net = SparkModel(spark, model, shared_master(), loss_fn=h.Crash(at=3),
                     optimizer=opt)
    before = state_digest(model.state_dict())
    start = time.monotonic()
    with pytest.raises(SparkTrainingError, match="maximum allowable number of times") as info:
        net.fit(h.rdd(sc, "train"), epochs=1)
    assert info.value.attempts == 2
    assert "exited unexpectedly" in str(info.value) or "crashed" in str(info.value)
    assert state_digest(model.state_dict()) == before  # the user's model was not touched
    assert time.monotonic() - start < 120


def test_python_error_fails_fast_with_the_cause(spark, sc):
    model, opt = lenet()
    net = SparkModel(spark, model, shared_master(), loss_fn=h.FailAt(at=3), optimizer=opt)
    expected = r"worker 1 failed: .*ValueError: injected"
    with pytest.raises(SparkTrainingError, match=expected) as info:
        net.fit(h.rdd(sc, "train"), epochs=1)
    assert info.value.worker == 1 and info.value.attempts == 1  # no pointless retry
    # The user's frame is in the remote traceback. Its file name is spark_helpers.py, or
    # "<dynamic-code>" where cloudpickle (3.1.3 on) sent the class by value.
    remote = info.value.remote_traceback or ""
    assert re.search(r'File "[^"]*(spark_helpers\.py|<dynamic-code>)", line \d+, in forward',
                     remote), remote
    assert "ValueError: injected failure on call 3" in remote


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def test_averaging_carries_adams_state_across_rounds(spark, sc, digits_test):
    # Adam's state came back from safetensors in hash order, which differs between Python
    # workers: the second round failed with "optimizer layouts that differ". (SGD's momentum
    # is checked above; every optimizer's canonical layout in test_units.)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    master = ParameterAveragingTrainingMaster(batch_size_per_worker=32, averaging_frequency=25,
                                              workers=2)
    net = SparkModel(spark, model, master, loss_fn=nn.CrossEntropyLoss(), optimizer=opt)
    summary = net.fit(h.rdd(sc, "train"), epochs=2)
    assert summary["rounds"] == 2  # 23 minibatches per worker and epoch: one round each
    assert accuracy(model, digits_test) >= 0.85
    state = opt.state[next(iter(model.parameters()))]
    assert state["exp_avg_sq"].abs().sum() > 0
    assert float(state["step"]) == 46  # both replicas took 23 steps per round


@pytest.mark.parametrize("master", ["averaging", "shared"])
def test_settings_changed_before_a_fit_apply_without_optimizer_state(spark, sc, master):
    """Plain SGD keeps no state: the learning rate must still travel (a scheduler stepped
    between fits, or a change after SparkModel())."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    chosen = shared_master() if master == "shared" else \
        ParameterAveragingTrainingMaster(batch_size_per_worker=32, workers=2)
    net = SparkModel(spark, model, chosen, loss_fn=nn.CrossEntropyLoss(), optimizer=opt)
    opt.param_groups[0]["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    net.fit(h.rdd(sc, "train"), epochs=1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.param_groups[0]["lr"] = 0.1
    net.fit(h.rdd(sc, "train"), epochs=1)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("master", ["averaging", "shared"])
def test_gradient_clipping_bounds_every_step(spark, sc, master):
    """SGD at lr 1 with each step's gradient norm clipped to 1e-3: no task's step moves the
    parameters further than that, so neither can their average or their shared sum."""
    chosen = shared_master() if master == "shared" else \
        ParameterAveragingTrainingMaster(batch_size_per_worker=32, workers=2)
    moved = {}
    for clip in (1e-3, None):
        model = _mlp()
        before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
        net = SparkModel(spark, model, chosen, loss_fn=nn.CrossEntropyLoss(),
                         optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                         gradient_clip_val=clip)
        net.fit(h.rdd(sc, "train"), epochs=1)
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        moved[clip] = float((after - before).norm())
    steps = -(-1438 // 32)  # a worker's batches in the epoch, at most (partitions may differ)
    assert 0 < moved[1e-3] <= steps * 1e-3 * (1 + 1e-4)
    assert moved[None] > 10 * steps * 1e-3


def test_the_shared_master_returns_every_update_it_trained(spark):
    """The residuals end with the stage's tasks: they are applied before the model returns (it
    came back at 0.65 accuracy and a loss of 0.665 where the workers' last epoch read 0.13)."""
    import numpy as np
    import pandas as pd

    items = np.random.default_rng(2).integers(0, 50, size=512)
    df = spark.createDataFrame(pd.DataFrame({"item": items, "label": (items % 2 == 0)
                                             .astype(np.int64)}))
    model = h.Items()
    net = SparkModel(spark, model, shared_master(), loss_fn=nn.CrossEntropyLoss(),
                     optimizer=torch.optim.Adam(model.parameters(), lr=0.05),
                     feature_dtype=torch.long)
    summary = net.fit(df, epochs=3, features="item")
    evaluation = net.evaluate(df, features="item")
    assert evaluation.accuracy == 1.0
    assert evaluation.loss_sum / evaluation.count < summary["epoch_losses"][-1]
    digests = summary["replica_digests"]
    assert digests[0] == digests[1] == state_digest(net.model.state_dict())


@pytest.mark.parametrize("master", ["averaging", "shared"])
def test_drop_last_lets_batchnorm_train_on_shares_that_leave_one_row(spark, sc, master):
    """65 rows on 2 workers, 32 a minibatch: one share ends on a minibatch of one row."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(65, 4, generator=g)
    rows = sc.parallelize([(x[i].numpy(), int(x[i, 0] > 0)) for i in range(65)], 2)

    def fit(**options):
        model = h.Normed()
        make = shared_master if master == "shared" else ParameterAveragingTrainingMaster
        extra = {} if master == "shared" else {"batch_size_per_worker": 32, "workers": 2}
        net = SparkModel(spark, model, make(repartition="never", **extra, **options),
                         loss_fn=nn.CrossEntropyLoss(),
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        return net.fit(rows, epochs=2)

    with pytest.raises(SparkTrainingError, match="drop_last=True on the Spark master"):
        fit()
    summary = fit(drop_last=True)
    assert summary["samples"] == 2 * 64  # each epoch: two full minibatches, the row left out


def _line_data(n: int = 200):
    import numpy as np

    g = np.random.default_rng(0)
    x = g.normal(size=(n, 4)).astype(np.float32)
    return x, (x @ np.array([1.5, -2.0, 0.5, 3.0], np.float32) + 0.7).astype(np.float32)


def _full_batch_gd(x, y, lr: float, epochs: int) -> float:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)[:, None]
    for _ in range(epochs):
        opt.zero_grad()
        nn.functional.mse_loss(model(xt), yt).backward()
        opt.step()
    return nn.functional.mse_loss(model(xt), yt).item()


def test_one_stage_averaging_leaves_a_task_without_rows_out(spark):
    """Two partitions of 200 and 0 rows, kept as they are: the plain mean counted the empty
    task's stale weights at every averaging, training at exactly half the learning rate (the
    per-round path weighted by examples, as documented)."""
    x, y = _line_data()
    pairs = spark.sparkContext.parallelize(
        [(0, (r.tolist(), float(v))) for r, v in zip(x, y, strict=True)], 1) \
        .partitionBy(2, lambda k: 0).values()
    frame = spark.createDataFrame(pairs, "features array<float>, label double")
    assert frame.rdd.glom().map(len).collect() == [200, 0]
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    master = ParameterAveragingTrainingMaster(200, averaging_frequency=1, workers=2)
    summary = SparkModel(spark, model, master, loss_fn=nn.MSELoss(),
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)).fit(frame, 10)
    assert summary["rows_per_worker"] == [200, 0] and summary["stages"] == "one"
    with torch.no_grad():
        mse = nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)[:, None])
    assert mse.item() == pytest.approx(_full_batch_gd(x, y, 0.1, 10), rel=1e-4)
    assert _full_batch_gd(x, y, 0.05, 10) > 5 * mse.item()  # what half the rate reaches


@pytest.mark.parametrize("rows, parts", [(200, 1), (300, 5), (2000, 3)])
def test_a_dataframe_of_other_partitions_is_spread_over_the_workers_to_one_row(
        spark, rows, parts):
    """Whole chunks went round robin: a partition under a chunk's rows landed on one worker
    ([200, 0] for one partition of 200, [180, 120] for five of 60)."""
    x, y = _line_data(rows)
    frame = spark.createDataFrame([(r.tolist(), float(v)) for r, v in zip(x, y, strict=True)],
                                  "features array<float>, label double").repartition(parts)
    model = nn.Linear(4, 1)
    summary = SparkModel(spark, model, ParameterAveragingTrainingMaster(16, workers=2),
                         loss_fn=nn.MSELoss(),
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.01)).fit(frame)
    shares = summary["rows_per_worker"]
    assert sum(shares) == rows and max(shares) - min(shares) <= parts  # one row a partition


def test_more_partitions_than_rows_are_spread_over_every_worker(spark):
    """sc.parallelize(rows, 2 * len(rows)) fills every other slice: row 0 of partition i went
    to worker i % 2, so every row to worker 1 ([0, 40]), and worker 0 trained on nothing."""
    x, y = _line_data(40)
    rows = [(r.tolist(), float(v)) for r, v in zip(x, y, strict=True)]
    sliced = spark.sparkContext.parallelize(rows, 80)
    assert sliced.glom().map(len).collect()[:4] == [0, 1, 0, 1]
    frame = spark.createDataFrame(sliced, "features array<float>, label double")
    for data in (frame, sliced):
        model = nn.Linear(4, 1)
        summary = SparkModel(spark, model, ParameterAveragingTrainingMaster(8, workers=2),
                             loss_fn=nn.MSELoss(),
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.01)).fit(data)
        shares = summary["rows_per_worker"]
        assert sum(shares) == 40 and min(shares) >= 16, shares


def test_the_first_worker_of_each_partition_spreads_evenly_for_any_pattern():
    from paraloom.spark.data.partitions import first_worker

    for workers in (2, 3, 4, 8):
        for indices in (range(80), range(1, 160, 2), range(0, 80 * workers, workers),
                        range(0, 800, 10)):
            counts = [0] * workers
            for i in indices:
                counts[first_worker(i, workers)] += 1
            share = len(indices) / workers  # index % workers gave some 0, others 2 shares
            assert share * 0.6 <= min(counts) <= max(counts) <= share * 1.4, counts
    assert first_worker(0, 3) == 0 and all(0 <= first_worker(i, 5) < 5 for i in range(99))

def test_a_coalesced_dataframe_trains_and_never_keeps_its_partitions(spark):
    """df.coalesce(workers) has the partitions to keep, but Spark runs no barrier stage over a
    coalesce (SPARK-24820): it is shuffled instead. It failed with a Java stack frame."""
    frame = spark.createDataFrame([([float(i), 1.0, 2.0, 3.0], i % 3) for i in range(40)],
                                  "features array<double>, label long").repartition(4)

    def fit(data, **options):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        master = ParameterAveragingTrainingMaster(batch_size_per_worker=8, workers=2,
                                                  **options)
        net = SparkModel(spark, model, master, loss_fn=nn.CrossEntropyLoss(),
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        return net.fit(data, epochs=1)

    assert fit(frame.coalesce(2))["samples"] == 40
    assert fit(frame.union(frame).coalesce(2))["samples"] == 80
    with pytest.raises(ValueError, match=r"coalesce\(\).*use repartition\(2\)"):
        fit(frame.coalesce(2), repartition="never")



def test_the_shared_master_with_allreduce_finishes_every_fit_on_a_dataframe(spark):
    """AllReduce() (DDP inside each task) hung about half the fits of a small model: the
    Python worker freed the process group as its task ended, deadlocked with gloo's thread
    over the GIL, and the stage never completed (until job_timeout, or forever)."""
    from paraloom.sync import AllReduce

    x, y = _line_data(400)
    frame = spark.createDataFrame([(r.tolist(), int(v > 0)) for r, v in zip(x, y, strict=True)],
                                  "features array<float>, label long").repartition(2)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    net = SparkModel(spark, model, shared_master(batch_size_per_worker=16, job_timeout=30,
                                                 synchronizer=AllReduce()),
                     loss_fn=nn.CrossEntropyLoss(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    for _ in range(6):
        summary = net.fit(frame, epochs=1)
        assert summary["stage_attempts"] == 1
        digests = summary["replica_digests"]
        assert digests[0] == digests[1] == state_digest(net.model.state_dict())
        losses.append(summary["epoch_losses"][0])
    assert losses[-1] < 0.75 * losses[0]  # each fit went on from the last
