"""The CUDA path, run where torch sees a GPU: ``pytest -m cuda tests/test_cuda.py``.

Without CUDA every test here is skipped (and reported as skipped), never passed.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from paraloom import ParallelInference, ParallelWrapper
from paraloom.evaluation import evaluate
from paraloom.models import LeNet

pytestmark = pytest.mark.cuda


def _lenet_wrapper(**kwargs):
    torch.manual_seed(0)
    model = LeNet(image_size=8)
    return model, ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                                  optimizer=torch.optim.SGD(model.parameters(), lr=0.05,
                                                            momentum=0.9),
                                  progress=False, **kwargs)


def _accuracy(model, digits_test) -> float:
    return evaluate(model.cpu(), DataLoader(digits_test, batch_size=256)).accuracy


def test_host_to_device_pins_and_copies_exactly():
    from paraloom.training.replica import host_to_device

    batch = (torch.randn(16, 3), {"y": torch.arange(16)})
    moved = host_to_device(batch, torch.device("cuda", 0))
    assert moved[0].device.type == "cuda" and moved[1]["y"].device.type == "cuda"
    torch.cuda.synchronize()
    assert torch.equal(moved[0].cpu(), batch[0]) and torch.equal(moved[1]["y"].cpu(), batch[1]["y"])


def test_one_worker_trains_on_the_gpu(digits_loader, digits_test):
    model, wrapper = _lenet_wrapper(workers=1, devices="cuda:0")
    with wrapper:
        assert wrapper.device_plan.devices == ("cuda:0",)
        wrapper.fit(digits_loader, epochs=5)
    assert next(model.parameters()).device.type == "cpu"  # the user's model stays where it was
    assert _accuracy(model, digits_test) > 0.9


def test_amp_fp16_with_a_grad_scaler_per_replica(digits_loader, digits_test):
    from paraloom.training.replica import Replica

    model, wrapper = _lenet_wrapper(workers=1, devices="cuda:0", precision="16-mixed")
    with wrapper:
        wrapper.fit(digits_loader, epochs=5)
        replica = wrapper._pool._runner.replica  # the in-process replica (workers=1)
        assert isinstance(replica, Replica) and replica.scaler is not None
        assert replica.scaler.get_scale() > 0
    assert _accuracy(model, digits_test) > 0.9


def test_two_workers_sharing_one_gpu_train_over_gloo(digits_loader, digits_test):
    model, wrapper = _lenet_wrapper(devices=["cuda:0", "cuda:0"])
    with wrapper:
        assert wrapper.device_plan.backend == "gloo" and wrapper.workers == 2
        stats = wrapper.fit(digits_loader, epochs=5)
    assert stats["samples"] == 5 * len(digits_loader.dataset)
    assert _accuracy(model, digits_test) > 0.9


def test_more_workers_than_gpus_by_default_names_the_fix():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"Use workers={n}"):
        _lenet_wrapper(workers=n + 1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")
def test_nccl_on_two_gpus_keeps_replicas_identical(digits_loader, digits_test):
    for mode in ("averaging", "allreduce", "shared_gradients"):
        model, wrapper = _lenet_wrapper(devices=2, training_mode=mode)
        with wrapper:
            assert wrapper.device_plan.backend == "nccl"
            wrapper.fit(digits_loader, epochs=5)
        assert _accuracy(model, digits_test) > 0.9, mode


def test_inference_on_the_gpu_matches_the_cpu():
    torch.manual_seed(0)
    model = LeNet(image_size=8).eval()
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        expected = model(x)
    with ParallelInference(model, devices="cuda", workers=2) as pool:
        assert all(d.startswith("cuda") for d in pool.stats()["devices"])
        out = pool.output(x)
    assert out.device.type == "cpu"  # answered on the device the request came from
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_bench_training_prints_the_gpu_scaling_table(tmp_path, capsys):
    from paraloom.cli import main

    out = tmp_path / "training.json"
    assert main(["bench", "training", "--device", "cuda", "--samples", "1024", "--epochs", "1",
                 "--modes", "averaging", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "speed-up" in printed and "efficiency" in printed
    result = json.loads((tmp_path / "training_cuda.json").read_text())
    counts = list(range(1, torch.cuda.device_count() + 1))
    assert [r["gpus"] for r in result["scaling"] if r["mode"] == "averaging"] == counts
    assert [r["gpus"] for r in result["scaling"] if r["mode"] == "ddp"] == counts
    assert all(r["ratio_to_ddp"] > 0 for r in result["scaling"])
    assert all(r["samples_per_s"] > 0 for r in result["scaling"])
    print(json.dumps(result["scaling"]), file=sys.stderr)


def test_bf16_training_is_within_a_point_of_fp32(digits_loader, digits_test):
    accuracy = {}
    for precision in ("32-true", "bf16-mixed"):
        model, wrapper = _lenet_wrapper(workers=1, devices="cuda:0", precision=precision)
        with wrapper:
            wrapper.fit(digits_loader, epochs=10)
        accuracy[precision] = _accuracy(model, digits_test)
    print(json.dumps({"accuracy": accuracy}), file=sys.stderr)
    assert accuracy["32-true"] > 0.95
    assert abs(accuracy["bf16-mixed"] - accuracy["32-true"]) <= 0.01


def test_fp16_mixed_and_accumulation_train_two_workers_on_the_gpu(digits_loader, digits_test):
    model, wrapper = _lenet_wrapper(devices=["cuda:0", "cuda:0"], training_mode="allreduce",
                                    precision="16-mixed", accumulate=2)
    with wrapper:
        wrapper.fit(digits_loader, epochs=8)
    assert _accuracy(model, digits_test) > 0.9


def test_a_spark_local_fit_is_placed_on_the_gpu(tmp_path, digits_test):
    pytest.importorskip("pyspark")
    import os
    import shutil

    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Spark needs Java 17 or later")
    from pyspark.sql import SparkSession

    from paraloom.spark import SharedTrainingMaster, SparkModel

    class DeviceRecordingLoss(nn.Module):  # defined here: it travels to the task by value
        """Cross-entropy that writes the device its inputs came on."""

        def __init__(self, path: str) -> None:
            super().__init__()
            self.path = path

        def forward(self, out, target):
            with open(self.path, "w") as f:
                f.write(str(out.device))
            return nn.functional.cross_entropy(out, target)

    os.environ["PYSPARK_PYTHON"] = os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", "127.0.0.1").getOrCreate())
    try:
        torch.manual_seed(0)
        model = LeNet(image_size=8)
        x = torch.stack([digits_test[i][0] for i in range(len(digits_test))])
        y = torch.tensor([int(digits_test[i][1]) for i in range(len(digits_test))])
        rows = [(x[i].reshape(-1).tolist(), int(y[i])) for i in range(len(y))]
        frame = spark.createDataFrame(rows, ["features", "label"]).repartition(1)
        seen = tmp_path / "device.txt"
        net = SparkModel(spark, model, SharedTrainingMaster(32, workers=1),
                         loss_fn=DeviceRecordingLoss(str(seen)),
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                         feature_shape=(1, 8, 8))
        summary = net.fit(frame, epochs=3, features="features", label="label")
    finally:
        spark.stop()
    assert seen.read_text().startswith("cuda")
    assert summary["epoch_losses"][-1] < summary["epoch_losses"][0]
