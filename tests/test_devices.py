"""devices=: one resolution for training, inference, serving and Spark, on faked GPU counts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paraloom.devices import (
    parse_devices,
    replica_devices,
    resolve_devices,
    task_device,
    training_devices,
)


@pytest.fixture
def gpus(monkeypatch):
    """Make torch report ``n`` CUDA devices (nothing is allocated on them)."""

    def fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return fake


def test_auto_is_every_gpu_else_the_cpu(gpus):
    gpus(0)
    assert resolve_devices("auto") == [torch.device("cpu")]
    assert resolve_devices(None) == [torch.device("cpu")]
    gpus(2)
    assert resolve_devices("auto") == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert resolve_devices("cuda") == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert resolve_devices("cpu") == [torch.device("cpu")]


def test_int_count_is_that_many_gpus_or_cpu_replicas(gpus):
    gpus(4)
    assert resolve_devices(2) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    with pytest.raises(ValueError, match="devices=5 GPUs asked for, but this machine has 4"):
        resolve_devices(5)
    gpus(0)
    assert resolve_devices(3) == [torch.device("cpu")] * 3
    with pytest.raises(ValueError, match="expected a count >= 1"):
        resolve_devices(0)


def test_bad_devices_name_the_problem(gpus):
    gpus(1)
    with pytest.raises(ValueError, match=r"'cuda:3' asked for, but this machine has 1 CUDA"):
        resolve_devices(["cuda:0", "cuda:3"])
    with pytest.raises(ValueError, match="not a device"):
        resolve_devices("gpu0")
    with pytest.raises(ValueError, match="paraloom runs on 'cpu' and 'cuda'"):
        resolve_devices("meta")
    with pytest.raises(ValueError, match="non-empty list"):
        resolve_devices([])
    gpus(0)
    with pytest.raises(ValueError, match=r"devices='cuda' but torch sees no CUDA device"):
        resolve_devices("cuda")


def test_training_one_nccl_rank_per_gpu(gpus):
    gpus(2)
    plan = training_devices("auto", None)
    assert plan.devices == ("cuda:0", "cuda:1") and plan.backend == "nccl"
    assert plan.threads == 1
    plan = training_devices(["cuda:1", "cuda:0"], None)
    assert plan.devices == ("cuda:1", "cuda:0") and plan.backend == "nccl"
    assert training_devices("auto", 1).devices == ("cuda:0",)


def test_more_workers_than_gpus_is_an_error_naming_the_fixes(gpus):
    gpus(2)
    with pytest.raises(ValueError) as info:
        training_devices("auto", 4)
    message = str(info.value)
    assert "workers=4 on 2 GPU(s) (cuda:0, cuda:1)" in message
    assert "NCCL refuses" in message and "Use workers=2" in message
    assert "devices=['cuda:0', 'cuda:1', 'cuda:0', 'cuda:1']" in message
    with pytest.raises(ValueError, match="two NCCL ranks on one GPU"):
        training_devices(["cuda:0", "cuda:1"], 3)


def test_a_gpu_listed_once_per_worker_is_shared_over_gloo(gpus):
    gpus(2)
    plan = training_devices(["cuda:0", "cuda:0", "cuda:1", "cuda:1"], None)
    assert plan.devices == ("cuda:0", "cuda:0", "cuda:1", "cuda:1")
    assert plan.backend == "gloo"
    # the suggestion in the error message is accepted as given
    plan = training_devices(["cuda:0", "cuda:1", "cuda:0", "cuda:1"], 4)
    assert plan.backend == "gloo" and plan.workers == 4


def test_training_on_the_cpu(gpus, monkeypatch):
    monkeypatch.setattr("paraloom.devices.cpu_cores", lambda: 8)
    gpus(0)
    plan = training_devices("auto", None)
    assert plan.devices == ("cpu", "cpu") and plan.backend == "gloo" and plan.threads == 4
    assert training_devices("cpu", 1).backend == "none"
    gpus(2)  # devices='cpu' on a GPU machine: every worker on the CPU, any number of them
    plan = training_devices("cpu", 4)
    assert plan.devices == ("cpu",) * 4 and plan.backend == "gloo" and plan.threads == 2
    with pytest.raises(ValueError, match="workers=0; expected an int >= 1"):
        training_devices("cpu", 0)
    # 100,000 processes of torch filled the machine's memory; 4 per core is the most
    assert len(training_devices("cpu", 32).devices) == 32
    with pytest.raises(ValueError, match="workers=33 on 8 CPU cores; expected at most 32"):
        training_devices("cpu", 33)


def test_inference_replicas_may_share_a_gpu(gpus):
    gpus(2)
    assert replica_devices("auto", None) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert [str(d) for d in replica_devices("auto", 3)] == ["cuda:0", "cuda:1", "cuda:0"]
    gpus(0)
    assert replica_devices("auto", None) == [torch.device("cpu")]


def test_spark_task_device(gpus):
    gpus(0)
    assert task_device(1, 2) == ("cpu", "gloo")
    gpus(2)
    assert task_device(1, 2) == ("cuda:1", "nccl")
    assert task_device(0, 4, ["3"]) == ("cuda:1", "nccl")  # Spark's GPU id, modulo visible
    with pytest.raises(ValueError, match="4 training tasks on one host with 2 GPU"):
        task_device(3, 4)
    assert task_device(3, 4, backend="gloo") == ("cuda:1", "gloo")


def test_parse_devices():
    assert parse_devices("auto") == "auto"
    assert parse_devices("2") == 2
    assert parse_devices("cuda:0, cuda:1") == ["cuda:0", "cuda:1"]


def test_wrapper_and_inference_take_devices(gpus):
    from paraloom import ParallelInference, ParallelWrapper

    model = nn.Linear(3, 2)
    gpus(2)
    with pytest.raises(ValueError, match="Use workers=2"):
        ParallelWrapper(model, loss_fn=nn.MSELoss(), optimizer=torch.optim.SGD(
            model.parameters(), lr=0.1), workers=3)
    wrapper = ParallelWrapper(model, loss_fn=nn.MSELoss(), optimizer=torch.optim.SGD(
        model.parameters(), lr=0.1), devices="cpu", workers=3)
    assert wrapper.workers == 3 and wrapper.device_plan.devices == ("cpu",) * 3
    gpus(0)
    with ParallelInference(model, devices=["cpu", "cpu"]) as pool:
        assert pool.workers == 2 and pool.stats()["devices"] == ["cpu", "cpu"]
        assert pool.output(torch.ones(1, 3)).shape == (1, 2)


def test_bench_training_on_cuda_without_a_gpu_says_so(gpus, capsys):
    from paraloom.cli import main

    gpus(0)
    with pytest.raises(SystemExit) as info:
        main(["bench", "training", "--device", "cuda", "--samples", "64"])
    assert info.value.code == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err
