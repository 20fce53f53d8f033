"""Score, performance and checkpoint listeners; Lightning-style precision settings."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn
from training_helpers import accuracy, digest

from paraloom import ParallelWrapper, TrainingCheckpoint
from paraloom.listeners import CheckpointListener, PerformanceListener, ScoreListener
from paraloom.models import MLP, LeNet

pytestmark = pytest.mark.timeout(180)


def _batches(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g))
            for _ in range(n)]


def test_score_performance_and_checkpoint_listeners(tmp_path, caplog):
    model = MLP(in_features=64)
    score = ScoreListener(frequency=2)
    perf = PerformanceListener(frequency=3)
    ckpt = CheckpointListener(tmp_path, every_n_iterations=4, every_n_epochs=1, keep_last=2)
    with caplog.at_level(logging.INFO, logger="paraloom"):
        with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             listeners=[score, perf, ckpt]) as w:
            w.fit(_batches(12), epochs=2)  # 6 rounds per epoch, 12 in all
    assert [i for i, _, _ in score.scores] == [0, 2, 4, 6, 8, 10]
    assert [e for _, e, _ in score.scores] == [0, 0, 0, 1, 1, 1]
    assert sum("loss" in r.message for r in caplog.records) >= 6
    assert [r["iteration"] for r in perf.reports] == [0, 3, 6, 9]
    assert all(r["samples_per_s"] > 0 and r["eta_s"] >= 0 for r in perf.reports)
    assert perf.reports[-1]["eta_s"] < perf.reports[0]["eta_s"]
    # every 4 iterations (after rounds 3, 7, 11) and each epoch's end (rounds 5, 11): keep 2.
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["checkpoint-epoch1-iter12.safetensors", "checkpoint-epoch1-iter8.safetensors"]
    last = TrainingCheckpoint.load(tmp_path)
    assert (last.epoch, last.batch, last.iteration) == (1, 12, 12)
    assert len(last.replicas) == 2
    # The checkpoint holds the replicas right before the final averaging of fit().
    final = {k: v for k, v in last.replicas[0]["model"].items()}
    assert set(final) == set(model.state_dict())


def test_listener_arguments_are_validated(tmp_path):
    with pytest.raises(ValueError, match="every_n_iterations"):
        CheckpointListener(tmp_path, every_n_iterations=0)
    with pytest.raises(ValueError, match="every_n_iterations= and/or every_n_epochs="):
        CheckpointListener(tmp_path, every_n_iterations=None, every_n_epochs=None)
    with pytest.raises(TypeError, match="listener"):
        ParallelWrapper(MLP(), loss_fn=nn.CrossEntropyLoss(), listeners=[42],
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def _train_lenet(precision, loader, epochs=5):
    torch.manual_seed(0)
    model = LeNet(image_size=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=2,
                         averaging_frequency=3, progress=False, precision=precision) as w:
        w.fit(loader, epochs=epochs)
    return model


def test_bf16_mixed_trains_lenet_within_a_point_of_fp32(digits_loader, digits_test):
    fp32 = _train_lenet("32-true", digits_loader)
    bf16 = _train_lenet("bf16-mixed", digits_loader)
    assert digest(fp32) != digest(bf16), "bf16 autocast must really change the arithmetic"
    assert next(bf16.parameters()).dtype == torch.float32  # the user's model keeps its dtype
    a32, a16 = accuracy(fp32, digits_test), accuracy(bf16, digits_test)
    assert a32 >= 0.95 and abs(a32 - a16) <= 0.01


def test_half_replicas_and_unknown_precision(digits_loader, digits_test):
    model = _train_lenet("bf16-true", digits_loader, epochs=3)
    assert next(model.parameters()).dtype == torch.float32
    assert accuracy(model, digits_test) >= 0.85
    with pytest.raises(ValueError, match="'32-true'"):
        ParallelWrapper(MLP(), loss_fn=nn.CrossEntropyLoss(), precision="fp8",
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


@pytest.mark.parametrize("workers", [1, 2])
def test_bf16_true_gives_a_frozen_layer_back_at_full_precision(workers):
    """The replicas hold bf16 copies; a layer that never trains came back as its bf16
    rounding (9.7e-4 off) in the user's fp32 model. Trained layers take the trained values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    model[0].requires_grad_(False)
    frozen, head = model[0].weight.detach().clone(), model[2].weight.detach().clone()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(4)]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=workers,
                         training_mode="allreduce", precision="bf16-true", progress=False) as w:
        w.fit(data, epochs=1)
    assert model[0].weight.dtype == torch.float32 and torch.equal(model[0].weight, frozen)
    assert not torch.equal(frozen.bfloat16().float(), frozen)  # rounding would show
    assert (model[2].weight - head).abs().max() > 1e-3  # the head trained, in bf16
    assert torch.equal(model[2].weight, model[2].weight.bfloat16().float())


