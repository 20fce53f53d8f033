"""``paraloom bench training --device cuda``: the 1..N GPU scaling table.

For each GPU count n (1, 2, ... every visible GPU), ParallelWrapper trains
the training benchmark's model with one worker per GPU (``devices=n``, NCCL from n = 2) in each
mode, and PyTorch DDP trains it with n NCCL ranks, one per GPU, on the same shuffled batches
(gathered on the host and copied through pinned memory, as paraloom's workers take theirs).
Speed-up is against a plain training loop on ``cuda:0`` in this process (the data already on
the GPU), efficiency is speed-up / n, and ``/DDP`` is the rate over DDP's on as many GPUs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paraloom.bench.common import (
    Machine,
    bar_plot,
    machine,
    plain_epoch,
    steady_rate,
    write_results,
)
from paraloom.bench.ddp import join_group, run_ranks
from paraloom.bench.models import bench_sgd, workload_for

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

__all__ = ["gpu_counts", "run_gpu"]

ModelFn = Callable[[], nn.Module]
OptimizerFn = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]
LossFn = Callable[[], nn.Module]


class ScalingRow(TypedDict):
    """One mode on ``gpus`` GPUs."""

    gpus: int
    mode: str
    samples_per_s: float
    speedup: float
    """Against the plain loop on ``cuda:0``."""
    efficiency: float
    """``speedup / gpus``."""
    ratio_to_ddp: float
    """Against DDP on as many GPUs (1.0 for DDP's own rows)."""


class GpuMachine(Machine):
    """``machine()`` and the name of every visible GPU."""

    gpus: list[str]


class GpuResults(TypedDict):
    """The JSON that ``run_gpu`` writes."""

    machine: GpuMachine
    config: dict[str, object]
    plain_loop_cuda0_samples_per_s: float
    scaling: list[ScalingRow]


def gpu_counts(available: int) -> list[int]:
    """1, 2, ... every GPU; the error says what to do when there is none."""
    if available < 1:
        raise ValueError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() "
                         "is False); run on a GPU machine, or use --device cpu")
    return list(range(1, available + 1))


def _plain_loop(args: argparse.Namespace, data: TensorDataset, make_model: ModelFn,
                make_optimizer: OptimizerFn, make_loss: LossFn) -> float:
    """Samples/s of a plain training loop on cuda:0 (the data already on the GPU)."""
    device = torch.device("cuda", 0)
    model, loss_fn = make_model().to(device), make_loss()
    opt = make_optimizer(model.parameters())
    x, y = (t.to(device) for t in data.tensors)
    plain_epoch(model, loss_fn, opt, x, y, args.batch_size)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    rows = sum(plain_epoch(model, loss_fn, opt, x, y, args.batch_size)
               for _ in range(args.epochs))
    torch.cuda.synchronize(device)
    return rows / (time.perf_counter() - start)


def _paraloom(args: argparse.Namespace, data: TensorDataset, gpus: int, mode: str,
              make_model: ModelFn, make_optimizer: OptimizerFn, make_loss: LossFn) -> float:
    """Steady-state samples/s of ParallelWrapper on ``gpus`` GPUs, one worker each (timed
    between the first and last round of a second fit(), as the CPU benchmark does)."""
    from paraloom import ParallelWrapper

    model = make_model()
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    kwargs: dict[str, Any] = {"averaging_frequency": 3} if mode == "averaging" else {}
    times: list[float] = []
    batch_size: int = args.batch_size
    with ParallelWrapper(model, loss_fn=make_loss(),
                         optimizer=make_optimizer(model.parameters()), devices=gpus,
                         workers=gpus, training_mode=mode, progress=False,
                         listeners=[lambda i, e, loss: times.append(time.perf_counter())],
                         **kwargs) as wrapper:
        wrapper.fit(loader, epochs=1)  # starts the workers; warm-up
        times.clear()
        wrapper.fit(loader, epochs=args.epochs)
    return steady_rate(times, batch_size * gpus, skip=0)


