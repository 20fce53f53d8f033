"""accumulate=k and compile=: gradient accumulation in closed form per mode, exact on resume,
and a compiled replica that trains as the eager one does.

``Scalar`` with ``linear_loss`` has gradient mean(x), and SGD lr=1 moves w by minus the
gradient; two workers deal round by round (worker 0 the first batch of a round). With
``accumulate=2`` each replica adds up two rounds' gradients, each halved, and the replicas
exchange and step once; an epoch's end steps on what its last rounds added up.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from training_helpers import Scalar, digest, linear_loss, make_weight_reporting, scalar_batches

from paraloom import ParallelWrapper, StepOptions, TrainingCheckpoint, WorkerError
from paraloom.datasets import digits
from paraloom.listeners import CheckpointListener
from paraloom.models import LeNet

pytestmark = pytest.mark.timeout(180)


def _fit(values: list[float], workers: int = 2, epochs: int = 1, **options) -> tuple[float, dict]:
    model = Scalar()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with ParallelWrapper(model, loss_fn=linear_loss, optimizer=opt, workers=workers,
                         progress=False, timeout=60, **options) as wrapper:
        stats = wrapper.fit(scalar_batches(values), epochs=epochs)
    return float(model.w.detach()), stats


@pytest.mark.parametrize("mode", ["allreduce", "averaging", "shared_gradients"])
def test_two_rounds_add_up_before_one_exchange_and_the_epoch_end_steps(mode: str) -> None:
    # Rounds (1, 2), (3, 4), (5, 6): the first step moves w by (1 + 3 + 2 + 4) / 4; the epoch
    # ends after one round of the second accumulation, which steps by (5 + 6) / 4.
    w, stats = _fit([1, 2, 3, 4, 5, 6], training_mode=make_weight_reporting(mode), accumulate=2)
    assert w == pytest.approx(-21 / 4, abs=1e-6)
    assert [r["weights"] for r in stats["per_worker"]] == [[[w]], [[w]]]
    assert stats["per_worker"][0]["sync_steps"] == 2  # one exchange per step, not per round
    w, _ = _fit([1, 2, 3, 4, 5, 6], training_mode=mode)
    assert w == pytest.approx(-21 / 2, abs=1e-6)  # a step per round


@pytest.mark.parametrize("mode", ["allreduce", "averaging"])
def test_an_idle_last_round_steps_on_what_the_replica_accumulated(mode: str) -> None:
    # Rounds (1, 2), (3, 4), (5, idle): the first step leaves both at -2.5; in the second,
    # worker 0 steps on 5 / 2 and worker 1 on nothing. DDP averages the gradients (2.5 + 0) / 2:
    # -3.75. Averaging leaves the idle worker's weights out, as DL4J does: worker 0's -5.
    w, stats = _fit([1, 2, 3, 4, 5], training_mode=make_weight_reporting(mode), accumulate=2)
    assert w == pytest.approx(-2.5 - 1.25 if mode == "allreduce" else -5.0, abs=1e-6)
    assert [r["weights"] for r in stats["per_worker"]] == [[[w]], [[w]]]


def test_accumulation_restarts_at_each_epoch() -> None:
    # Three rounds per epoch, accumulate=2: steps after rounds 2 and 3 of each epoch.
    w, stats = _fit([1, 2, 3, 4, 5, 6], epochs=2, training_mode="allreduce", accumulate=2,
                    lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
    # Steps at lr 1, 0.5, 0.25, 0.125: the schedule moves once per optimizer step.
    assert w == pytest.approx(-(10 / 4) * (1 + 0.25) - (11 / 4) * (0.5 + 0.125), abs=1e-6)
    assert stats["per_worker"][0]["sync_steps"] == 4


def test_one_worker_accumulates_too() -> None:
    w, _ = _fit([1, 2, 3], workers=1, accumulate=2)
    assert w == pytest.approx(-(1 + 2) / 2 - 3 / 2, abs=1e-6)


def test_a_float64_model_accumulates_in_float64() -> None:
    """Each micro-batch's loss / 3 in the model's float64: the loss was cast to float32 first,
    so every gradient was scaled by float32(1/3) and the weights were off by ~1e-9."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    reference = copy.deepcopy(model)
    batches = [(torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,)))
               for _ in range(6)]
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for start in (0, 3):
        opt.zero_grad()
        for x, y in batches[start:start + 3]:
            (nn.functional.cross_entropy(reference(x), y) / 3).backward()
        opt.step()
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=1, accumulate=3,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                         progress=False, timeout=60) as wrapper:
        wrapper.fit(batches)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert ours.dtype == torch.float64
        assert torch.equal(ours, theirs), (ours - theirs).abs().max()


def _slow_step(model, batch):
    """Scalar's step, slow enough that rounds queue up behind the one in flight."""
    time.sleep(0.05)
    x, _ = batch
    return model(x).mean()  # d/dw = mean(x) = 1


def test_stop_in_an_accumulation_steps_on_what_it_holds() -> None:
    model = Scalar()

    def listener(iteration, epoch, loss):
        if iteration == 0:
            wrapper.stop()

    wrapper = ParallelWrapper(model, step_fn=_slow_step, workers=2, progress=False,
                              optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                              training_mode="allreduce", accumulate=8, prefetch_buffer=40,
                              listeners=[listener], timeout=60)
    with wrapper:
        stats = wrapper.fit([(torch.ones(1, 1), torch.zeros(1))] * 80)
    trained = stats["rounds"]
    assert 1 <= trained < 8, stats  # stopped inside the first accumulation
    # fit() ends with a step on the rounds trained: each added 1 / 8 to the gradient.
    assert float(model.w.detach()) == pytest.approx(-trained / 8, abs=1e-6)


