"""allreduce with torch's DDP communication hooks: fp16, bf16, PowerSGD.

On two gloo processes: every rank gets the same averaged gradients, so the replicas stay
bit-identical after every step, idle rounds included; the bytes counted per step equal the
closed form (half of plain DDP for fp16/bf16, rank * (n + m) per compressed n x m gradient plus
the uncompressed ones for PowerSGD); PowerSGD's state survives a checkpoint exactly. Through
ParallelWrapper each hook trains a small separable task.
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from paraloom.sync.allreduce import AllReduce
from paraloom.sync.base import StepContext
from paraloom.sync.registry import build_synchronizer
from paraloom.training.resume import TrainingCheckpoint

from .replicas import CLASSES, IN, batch, digest, powersgd_elements, train

STEPS = 8
IDLE = {3: [1], STEPS - 1: [1]}  # rank 1 has no batch in two rounds


def big_model(seed: int) -> nn.Module:
    """70,148 parameters, most of them in one 256 x 256 matrix."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, CLASSES))


# -- bit-identical replicas and bytes per step --------------------------------------------------

def _hook_run(rank: int, world_size: int, options: dict[str, Any],
              idle: dict[int, list[int]] | None) -> dict[str, Any]:
    sync = AllReduce(**options)
    out = train(rank, world_size, sync, STEPS, idle=idle, model=big_model(seed=rank))
    out["numel"] = sum(p.numel() for p in big_model(0).parameters())
    return out


HOOKS = {"fp16": {"comm_hook": "fp16"}, "bf16": {"comm_hook": "bf16"},
         "powersgd": {"comm_hook": "powersgd", "powersgd_warmup": 2}}
BUCKETS = {"bucket_cap_mb": 0.1}  # the 256 x 256 matrix in a bucket of its own once rebuilt


@pytest.mark.parametrize("name", list(HOOKS))
def test_hooks_keep_replicas_bit_identical_and_send_the_closed_form_bytes(pool, name) -> None:
    a, b = pool.run(_hook_run, options={**HOOKS[name], **BUCKETS}, idle=IDLE)
    assert a["initial"] == b["initial"], "DDP should have broadcast rank 0's weights"
    assert a["digests"] == b["digests"] and a["final"] == b["final"]
    # The hook hands every rank the same averaged gradient: even the local steps agree.
    assert all(x == y for x, y in zip(a["local"], b["local"], strict=True) if x and y)
    assert all(math.isfinite(v) for v in a["params"])
    numel, dense = a["numel"], 4 * a["numel"]  # plain DDP: 2(n-1)/n * 4 bytes, n = 2
    assert numel == 70_148
    if name in ("fp16", "bf16"):
        expected = [numel * 2] * STEPS  # half of plain allreduce, idle rounds included
        assert expected[0] == dense // 2 == 140_296
    else:  # two steps of dense warm-up, then rank-1 factors and the biases
        compressed = 4 * powersgd_elements(big_model(0), rank=1)
        assert compressed == 4 * (268 + 512 + 260 + 516) == 6_224  # 2.2% of dense
        expected = [dense] * 2 + [compressed] * (STEPS - 2)
    assert a["bytes_per_step"] == b["bytes_per_step"] == expected
    assert a["stats"]["bytes_sent_per_step"] == sum(expected) / STEPS


def test_powersgd_rank_and_compression_rate_change_what_is_sent(pool) -> None:
    options = {"comm_hook": "powersgd", "powersgd_warmup": 2, "powersgd_rank": 4,
               "comm_hook_options": {"min_compression_rate": 10}}
    a, b = pool.run(_hook_run, options=options, idle=None)
    assert a["digests"] == b["digests"]
    # Rank 4 must save 10 times: 256x12 (3072 / 1072) and 4x256 (1024 / 1040) go dense, the
    # 256x256 matrix goes as 4 * (256 + 256) elements.
    elements = powersgd_elements(big_model(0), rank=4, min_compression_rate=10)
    assert elements == 3072 + 256 + 4 * 512 + 256 + 1024 + 4
    assert a["bytes_per_step"][2:] == [4 * elements] * (STEPS - 2)


