"""LeNet on digits, 2 workers: shared_gradients against allreduce through ParallelWrapper.

Same model, data order, optimizer and epochs; shared_gradients must land within 1 point of
allreduce's test accuracy (1 test image is 0.28 points) while sending a small fraction of its
bytes per step, as counted by the synchronizers: the default recipe at lr 0.1 (measured: 98.33%
against 97.21%, 1/315 of the bytes), and DL4J's adaptive threshold with averaged updates at lr 0.05
(98.89% vs 98.33%, 524,320 vs 3,549 bytes per step: 0.68%). allreduce with
comm_hook="powersgd" (rank 2, 34 dense warm-up steps) must stay within 1 point of plain
allreduce: measured 99.44%, 16,760 bytes per step after the warm-up (3.2%).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from paraloom.datasets import digits
from paraloom.models import LeNet

from .replicas import powersgd_elements

wrapper = pytest.importorskip("paraloom.training.wrapper")

EPOCHS, BATCH, LR = 15, 32, 0.05


def _sgd(params: Any, lr: float = LR) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


@functools.cache  # the allreduce run serves two tests
def _train(mode: str, options: tuple[tuple[str, Any], ...] = (),
           lr: float = LR) -> tuple[float, dict[str, Any]]:
    torch.manual_seed(0)
    model = LeNet(image_size=8)
    loader = DataLoader(digits("train"), batch_size=BATCH, shuffle=True,
                        generator=torch.Generator().manual_seed(1))
    with wrapper.ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(),
                                 optimizer=functools.partial(_sgd, lr=lr),
                                 workers=2, training_mode=mode, progress=False,
                                 timeout=120, **dict(options)) as pw:
        stats = pw.fit(loader, epochs=EPOCHS)
    x, y = digits("test").tensors
    model.eval()
    with torch.no_grad():
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    return accuracy, stats


@pytest.mark.timeout(240)
def test_adaptive_threshold_sharing_matches_allreduce_with_one_percent_of_the_bytes() -> None:
    dense_accuracy, dense = _train("allreduce")
    shared_accuracy, shared = _train("shared_gradients", (("recipe", "dl4j"),
                                                          ("combine", "mean")))
    dense_bytes = max(dense["bytes_sent_per_step"])
    shared_bytes = max(shared["bytes_sent_per_step"])
    report = (f"allreduce {dense_accuracy:.4f} ({dense_bytes:.0f} B/step), shared_gradients "
              f"{shared_accuracy:.4f} ({shared_bytes:.0f} B/step, "
              f"{100 * shared_bytes / dense_bytes:.2f}%)")
    assert dense_accuracy > 0.95, report
    assert shared_accuracy >= dense_accuracy - 0.01, report
    assert shared_bytes <= 0.01 * dense_bytes, report
    worker = shared["per_worker"][0]
    assert 1e-4 <= worker["mean_sparsity"] <= 1e-2, worker


@pytest.mark.timeout(240)
def test_powersgd_matches_allreduce_with_four_percent_of_the_bytes_after_warm_up() -> None:
    # Measured: 99.44% (allreduce 98.89%); 16,760 bytes per step after the warm-up (3.2% of
    # 524,320). Rank 1 diverged to NaN at round 177 on one machine and trained on another:
    # which CPU kernels round how decides it, so the test takes rank 2, which holds on both.
    warmup = 34  # about 10% of the 345 steps, as torch advises
    dense_accuracy, dense = _train("allreduce")
    accuracy, stats = _train("allreduce", (("comm_hook", "powersgd"), ("powersgd_rank", 2),
                                           ("powersgd_warmup", warmup)))
    rounds, dense_bytes = stats["rounds"], max(dense["bytes_sent_per_step"])
    assert rounds == 345
    compressed = 4 * powersgd_elements(LeNet(image_size=8), rank=2)
    assert compressed == 16_760
    expected = (warmup * dense_bytes + (rounds - warmup) * compressed) / rounds
    assert stats["bytes_sent_per_step"] == [pytest.approx(expected)] * 2
    assert accuracy >= dense_accuracy - 0.01, (accuracy, dense_accuracy)


@pytest.mark.timeout(240)
def test_sharing_trains_at_the_dense_recipe_with_a_three_hundredth_of_the_bytes() -> None:
    # lr 0.1 with momentum 0.9, as allreduce: measured 98.33% (allreduce 97.21%) at 1,664
    # B/step against 524,320 (1/315: exactly 1/160 of the elements in gap16 messages, half a
    # word each, plus the 24-byte headers, exchanged while the next step computes). DL4J's
    # recipe (recipe="dl4j") falls to 10.6% here (`paraloom bench convergence` shows it).
    dense_accuracy, dense = _train("allreduce", lr=0.1)
    accuracy, stats = _train("shared_gradients", lr=0.1)
    dense_bytes, shared_bytes = max(dense["bytes_sent_per_step"]), max(stats["bytes_sent_per_step"])
    report = (f"allreduce {dense_accuracy:.4f}, shared_gradients {accuracy:.4f} at "
              f"{shared_bytes:.0f} of {dense_bytes:.0f} B/step")
    assert dense_accuracy > 0.95, report
    assert accuracy >= dense_accuracy - 0.01, report
    assert shared_bytes <= dense_bytes / 300, report
    for worker in stats["per_worker"]:
        assert worker["mean_sparsity"] == pytest.approx(1 / 160, rel=0.1), worker
        assert worker["momentum_masked"] == 0  # the dgc recipe masks no momentum


@pytest.mark.timeout(240)
def test_a_short_run_at_the_edge_of_stability_keeps_up_with_allreduce() -> None:
    """digits16 at 6 epochs, lr 0.1: where gradients at the shared parameters fell 12 points
    behind (measured 79.0% against all-reduce's 91.6% on this seed), the local view is ahead
    (93.7%)."""
    import argparse

    from paraloom.bench import convergence

    parser = argparse.ArgumentParser()
    convergence.add_arguments(parser)
    args = parser.parse_args(["--epochs", "6"])
    result = {name: convergence._train(args, "digits16", name, seed=3)
              for name in ("allreduce", "sharing", "sharing_at_shared")}
    accuracy = {name: r["accuracy"] for name, r in result.items()}
    assert None not in accuracy.values(), result
    assert accuracy["sharing"] >= accuracy["allreduce"] - 0.005, accuracy
    assert accuracy["sharing"] >= accuracy["sharing_at_shared"] + 0.05, accuracy
    assert result["sharing"]["bytes_per_step"] <= result["allreduce"]["bytes_per_step"] / 300


def test_a_small_model_comes_back_where_its_workers_losses_ran() -> None:
    """418 parameters, about 3 moved per message: most of a fit's updates are still in the
    residuals at its end. fit() returns the mean of the local views, where the losses ran
    (returning the shared parameters alone: 0.60 accuracy, loss 0.69; measured now 0.947,
    0.114; allreduce 1.0)."""
    items = torch.from_numpy(np.random.default_rng(2).integers(0, 50, size=512))
    labels = (items % 2 == 0).long()
    batches = [(items[i:i + 32], labels[i:i + 32]) for i in range(0, 512, 32)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 2))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    with wrapper.ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2,
                                 optimizer=torch.optim.Adam(model.parameters(), lr=0.05),
                                 training_mode="shared_gradients", progress=False) as w:
        stats = w.fit(batches, epochs=3)
        with torch.no_grad():
            out = model(items)
        assert (out.argmax(1) == labels).float().mean() > 0.9
        assert nn.functional.cross_entropy(out, labels) < 0.25
        # One dense all-reduce of the 418 residual elements, counted apart from the messages.
        assert stats["per_worker"][0]["finish_bytes_sent"] > 0
        # A warm fit goes on from the replicas' own state, not from the returned mean.
        w.fit(batches, epochs=1)
    with torch.no_grad():
        out = model(items)
    assert (out.argmax(1) == labels).float().mean() > 0.9
    assert any(not torch.equal(v, initial[k]) for k, v in model.state_dict().items())
