"""One replica's training loop, as the worker loop runs it, for the multi-process tests.

Every function here runs inside a pool process (``harness.DistPool``): it builds its own model
(same seed on every rank, then a synchronizer's ``setup`` makes them equal anyway), trains on
rank-dependent batches and returns plain Python values (digests, lists), never tensors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from paraloom.sync.base import StepContext, Synchronizer

IN, CLASSES, BATCH = 12, 4, 16


def make_model(seed: int = 0, batchnorm: bool = False, dtype: torch.dtype = torch.float32,
               ) -> nn.Module:
    """A small classifier; ``seed`` decides the initial weights."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(IN, 32)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(32))
    layers += [nn.ReLU(), nn.Linear(32, CLASSES)]
    return nn.Sequential(*layers).to(dtype)


def powersgd_elements(model: nn.Module, rank: int, min_compression_rate: float = 2) -> int:
    """Elements PowerSGD all-reduces per step after its warm-up: r(n + m) for a gradient viewed
    as an n x m matrix (first dimension by the rest), r = min(n, m, rank), where that is at least
    ``min_compression_rate`` times less than n * m; the whole tensor otherwise (vectors)."""
    total = 0
    for p in model.parameters():
        n = p.shape[0]
        m = p.numel() // n
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * min_compression_rate < n * m else p.numel()
    return total


def batch(rank: int, step: int, dtype: torch.dtype = torch.float32,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and step-dependent data, reproducible in any process."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, IN, generator=g).to(dtype)
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    return x, y


def digest(model: nn.Module, buffers: bool = True,
           shared: dict[int, torch.Tensor] | None = None) -> str:
    """A hash of the exact bits of the parameters (``shared``'s values in place of those it
    names: ``Synchronizer.shared_parameters``) and buffers."""
    h = hashlib.sha256()
    params = [(shared or {}).get(id(p), p) for p in model.parameters()]
    tensors = params + (list(model.buffers()) if buffers else [])
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def flat(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()]).tolist()


def train(rank: int, world_size: int, sync: Synchronizer, steps: int, *,
          idle: dict[int, list[int]] | None = None, lr: float = 0.1, momentum: float = 0.9,
          batchnorm: bool = False, dtype: torch.dtype = torch.float32,
          on_update: Callable[[nn.Module, list[torch.Tensor]], None] | None = None,
          seed: int | None = None, model: nn.Module | None = None) -> dict[str, Any]:
    """Run ``steps`` rounds; ``idle[step]`` lists the ranks without a batch in that round.

    ``model`` replaces ``make_model``'s (it must map IN features to CLASSES logits)."""
    # Different initial weights per rank unless asked: setup() must make them equal.
    if model is None:
        model = make_model(seed if seed is not None else rank, batchnorm, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    ctx = StepContext(model=model, optimizer=optimizer, group=dist.group.WORLD, rank=rank,
                      world_size=world_size)
    sync.setup(ctx)
    forward = sync.wrap_model(model, ctx)
    initial = flat(model)
    digests, local, sent = [], [], []
    for step in range(steps):
        ctx.step = step
        before_bytes = sync.bytes_sent
        if rank in (idle or {}).get(step, []):
            sync.idle_step(ctx)
            local.append(None)
        else:
            sync.before_step(ctx)
            optimizer.zero_grad(set_to_none=True)
            x, y = batch(rank, step, dtype)
            F.cross_entropy(forward(x), y).backward()
            sync.after_backward(ctx)
            before = [p.detach().clone() for p in model.parameters()]
            if not ctx.skip_optimizer_step:
                optimizer.step()
            local.append(digest(model, buffers=False))
            if on_update is not None:
                on_update(model, before)
            sync.after_step(ctx)
        digests.append(digest(model, buffers=False, shared=sync.shared_parameters(ctx)))
        sent.append(sync.bytes_sent - before_bytes)
    sync.finish(ctx)
    return {"digests": digests, "local": local, "final": digest(model), "initial": initial,
            "params": flat(model), "stats": sync.stats(), "bytes_per_step": sent}


def reference_sgd(world_size: int, steps: int, idle: dict[int, list[int]] | None = None, *,
                  lr: float = 0.1, momentum: float = 0.9) -> list[float]:
    """One process, one model: each step averages the active ranks' gradients over world_size."""
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        active = [r for r in range(world_size) if r not in (idle or {}).get(step, [])]
        for rank in active:
            x, y = batch(rank, step)
            (F.cross_entropy(model(x), y) / world_size).backward()
        optimizer.step()
    return flat(model)