# -- exact resume -------------------------------------------------------------------------------

def _step(sync: AllReduce, ctx: StepContext, forward: nn.Module, rank: int, step: int,
          idle: bool) -> None:
    ctx.step = step
    if idle:
        sync.idle_step(ctx)
        return
    ctx.optimizer.zero_grad(set_to_none=True)
    x, y = batch(rank, step)
    F.cross_entropy(forward(x), y).backward()
    ctx.optimizer.step()
    sync.after_step(ctx)


def _segment(rank: int, world_size: int, start: int, stop: int,
             saved: dict[str, Any] | None, restore_sync: bool = True) -> dict[str, Any]:
    """A fresh replica (new DDP, as in a new worker) trained over steps [start, stop)."""
    options = {"comm_hook": "powersgd", "powersgd_warmup": 3, "powersgd_rank": 2,
               "bucket_cap_mb": 0.05}  # several buckets once DDP rebuilds them: one before
    sync = pickle.loads(pickle.dumps(AllReduce(**options)))
    model = big_model(seed=rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx = StepContext(model=model, optimizer=optimizer, group=dist.group.WORLD, rank=rank,
                      world_size=world_size)
    sync.setup(ctx)
    if saved is not None:  # in Replica.begin_fit's order: state, setup, sync state, wrap_model
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        if restore_sync:
            sync.load_state_dict(saved["sync"])
    forward = sync.wrap_model(model, ctx)
    for step in range(start, stop):
        _step(sync, ctx, forward, rank, step, idle=step == 7 and rank == 1)
    assert sync._powersgd is not None
    return {"digest": digest(model), "buckets": len(sync._powersgd._layouts),
            "state": {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                      "sync": sync.state_dict()}}


def _resume_run(rank: int, world_size: int, at: int, directory: str) -> dict[str, Any]:
    whole = _segment(rank, world_size, 0, 10, None)
    first = _segment(rank, world_size, 0, at, None)
    # Through a checkpoint file: safetensors plus a JSON header, as CheckpointListener writes.
    path = Path(directory) / f"rank{rank}-at{at}.safetensors"
    TrainingCheckpoint({}, 0, at, at, [], [first["state"]]).save(path)
    saved = TrainingCheckpoint.load(path).replicas[0]
    assert saved is not None
    resumed = _segment(rank, world_size, at, 10, saved)
    restarted = _segment(rank, world_size, at, 10, saved, restore_sync=False)
    powersgd = first["state"]["sync"].get("powersgd", {})
    return {"whole": whole["digest"], "resumed": resumed["digest"], "buckets": resumed["buckets"],
            "restarted": restarted["digest"], "iter": powersgd.get("iter"),
            "errors": len(powersgd.get("errors", {})), "qs": len(powersgd.get("qs", {}))}


@pytest.mark.parametrize("at", [2, 6], ids=["in-warm-up", "after-warm-up"])
def test_powersgd_resumes_exactly_from_a_checkpoint(pool, tmp_path, at) -> None:
    a, b = pool.run(_resume_run, at=at, directory=str(tmp_path))
    assert a["whole"] == b["whole"] and a["resumed"] == b["resumed"]
    assert a["resumed"] == a["whole"], "resumed run differs from the uninterrupted one"
    assert a["iter"] == at
    assert a["buckets"] >= 2  # the resumed DDP started with one bucket, then rebuilt them
    if at > 3:  # error feedback for all 6 parameters, Q for the 2 compressed matrices
        assert (a["errors"], a["qs"]) == (6, 2)
        # The state matters: without it PowerSGD starts over (zero error, new Q).
        assert a["restarted"] != a["whole"]


# -- through ParallelWrapper --------------------------------------------------------------------

def _blobs(n: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Four Gaussian blobs in 16 dimensions: a linear model separates them."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 16, generator=g) * 3
    y = torch.randint(0, 4, (n,), generator=g)
    return centers[y] + torch.randn(n, 16, generator=g), y


def _wrapper_fit(options: dict[str, Any], epochs: int, listeners: tuple[Any, ...] = (),
                 resume_from: Path | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """16 batches of 32 per epoch (8 rounds on 2 workers), SGD with momentum."""
    from paraloom.training.wrapper import ParallelWrapper

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    x, y = _blobs()
    batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, len(x), 32)]
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                         training_mode="allreduce", listeners=list(listeners),
                         **options) as wrapper:
        stats = wrapper.fit(batches, epochs=epochs, resume_from=resume_from)
    return model, stats


