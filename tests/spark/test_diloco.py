"""DiLoCo on Spark: ParameterAveragingTrainingMaster with an outer optimizer and an encoding."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import spark_helpers as h
import torch
from spark_helpers import accuracy
from torch import nn

from paraloom.models import LeNet
from paraloom.spark import ParameterAveragingTrainingMaster, SparkModel, TopK
from paraloom.spark.runtime.state import state_digest
from paraloom.spark.training.averaging_task import weighted
from paraloom.spark.training.diloco_task import (
    diloco_sums,
    load_local,
    local_dir,
    remove_local,
    save_local,
)

pytestmark = pytest.mark.timeout(300)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _fit(spark, sc, model: nn.Module, opt: torch.optim.Optimizer, epochs: int,
         **options) -> dict:
    master = ParameterAveragingTrainingMaster(batch_size_per_worker=32, workers=2, **options)
    net = SparkModel(spark, model, master, loss_fn=nn.CrossEntropyLoss(), optimizer=opt)
    return dict(net.fit(h.rdd(sc, "train"), epochs=epochs))


def _leftovers() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("paraloom-diloco-*"))


def test_dense_diloco_with_plain_outer_step_equals_parameter_averaging(spark, sc):
    # SGD at lr 1 on the mean pseudo-gradient is the mean of the trained parameters.
    plain = _mlp()
    _fit(spark, sc, plain, torch.optim.SGD(plain.parameters(), lr=0.1), epochs=1,
         averaging_frequency=5, save_updater=False)
    diloco = _mlp()
    summary = _fit(spark, sc, diloco, torch.optim.SGD(diloco.parameters(), lr=0.1), epochs=1,
                   averaging_frequency=5, save_updater=False, encoding="dense")
    assert summary["rounds"] == 5 and summary["encoding"] == "TopK(density=1.0, values='fp32')"
    for a, b in zip(plain.state_dict().values(), diloco.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    trained = zip(_mlp().parameters(), diloco.parameters(), strict=True)
    assert not any(torch.equal(a, b) for a, b in trained)  # it did train


def test_default_diloco_learns_digits_at_a_fraction_of_the_bytes(spark, sc, digits_test):
    before = _leftovers()
    torch.manual_seed(0)
    model = LeNet(image_size=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    summary = _fit(spark, sc, model, opt, epochs=6, averaging_frequency=12,
                   encoding="topk")
    assert accuracy(model, digits_test) >= 0.9
    assert summary["outer_optimizer"] == "torch.optim.sgd.SGD(lr=1.0)"
    assert summary["rounds"] == 6 * 2  # 23 minibatches per worker and epoch, 12 per round
    params = sum(p.numel() for p in model.parameters())
    # Sent per round: 5% of the entries at 3 bytes (int8 value, 16-bit offset), 4 bytes per
    # block of 65,536 and the scale; LeNet has no buffers.
    blocks = -(-params // 65536)
    rounds_bytes = summary["rounds"] * 2 * (3 * -(-params // 20) + 4 * blocks + 4)
    assert summary["bytes_sent_per_step_per_worker"] == rounds_bytes / summary["steps"]
    # 1/300 of a dense all-reduce at 12 steps per round (1/1,200 at the default 50).
    assert summary["bytes_sent_per_step_per_worker"] * 300 < summary["dense_bytes_per_step"]
    assert opt.state_dict()["state"] == {}  # the inner optimizers' states stayed on the tasks
    assert _leftovers() <= before  # every partition's files were deleted at the end


def test_executors_apply_each_round_as_a_sparse_update_with_the_same_result(spark, sc,
                                                                           monkeypatch):
    from paraloom.spark.training import diloco

    def fit() -> tuple[nn.Module, dict]:
        torch.manual_seed(0)
        model = LeNet(image_size=8)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, _fit(spark, sc, model, opt, epochs=2, averaging_frequency=6,
                           encoding="topk")

    sparse_model, sparse = fit()
    monkeypatch.setattr(diloco, "SPARSE_UPDATE_FRACTION", 0.0)  # every round: the full state
    full_model, full = fit()
    assert state_digest(sparse_model.state_dict()) == state_digest(full_model.state_dict())
    state_bytes = sum(p.numel() * 4 for p in full_model.parameters())
    # Per task and round (2 tasks).
    received = {name: s["bytes_received_per_step_per_worker"] * s["steps"] / s["rounds"] / 2
                for name, s in (("sparse", sparse), ("full", full))}
    assert received["full"] > state_bytes  # the whole state (and its header) every round
    # After the first round, each task reads the changed entries only: at most the two
    # tasks' 5% each, 8 bytes apiece.
    rounds = sparse["rounds"]
    assert received["sparse"] * rounds < received["full"] + (rounds - 1) * state_bytes * 0.2


def test_nesterov_outer_step_by_name(spark, sc):
    model = _mlp()
    summary = _fit(spark, sc, model, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1,
                   averaging_frequency=10, outer_optimizer="nesterov")
    assert summary["outer_optimizer"] == \
        "torch.optim.sgd.SGD(lr=0.7, momentum=0.9, nesterov=True)"
    assert summary["encoding"] == "TopK(density=0.05, values='int8')"
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_task_sends_its_top_entries_and_keeps_the_rest(tmp_path):
    torch.manual_seed(1)
    anchor = {"w": torch.randn(200), "b": torch.randn(4), "running": torch.ones(3)}
    trained = {"w": anchor["w"] - torch.randn(200), "b": anchor["b"].clone(),
               "running": torch.full((3,), 3.0)}
    sums, residual = diloco_sums(anchor, trained, ["w", "b"], None, TopK(0.05, "fp32"))
    assert sums.delta is not None and sums.delta.values.size == 11  # ceil(5% of 204)
    assert sums.model is not None and sums.model.tolist() == [3.0, 3.0, 3.0]  # the buffer
    dense = weighted(sums.__class__(1, model=sums.model, layout=sums.layout,
                                    delta=sums.delta)).pseudo
    assert dense is not None and residual is not None
    full = torch.cat([anchor["w"] - trained["w"], torch.zeros(4)])
    # What was sent plus what was kept is the whole pseudo-gradient.
    torch.testing.assert_close(torch.from_numpy(dense).float() + residual, full)
    assert sums.bytes_sent == sums.delta.nbytes + 12


def test_local_files_are_per_round_so_a_retry_reads_the_same_input():
    fit_id = "abc123"
    remove_local(fit_id)
    save_local(fit_id, 0, 0, {"residual": torch.ones(2)})
    save_local(fit_id, 0, 1, {"residual": torch.full((2,), 2.0)})
    # Round 1 retried: it still reads round 0's output, not its own.
    assert load_local(fit_id, 0, 1)["residual"].tolist() == [1.0, 1.0]
    save_local(fit_id, 0, 2, {"residual": torch.full((2,), 3.0)})
    assert load_local(fit_id, 0, 1) is None  # round 0's file is gone once round 2 wrote
    assert load_local(fit_id, 0, 3)["residual"].tolist() == [3.0, 3.0]
    assert load_local(fit_id, 1, 3) is None and load_local(fit_id, 0, 0) is None
    assert (local_dir(fit_id).stat().st_mode & 0o777) == 0o700
    remove_local(fit_id)
    assert not local_dir(fit_id).exists()
    with pytest.raises(ValueError, match="not a hex string"):
        local_dir("../x")


@pytest.mark.parametrize(("options", "message"), [
    ({"encoding": "zip"}, "encoding='zip'; expected a paraloom.spark.TopK"),
    ({"outer_optimizer": "adam"}, "outer_optimizer='adam'; expected a callable"),
    ({"outer_optimizer": lambda p: list(p)}, "outer_optimizer returned list"),
    ({"encoding": "topk", "averaging_frequency": 0}, "averaging_frequency=0"),
])
def test_bad_diloco_options_fail_at_construction(options, message):
    with pytest.raises(ValueError, match=message):
        ParameterAveragingTrainingMaster(**options)


def test_topk_checks_its_options():
    with pytest.raises(ValueError, match=r"density=0; expected a fraction in \(0, 1\]"):
        TopK(density=0)
    with pytest.raises(ValueError, match="values='int4'"):
        TopK(values="int4")
    master = ParameterAveragingTrainingMaster(encoding=TopK(0.01, "fp16"))
    assert master.averaging_frequency == 50 and master.encoding == TopK(0.01, "fp16")
    assert ParameterAveragingTrainingMaster().averaging_frequency == 5
