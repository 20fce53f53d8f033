"""Pacing: several rounds per message where steps are short, one where they are long; the
results of a batched fit are those of one round per message."""

from __future__ import annotations

import pytest
import torch
from training_helpers import Scalar, linear_loss, scalar_batches

from paraloom import ParallelWrapper
from paraloom.training import pacing
from paraloom.training.messages import IdleRound, IndexRound, RoundBatch
from paraloom.training.pacing import Pacing, PendingRounds

pytestmark = pytest.mark.timeout(120)


def _paced(monkeypatch, round_s: float, rounds: int, limit: int = 16) -> Pacing:
    now = [100.0]
    monkeypatch.setattr(pacing.time, "perf_counter", lambda: now[0])
    p = Pacing(limit)
    for _ in range(rounds):
        now[0] += round_s
        p.completed(1)
    return p


def test_short_rounds_travel_together_up_to_the_limit(monkeypatch) -> None:
    assert _paced(monkeypatch, 0.002, rounds=1).rounds_per_message == 1  # nothing timed yet
    assert _paced(monkeypatch, 0.1, rounds=10).rounds_per_message == 5  # 0.5 s of training
    assert _paced(monkeypatch, 0.002, rounds=10).rounds_per_message == 16
    assert _paced(monkeypatch, 0.002, rounds=10, limit=4).rounds_per_message == 4


def test_long_rounds_travel_alone(monkeypatch) -> None:
    assert _paced(monkeypatch, 0.8, rounds=10).rounds_per_message == 1


class _Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[int, object]] = []

    def send(self, rank: int, message: object) -> None:
        self.sent.append((rank, message))


def test_pending_rounds_go_as_one_batch_per_worker() -> None:
    pending, pool = PendingRounds(2), _Recorder()
    pending.send(pool)  # type: ignore[arg-type]
    assert pool.sent == []  # nothing pending, nothing sent
    pending.add([IndexRound(0, [0]), IndexRound(0, [1])])
    pending.send(pool)  # type: ignore[arg-type]
    assert pool.sent == [(0, IndexRound(0, [0])), (1, IndexRound(0, [1]))]  # one: as it is
    pool.sent.clear()
    pending.add([IndexRound(1, [2]), IndexRound(1, [3])])
    pending.add([IndexRound(2, [4]), IdleRound(2)])
    assert len(pending) == 2
    pending.send(pool)  # type: ignore[arg-type]
    assert pool.sent == [(0, RoundBatch((IndexRound(1, [2]), IndexRound(2, [4])))),
                         (1, RoundBatch((IndexRound(1, [3]), IdleRound(2))))]
    assert len(pending) == 0


def test_a_fit_of_short_steps_batches_rounds_and_trains_each_once() -> None:
    model = Scalar()
    iterations: list[int] = []
    values = [float(v % 7) for v in range(400)]  # 200 rounds of microsecond steps
    with ParallelWrapper(model, loss_fn=linear_loss, workers=2, progress=False, timeout=60,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.001),
                         training_mode="allreduce",
                         listeners=[lambda it, ep, loss: iterations.append(it)]) as wrapper:
        stats = wrapper.fit(scalar_batches(values))
        assert wrapper._run is not None and wrapper._run.pacing.rounds_per_message > 1
    assert iterations == list(range(200)) and stats["samples"] == 400
    # DDP averages each round's two values: SGD moves w by lr times their sum over 2.
    assert float(model.w.detach()) == pytest.approx(-0.001 * sum(values) / 2, rel=1e-5)