@pytest.mark.timeout(90)
@pytest.mark.parametrize("options", [
    {"comm_hook": "fp16"}, {"comm_hook": "bf16"},
    {"comm_hook": "powersgd", "powersgd_warmup": 4, "powersgd_rank": 2},
], ids=["fp16", "bf16", "powersgd"])
def test_each_hook_trains_through_parallel_wrapper(options) -> None:
    losses: list[float] = []
    model, stats = _wrapper_fit(options, epochs=3,
                                listeners=(lambda i, e, loss: losses.append(loss),))
    x, y = _blobs()
    with torch.no_grad():
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    assert accuracy >= 0.95, (accuracy, losses)
    assert sum(losses[-4:]) < 0.2 * sum(losses[:4])
    numel = sum(p.numel() for p in model.parameters())  # 1,348: plain DDP sends 4 bytes each
    sent = [w["bytes_sent_per_step"] for w in stats["per_worker"]]
    if options["comm_hook"] != "powersgd":
        assert sent == [2 * numel] * 2
    else:  # 4 dense rounds of 24, then 2 * (64 + 16) + 64 + 256 + 4 elements (4 x 64 is dense)
        elements = powersgd_elements(model, rank=2)
        assert elements == 484
        assert sent == [4 * (4 * numel + 20 * elements) / 24] * 2


@pytest.mark.timeout(90)
def test_parallel_wrapper_resumes_powersgd_exactly(tmp_path) -> None:
    from paraloom.listeners import CheckpointListener

    options = {"comm_hook": "powersgd", "powersgd_warmup": 3, "powersgd_rank": 2}
    # 16 rounds; checkpoints after rounds 5, 10 and 15; resume from round 10 (epoch 1).
    whole, _ = _wrapper_fit(options, epochs=2, listeners=(CheckpointListener(
        tmp_path, every_n_iterations=5, every_n_epochs=None, keep_last=5),))
    middle = tmp_path / "checkpoint-epoch1-iter10.safetensors"
    saved = TrainingCheckpoint.load(middle)
    assert saved.fingerprint["synchronizer"]["comm_hook"] == "powersgd"
    assert all(r is not None and r["sync"]["powersgd"]["iter"] == 10 for r in saved.replicas)
    resumed, _ = _wrapper_fit(options, epochs=2, resume_from=middle)
    assert digest(resumed) == digest(whole)


# -- options ------------------------------------------------------------------------------------

def test_unknown_hooks_and_misplaced_options_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\['fp16', 'bf16', 'powersgd'\]"):
        AllReduce(comm_hook="int8")
    with pytest.raises(TypeError, match="powersgd_rank.*comm_hook='powersgd' only"):
        AllReduce(powersgd_rank=2)
    with pytest.raises(TypeError, match="comm_hook_options.*comm_hook='powersgd' only"):
        AllReduce(comm_hook="fp16", comm_hook_options={"warm_start": False})
    with pytest.raises(TypeError, match="unknown key.*'orthogonalization_epsilon'"):
        AllReduce(comm_hook="powersgd", comm_hook_options={"epsilon": 1e-8})
    with pytest.raises(TypeError, match="powersgd_rank= instead"):
        AllReduce(comm_hook="powersgd", comm_hook_options={"matrix_approximation_rank": 2})
    with pytest.raises(ValueError, match="powersgd_warmup=1"):
        AllReduce(comm_hook="powersgd", powersgd_warmup=1)
    with pytest.raises(ValueError, match="powersgd_rank=0"):
        AllReduce(comm_hook="powersgd", powersgd_rank=0)
    with pytest.raises(TypeError, match="comm_hook.*do not apply to training_mode='averaging'"):
        build_synchronizer("averaging", comm_hook="fp16")
    # Without error feedback and warm start, torch allows PowerSGD from the first step.
    AllReduce(comm_hook="powersgd", powersgd_warmup=0,
              comm_hook_options={"use_error_feedback": False, "warm_start": False})