@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_a_bad_accumulate_is_refused(value) -> None:
    with pytest.raises(ValueError, match="accumulate="):
        StepOptions(accumulate=value)


def test_compile_must_be_a_flag_or_keywords() -> None:
    with pytest.raises(TypeError, match="compile="):
        StepOptions(compile="yes")  # type: ignore[arg-type]


def _digits_run(listeners=(), resume_from=None, loss_fn=None, **options) -> str:
    torch.manual_seed(0)
    model = LeNet(image_size=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(digits("train"), batch_size=64, shuffle=True)
    with ParallelWrapper(model, loss_fn=loss_fn or nn.CrossEntropyLoss(), optimizer=opt,
                         workers=2, progress=False, listeners=list(listeners),
                         **options) as wrapper:
        wrapper.fit(loader, epochs=2, resume_from=resume_from)
    return digest(model)


class _FailAt(nn.Module):
    """Cross-entropy that raises on its ``at``-th call in the last worker (a crashed step);
    with ``once``, a file it leaves there keeps the worker that replaces it from failing."""

    def __init__(self, at: int, once: Path | None = None) -> None:
        super().__init__()
        self.at, self.calls, self.once = at, 0, once

    def forward(self, out, target):
        import torch.distributed as dist

        self.calls += 1
        if self.calls == self.at and dist.get_rank() == 1 \
                and not (self.once is not None and self.once.exists()):
            if self.once is not None:
                self.once.touch()
            raise RuntimeError("boom")
        return nn.functional.cross_entropy(out, target)


@pytest.mark.parametrize("mode", ["allreduce", "shared_gradients"])
def test_resume_from_a_checkpoint_inside_an_accumulation_is_bitwise_equal(tmp_path, mode):
    options = {"training_mode": mode, "accumulate": 3}
    reference = _digits_run(**options)
    assert reference != _digits_run(training_mode=mode)  # accumulation changes the result
    with pytest.raises(WorkerError, match="boom"):
        # Checkpoints every 4 rounds: rounds 4 and 8 end part way through an accumulation.
        _digits_run([CheckpointListener(tmp_path, every_n_iterations=4, every_n_epochs=None)],
                    loss_fn=_FailAt(11), **options)
    latest = TrainingCheckpoint.load(tmp_path)
    assert latest.iteration in (4, 8)  # the failure may cut the last one short
    assert latest.replicas[1]["accumulation"]["rounds"] in (1, 2)  # part way through one
    assert _digits_run(resume_from=tmp_path, **options) == reference


class _ScalarStream(torch.utils.data.IterableDataset):
    """``scalar_batches(1..6)`` as a stream, each replica reading every other batch."""

    def __iter__(self):
        import paraloom

        info = paraloom.replica_info()
        yield from scalar_batches(range(1, 7))[info.rank::info.world_size]


@pytest.mark.parametrize("stream", [False, True])
def test_a_checkpoint_at_an_epochs_last_round_holds_its_closing_step(tmp_path, stream) -> None:
    """An every-N checkpoint due on the epoch's last round is the epoch-end checkpoint too:
    it is taken after the closing step, not before it (which left a stream's checkpoint
    resuming at the next epoch with the last rounds' gradients still accumulated)."""
    model = Scalar()
    listener = CheckpointListener(tmp_path, every_n_iterations=3, every_n_epochs=1)
    with ParallelWrapper(model, loss_fn=linear_loss, optimizer=torch.optim.SGD(
            model.parameters(), lr=1.0), workers=2, progress=False, timeout=60, accumulate=2,
            listeners=[listener]) as wrapper:
        wrapper.fit(_ScalarStream() if stream else scalar_batches(range(1, 7)), epochs=1)
    (only,) = listener.written  # rounds (1, 2), (3, 4) step; (5, 6) closes the epoch
    checkpoint = TrainingCheckpoint.load(only)
    # Nothing accumulated (the key is there only while rounds are).
    assert [r.get("accumulation", {}).get("rounds", 0) for r in checkpoint.replicas] == [0, 0]
    assert float(checkpoint.model_state()["w"]) == pytest.approx(-21 / 4, abs=1e-6)
    assert float(model.w.detach()) == pytest.approx(-21 / 4, abs=1e-6)


def test_recovery_replays_an_accumulation_exactly(tmp_path) -> None:
    options = {"training_mode": "allreduce", "accumulate": 3}
    reference = _digits_run(**options)
    assert _digits_run(loss_fn=_FailAt(11, once=tmp_path / "failed"), max_failures=1,
                       **options) == reference
    assert (tmp_path / "failed").exists()


def test_a_compiled_replica_trains_as_the_eager_one() -> None:
    # The eager backend runs dynamo's graph capture without a C++ toolchain: same numbers.
    eager = _digits_run(training_mode="allreduce")
    model = LeNet(image_size=8)
    torch.manual_seed(0)
    model = LeNet(image_size=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(digits("train"), batch_size=64, shuffle=True)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=2,
                         progress=False, training_mode="allreduce",
                         compile={"backend": "eager"}) as wrapper:
        stats = wrapper.fit(loader, epochs=2)
    assert digest(model) == eager
    assert stats["compile_seconds"] > 0
    assert all(w["compile_seconds"] > 0 for w in stats["per_worker"])
