"""allreduce (DDP): bit-identical replicas, idle rounds, the same result as one process."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from torch import nn

from paraloom.sync.allreduce import AllReduce
from paraloom.sync.base import StepContext

from .replicas import reference_sgd, train

STEPS = 8
IDLE = {2: [1], STEPS - 1: [1]}  # rank 1 has no batch in two rounds


def _allreduce_run(rank: int, world_size: int, idle: dict[int, list[int]] | None,
                   batchnorm: bool = False) -> dict[str, Any]:
    sync = AllReduce(bucket_cap_mb=1)
    out = train(rank, world_size, sync, STEPS, idle=idle, batchnorm=batchnorm)
    out["numel"] = sum(p.numel() for p in sync._joinable.module.parameters())
    again = sync.wrap_model(sync._joinable.module, StepContext(  # type: ignore[union-attr]
        model=sync._joinable.module, optimizer=None, rank=rank,  # type: ignore[arg-type]
        world_size=world_size))
    out["same_wrapper"] = again is sync._ddp
    return out


@pytest.mark.parametrize("idle", [None, IDLE], ids=["full-rounds", "idle-rounds"])
def test_replicas_are_bit_identical_and_match_one_process(pool, idle) -> None:
    results = pool.run(_allreduce_run, idle=idle)
    a, b = results
    assert a["digests"] == b["digests"] and a["final"] == b["final"]
    assert a["initial"] == b["initial"], "DDP should have broadcast rank 0's weights"
    # DDP gives every rank the averaged gradient, so even the local steps agree; the result is
    # one process's SGD on the mean gradient (idle ranks count as zero, as with DDP's join()).
    assert all(x == y for x, y in zip(a["local"], b["local"], strict=True) if x and y)
    expected = torch.tensor(reference_sgd(2, STEPS, idle), dtype=torch.float64)
    assert torch.allclose(torch.tensor(a["params"], dtype=torch.float64), expected, atol=1e-6)
    # Each step all-reduces every gradient once: 2(n-1)/n of 4 bytes per parameter.
    assert a["stats"]["bytes_sent_per_step"] == 4 * a["numel"]
    assert a["same_wrapper"]


def test_buffers_agree_after_finish(pool) -> None:
    a, b = pool.run(_allreduce_run, idle=None, batchnorm=True)
    assert a["final"] == b["final"]  # parameters and BatchNorm statistics


def test_one_process_runs_the_model_unwrapped() -> None:
    model = nn.Linear(2, 1)
    ctx = StepContext(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    sync = AllReduce()
    assert sync.wrap_model(model, ctx) is model
    sync.after_step(ctx)
    sync.idle_step(ctx)
    assert sync.stats()["bytes_sent"] == 0 and sync.sync_steps == 2


def test_unknown_ddp_options_are_refused_at_construction() -> None:
    with pytest.raises(TypeError, match="bucket_cap_mb"):
        AllReduce(bucket_size=10)
    sync = pickle.loads(pickle.dumps(AllReduce(gradient_as_bucket_view=True)))
    assert sync.ddp_options == {"gradient_as_bucket_view": True}


def test_the_idle_and_step_fn_calls_survive_ddps_gpu_input_handling() -> None:
    """With ``device_ids`` (a GPU) DDP moves a forward's inputs with ``_to_kwargs`` and takes the
    first: a call with no arguments raised IndexError there (seen on an H200, not on the CPU)."""
    from torch.distributed.utils import _to_kwargs

    from paraloom.sync.allreduce import PLACEHOLDER_ARGS

    with pytest.raises(IndexError):
        _to_kwargs((), {}, torch.device("cpu"), False)[0][0]
    args, kwargs = _to_kwargs(PLACEHOLDER_ARGS, {}, torch.device("cpu"), False)
    assert (args[0], kwargs[0]) == ((None,), {})