def test_options_reach_the_synchronizer_and_its_config() -> None:
    sync = build_synchronizer("allreduce", comm_hook="PowerSGD", powersgd_rank=2,
                              comm_hook_options={"min_compression_rate": 4}, bucket_cap_mb=5)
    assert isinstance(sync, AllReduce)
    assert sync.config() == {"ddp_options": {"bucket_cap_mb": 5}, "comm_hook": "powersgd",
                             "powersgd_rank": 2, "powersgd_warmup": 1000,
                             "comm_hook_options": {"min_compression_rate": 4}}
    assert build_synchronizer("ddp", comm_hook="bf16").config() == {
        "ddp_options": {}, "comm_hook": "bf16"}
    # No hook: the config of before, so older checkpoints still resume.
    assert build_synchronizer("allreduce", comm_hook=None).config() == {"ddp_options": {}}
    again = pickle.loads(pickle.dumps(sync))
    assert again.config() == sync.config()


def test_a_checkpoint_with_another_hook_is_refused() -> None:
    from paraloom.training.wrapper import ParallelWrapper

    def fingerprint(**options: Any) -> dict[str, Any]:
        model = nn.Linear(4, 2)
        return ParallelWrapper(model, loss_fn=nn.MSELoss(), workers=2, progress=False,
                               optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               training_mode="allreduce", **options).fingerprint()

    saved = TrainingCheckpoint(fingerprint(comm_hook="powersgd", powersgd_warmup=10), 0, 0, 0,
                               [], [])
    saved.check(fingerprint(comm_hook="powersgd", powersgd_warmup=10))
    for other in ({"comm_hook": "powersgd"}, {"comm_hook": "fp16"}, {}):
        with pytest.raises(ValueError, match="synchronizer"):
            saved.check(fingerprint(**other))


def _fp16_mixed_run(rank: int, world_size: int) -> str:
    model = nn.Linear(IN, CLASSES)
    ctx = StepContext(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      group=dist.group.WORLD, rank=rank, world_size=world_size,
                      scaler=torch.amp.GradScaler("cpu"))
    try:
        AllReduce(comm_hook="powersgd").wrap_model(model, ctx)
    except ValueError as e:
        return str(e)
    return "no error"


def test_powersgd_refuses_fp16_loss_scaling(pool) -> None:
    for message in pool.run(_fp16_mixed_run):
        assert "16-mixed" in message


class _Branches(nn.Module):
    """A second head used only on batches whose first value is positive."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        self.extra = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return self.extra(out) if bool(x[0, 0] > 0) else out


@pytest.mark.timeout(90)
def test_powersgd_with_parameters_used_by_one_worker_only_trains() -> None:
    # The two workers of a round use different parameters: DDP all-reduces its map of used
    # parameters from the training thread while PowerSGD's callbacks issue their own
    # all-reduces, which in racing orders hung both workers until the timeout.
    from paraloom.training.wrapper import ParallelWrapper

    x, y = _blobs()
    batches = [(x[i:i + 32].clone(), y[i:i + 32]) for i in range(0, len(x), 32)]
    for k, (inputs, _) in enumerate(batches):
        inputs[0, 0] = 5.0 if k % 2 == 0 else -5.0  # worker 0's batches take the extra head
    model = _Branches()
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                         training_mode="allreduce", comm_hook="powersgd", powersgd_warmup=2,
                         find_unused_parameters=True, timeout=20) as wrapper:
        stats = wrapper.fit(batches, epochs=2)
    assert stats["batches"] == 32
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
