"""What averaging averages: the parameters that train, the buffers, the optimizer's moments;
not a frozen parameter (the same on every replica) and not a step count (rank 0's)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paraloom import ParallelWrapper

pytestmark = pytest.mark.timeout(120)


def _batches(rows: int, features: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    x, y = torch.randn(rows, features), torch.randint(0, 3, (rows,))
    return [(x[i:i + 4], y[i:i + 4]) for i in range(0, rows, 4)]


def test_a_frozen_layer_is_neither_averaged_nor_moved() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 3))
    model[0].requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    # Three replicas: a mean of three equal float32 values is not always that value.
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=3,
                         training_mode="averaging", progress=False) as wrapper:
        stats = wrapper.fit(_batches(48, 64), epochs=3)
    assert torch.equal(model[0].weight, frozen)
    frozen_bytes = frozen.numel() * 4
    # The head, its Adam moments and the counters: far less than the frozen layer alone.
    assert max(stats["bytes_sent_per_step"]) < frozen_bytes / 2


def test_adams_step_count_stays_a_whole_number_when_a_replica_idles() -> None:
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    # 8 batches over 3 workers: each epoch's last round leaves worker 2 idle, so it has taken
    # one step fewer than the others; rank 0 has stepped in every round (3 per epoch).
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=opt, workers=3,
                         training_mode="averaging", progress=False) as wrapper:
        wrapper.fit(_batches(32, 4), epochs=2)
    assert [float(s["step"]) for s in opt.state.values()] == [6.0, 6.0]