class _WithCache(nn.Module):
    """A rotary-style cache (not in state_dict) and a persistent twin, neither trained."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)
        self.register_buffer("cache", torch.tensor([1.0001, 2.0003, 3.0007]), persistent=False)
        self.register_buffer("twin", torch.tensor([1.0001, 2.0003, 3.0007]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + 0 * (self.cache.sum() + self.twin.sum())


@pytest.mark.parametrize(("precision", "mode"), [("bf16-true", "allreduce"),
                                                 ("bf16-true", "averaging"),
                                                 ("16-true", "allreduce")])
def test_a_half_precision_fit_leaves_an_untrained_non_persistent_buffer_exact(precision, mode):
    """The persistent buffer came back exact, its non-persistent twin rounded to bf16
    ([1.0001, 2.0003, 3.0007] became [1.0, 2.0, 3.0]) in the user's model, for good."""
    model = _WithCache()
    start = model.cache.clone()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g))
            for _ in range(4)]
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, training_mode=mode,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         precision=precision, progress=False) as w:
        w.fit(data, epochs=1)
    assert model.cache.dtype == torch.float32 and torch.equal(model.cache, start)
    assert torch.equal(model.twin, start)
    assert not torch.equal(start.bfloat16().float(), start)  # rounding would show


@pytest.mark.parametrize(("model_dtype", "input_dtype", "fix"), [
    (torch.float32, torch.float64, r"\(x\.float\(\)\) or the model \(model\.double\(\)\)$"),
    (torch.float32, torch.bfloat16,
     r"\(x\.float\(\)\) or the model \(model\.bfloat16\(\)\), or train with "
     r"precision=\"bf16-true\""),
    (torch.float32, torch.float16, r"\(model\.half\(\)\), or train with precision=\"16-true\""),
    (torch.float64, torch.float32, r"\(x\.double\(\)\) or the model \(model\.float\(\)\)$"),
])
def test_an_input_dtype_mismatch_names_the_conversion_for_those_dtypes(model_dtype, input_dtype,
                                                                        fix):
    from paraloom import WorkerError

    model = nn.Linear(4, 2).to(model_dtype)
    batches = [(torch.ones(2, 4, dtype=input_dtype), torch.zeros(2, dtype=torch.long))]
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as w:
        with pytest.raises(WorkerError) as caught:
            w.fit(batches)
    message = str(caught.value).splitlines()[0]
    named = f"the inputs are {str(input_dtype)[6:]} but the model's parameters are " \
            f"{str(model_dtype)[6:]}: convert the data "
    assert named in message and re.search(fix, message), message


class _CastsItsInputs(nn.Module):
    """bf16 parameters, float32 data: the model converts its inputs itself."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.to(torch.bfloat16)).float()


def test_a_model_that_casts_its_own_inputs_trains() -> None:
    model = _CastsItsInputs()
    before = model.linear.weight.detach().clone()
    batches = [(torch.ones(2, 4), torch.zeros(2, dtype=torch.long))] * 3
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as w:
        w.fit(batches)
    assert model.linear.weight.dtype == torch.bfloat16
    assert not torch.equal(model.linear.weight, before)


def test_a_loss_error_on_a_self_casting_model_is_not_taken_for_a_dtype_error() -> None:
    from paraloom import WorkerError

    model = _CastsItsInputs()
    batches = [(torch.ones(2, 4, dtype=torch.float64), torch.zeros(2, 5))]  # targets too wide
    with ParallelWrapper(model, loss_fn=nn.MSELoss(), workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as w:
        with pytest.raises(Exception) as caught:
            w.fit(batches)
    message = str(caught.value)
    assert "on a batch with inputs" in message and "the inputs are float64" not in message
    assert not isinstance(caught.value, WorkerError) or "size" in message


@pytest.mark.parametrize("mode", ["allreduce", "averaging", "shared_gradients"])
def test_a_validation_listener_scores_each_epochs_weights_within_one_fit(mode):
    """A listener scoring your model in on_epoch_end scores the start weights (your model gets
    the replicas' only when fit() returns); ValidationListener scores each epoch's."""
    from torch.utils.data import DataLoader

    from paraloom.datasets import digits
    from paraloom.evaluation import evaluate
    from paraloom.listeners import ValidationListener

    torch.manual_seed(0)
    model = MLP(in_features=64, hidden=[32])
    start = evaluate(model, DataLoader(digits("test"), batch_size=512)).accuracy
    val = DataLoader(digits("test"), batch_size=512)
    listener = ValidationListener(lambda m: evaluate(m, val).accuracy, every_n_epochs=1)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                         training_mode=mode, listeners=[listener],
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.2)) as w:
        w.fit(DataLoader(digits("train"), batch_size=32, shuffle=True), epochs=3)
    scores = listener.scores
    assert sorted(scores) == [0, 1, 2]
    assert start < scores[0] < scores[2]  # each epoch's weights, learning
    assert scores[2] == pytest.approx(evaluate(model, val).accuracy, abs=2e-3)  # fit's result
    with pytest.raises(TypeError, match="expected a function of the model"):
        ValidationListener(0.5)  # type: ignore[arg-type]
