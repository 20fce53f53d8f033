"""A checkpoint every replica answered before a failure is still written (the replies that
came in while the failure was handled are not dropped with the fit)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from paraloom.errors import WorkerError
from paraloom.listeners import TrainingListener
from paraloom.training.fit_run import FitRun
from paraloom.training.messages import CheckpointReply
from paraloom.training.packing import pack_tensors
from paraloom.training.resume import CheckpointCollector


class _Every4(TrainingListener):
    def __init__(self) -> None:
        self.written: list[int] = []

    def wants_checkpoint(self, iteration, epoch, epoch_end) -> bool:
        return (iteration + 1) % 4 == 0

    def on_checkpoint(self, checkpoint) -> None:
        self.written.append(checkpoint.iteration)


class _FailedPool:
    """A pool whose workers failed: it still holds the replies ``held``, then raises."""

    def __init__(self, held) -> None:
        self.held, self.sent = list(held), []

    def send(self, rank, message) -> None:
        self.sent.append((rank, message))

    def recv(self, timeout_s=None):
        if self.held:
            return self.held.pop(0)
        raise WorkerError("worker 1 failed: boom", worker=1)


@pytest.mark.timeout(30)
def test_checkpoint_replies_that_came_in_before_a_failure_are_written() -> None:
    listener = _Every4()
    collector = CheckpointCollector([listener], dict, workers=2)
    held = [CheckpointReply(1, 3, pack_tensors({"step": 4})),
            CheckpointReply(0, 3, pack_tensors({"step": 4})),
            CheckpointReply(1, 7, pack_tensors({"step": 8}))]  # round 8: rank 0 never answered
    pool = _FailedPool(held)
    run = FitRun(SimpleNamespace(recovering=False, data=[]), pool, SimpleNamespace(iteration=0),
                 collector, [listener], None)
    for iteration in (3, 7):
        collector.request(pool, iteration, 0, iteration + 1, [], False)
    assert len(pool.sent) == 4  # both replicas asked, twice
    run.salvage()
    assert listener.written == [4]  # the complete one; the half-answered one is not claimed
    assert not pool.held


class _Kept(_Every4):
    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[int]] = []

    def on_checkpoint(self, checkpoint) -> None:
        super().on_checkpoint(checkpoint)
        self.steps.append([int(r["step"]) for r in checkpoint.replicas])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("answered_before", [0, 1, 2])
def test_a_renewed_checkpoint_is_made_of_the_replies_to_the_second_request(answered_before):
    """``renew`` (the epoch's closing step changed the state since round 3's request): the
    replies still coming to the first request are dropped, whichever ranks had answered it,
    and the checkpoint holds the second request's states only."""
    listener = _Kept()
    collector = CheckpointCollector([listener], dict, workers=2)
    pool = _FailedPool([])
    collector.request(pool, 3, 0, 4, [], False)
    for rank in range(answered_before):
        collector.receive(CheckpointReply(rank, 3, pack_tensors({"step": 4})))
    collector.request(pool, 3, 0, 4, [], True, renew=True)
    assert len(pool.sent) == 4  # both replicas asked again
    for rank in range(answered_before, 2):  # the first request's replies, late
        collector.receive(CheckpointReply(rank, 3, pack_tensors({"step": 4})))
    assert listener.steps == ([[4, 4]] if answered_before == 2 else [])
    for rank in (1, 0):
        collector.receive(CheckpointReply(rank, 3, pack_tensors({"step": 5})))
    assert listener.steps[-1] == [5, 5] and listener.written[-1] == 4