def _ddp_rank(rank: int, world: int, port: int, args: argparse.Namespace, data: TensorDataset,
              out: Queue[float]) -> None:
    """One DDP rank on ``cuda:rank`` (NCCL), timed over ``args.epochs`` after a warm-up."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    join_group(rank, world, port, threads=1, backend="nccl")
    work = workload_for(args.model, getattr(args, "width", None))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(work.build().to(device), device_ids=[rank])
    opt, loss_fn = bench_sgd(model.parameters()), work.loss()
    x, y = data.tensors
    bs = args.batch_size
    steps = len(x) // (bs * world)
    shuffle = torch.Generator().manual_seed(0)

    def epoch() -> None:
        order = torch.randperm(len(x), generator=shuffle)
        for s in range(steps):
            rows = order[(s * world + rank) * bs:(s * world + rank + 1) * bs]
            inputs = x.index_select(0, rows).pin_memory().to(device, non_blocking=True)
            targets = y.index_select(0, rows).pin_memory().to(device, non_blocking=True)
            opt.zero_grad()
            loss_fn(model(inputs), targets).backward()
            opt.step()

    epoch()
    torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.epochs):
        epoch()
    torch.cuda.synchronize(device)
    dist.barrier()
    if rank == 0:
        out.put(args.epochs * steps * bs * world / (time.perf_counter() - start))
    dist.destroy_process_group()


def _ddp(args: argparse.Namespace, data: TensorDataset, gpus: int) -> float:
    """Samples/s of PyTorch DDP with one NCCL rank per GPU on ``gpus`` GPUs."""
    [rate] = run_ranks(_ddp_rank, gpus, (args, data), replies=1, timeout_s=300)
    return float(rate)


def _row(gpus: int, mode: str, samples_per_s: float, baseline: float,
         ddp: float) -> ScalingRow:
    speedup = samples_per_s / baseline
    return {"gpus": gpus, "mode": mode, "samples_per_s": samples_per_s, "speedup": speedup,
            "efficiency": speedup / gpus, "ratio_to_ddp": samples_per_s / ddp}


def run_gpu(args: argparse.Namespace, data: TensorDataset, make_model: ModelFn,
            make_optimizer: OptimizerFn, make_loss: LossFn) -> int:
    """Measure and print the scaling table; writes JSON next to the CPU benchmark's."""
    counts = gpu_counts(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    baseline = _plain_loop(args, data, make_model, make_optimizer, make_loss)
    ddp = {n: _ddp(args, data, n) for n in counts}
    rows = [_row(n, "ddp", ddp[n], baseline, ddp[n]) for n in counts]
    rows += [_row(n, mode, _paraloom(args, data, n, mode, make_model, make_optimizer, make_loss),
                  baseline, ddp[n])
             for mode in modes for n in counts]
    results: GpuResults = {
        "machine": {**machine(), "gpus": [torch.cuda.get_device_name(i)
                                          for i in range(torch.cuda.device_count())]},
        "config": vars(args).copy(),
        "plain_loop_cuda0_samples_per_s": baseline, "scaling": rows}
    out = Path(args.out)
    path = write_results(str(out.with_name(out.stem + "_cuda" + out.suffix)), results)
    print(f"{args.model}: plain loop on cuda:0: {baseline:.0f} samples/s (batch "
          f"{args.batch_size} per GPU)")
    print(f"{'mode':<18}{'GPUs':>5}{'samples/s':>12}{'speed-up':>10}{'efficiency':>12}"
          f"{'/DDP':>8}")
    for row in rows:
        print(f"{row['mode']:<18}{row['gpus']:>5}{row['samples_per_s']:>12.0f}"
              f"{row['speedup']:>10.2f}{row['efficiency']:>12.2f}{row['ratio_to_ddp']:>8.2f}")
    print(f"results written to {path}")
    bar_plot(path, f"{args.model} on CUDA: speed-up over a plain loop on one GPU",
             {f"{row['mode']} x{row['gpus']}": row["speedup"] for row in rows}, "speed-up")
    return 0
