"""DDP's bucket layout: read once DDP has rebuilt its buckets, given to a new DDP at its start."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paraloom.sync.ddp_buckets import bucket_layout, ddp_with_layout


def _buckets_now(ddp: DistributedDataParallel, params: list[nn.Parameter]) -> list[list[int]]:
    index = {id(p): i for i, p in enumerate(params)}
    return [[index[id(p)] for p in b.parameters()]
            for b in ddp.reducer._get_zeros_like_grad_buckets()]


def _layouts(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    model[0].bias.requires_grad_(False)  # frozen: not bucketed, not counted
    params = [p for p in model.parameters() if p.requires_grad]
    ddp = DistributedDataParallel(model)
    out: dict[str, Any] = {"starting": _buckets_now(ddp, params),
                           "before_backward": bucket_layout(ddp)}
    for _ in range(2):  # the second forward rebuilds the buckets
        ddp(torch.randn(4, 8)).sum().backward()
    out["settled"] = layout = bucket_layout(ddp)
    with ddp_with_layout(layout):
        out["given"] = _buckets_now(DistributedDataParallel(model), params)
    out["after"] = _buckets_now(DistributedDataParallel(model), params)
    with ddp_with_layout([[0, 1]]):  # another model's: DDP chooses as it would
        out["foreign"] = _buckets_now(DistributedDataParallel(model), params)
    return out


def test_a_new_ddp_starts_with_the_layout_the_last_one_settled_on(pool) -> None:
    for got in pool.run(_layouts):
        assert got["before_backward"] is None
        assert got["starting"] == [[0, 1, 2, 3, 4]]  # by parameter order
        assert got["settled"] == [[4, 3, 2, 1, 0]]  # the order the gradients became ready
        assert got["given"] == got["settled"]
        assert got["after"] == got["starting"]  # the patch is gone once the block ends
        assert got["foreign"] == got["starting"]
