"""Training throughput: ParallelWrapper against single-process training and PyTorch DDP.

Every contender trains the same LeNet on the same data with the same per-worker batch, in this
process tree, one after the other; the report gives samples/s and ratios against the linear
limit (workers x the single-thread rate) and against DDP.
"""

from __future__ import annotations

import argparse
import datetime
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paraloom.bench.common import machine, plain_args, write_results
from paraloom.models import LeNet

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--samples", type=int, default=8192, help="training rows per epoch")
    p.add_argument("--epochs", type=int, default=2, help="timed epochs (after one warm-up)")
    p.add_argument("--image-size", type=int, default=28, help="28: MNIST-sized LeNet")
    p.add_argument("--modes", default="averaging,allreduce,shared_gradients",
                   help="ParallelWrapper modes to measure, comma-separated")
    p.add_argument("--out", default="benchmarks/results/training.json")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: the 1..N GPU scaling table instead (see bench.gpu_scaling)")


def _data(args: argparse.Namespace) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(args.samples, 1, args.image_size, args.image_size, generator=g)
    y = torch.randint(0, 10, (args.samples,), generator=g)
    return TensorDataset(x, y)


def _model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    return LeNet(image_size=args.image_size)


def _sgd(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _single(args: argparse.Namespace, data: TensorDataset, threads: int) -> float:
    """Samples/s of a plain training loop in this process."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, loss_fn = _model(args), nn.CrossEntropyLoss()
        opt = _sgd(model.parameters())
        x, y = data.tensors
        bs = args.batch_size
        def epoch() -> None:
            for i in range(0, len(x) - bs + 1, bs):
                opt.zero_grad()
                loss_fn(model(x[i:i + bs]), y[i:i + bs]).backward()
                opt.step()
        epoch()  # warm-up
        start = time.perf_counter()
        for _ in range(args.epochs):
            epoch()
        return args.epochs * (len(x) // bs) * bs / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)


def _ddp_worker(rank: int, world: int, port: int, args: argparse.Namespace,
                data: TensorDataset, threads: int, out: Queue[float]) -> None:
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    model = nn.parallel.DistributedDataParallel(_model(args))
    opt, loss_fn = _sgd(model.parameters()), nn.CrossEntropyLoss()
    x, y = data.tensors
    bs = args.batch_size
    steps = len(x) // (bs * world)

    def epoch() -> None:
        for s in range(steps):  # the DistributedSampler layout: rank r takes every world-th batch
            i = (s * world + rank) * bs
            opt.zero_grad()
            loss_fn(model(x[i:i + bs]), y[i:i + bs]).backward()
            opt.step()

    epoch()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.epochs):
        epoch()
    dist.barrier()
    if rank == 0:
        out.put(args.epochs * steps * bs * world / (time.perf_counter() - start))
    dist.destroy_process_group()


def _ddp(args: argparse.Namespace, data: TensorDataset, threads: int) -> float:
    """Samples/s of PyTorch DDP with ``args.workers`` gloo processes."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    out = ctx.Queue()
    procs = [ctx.Process(target=_ddp_worker, daemon=True,
                         args=(r, args.workers, store.port, args, data, threads, out))
             for r in range(args.workers)]
    for p in procs:
        p.start()
    try:
        return float(out.get(timeout=600))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


class _Clock:
    """Timestamps of round completions: the steady-state rate, as the DDP loop is timed."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, iteration: int, epoch: int, loss: float) -> None:
        self.times.append(time.perf_counter())


def _wrapper(args: argparse.Namespace, data: TensorDataset, mode: str) -> dict[str, Any]:
    """Samples/s (steady state and whole fit()) and bytes/step of ParallelWrapper in one mode."""
    from paraloom import ParallelWrapper

    model = _model(args)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    kwargs: dict[str, Any] = {"averaging_frequency": 3} if mode == "averaging" else {}
    clock = _Clock()
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=_sgd(model.parameters()),
                         workers=args.workers, training_mode=mode, progress=False,
                         listeners=[clock], **kwargs) as wrapper:
        wrapper.fit(loader, epochs=1)  # starts the workers; warm-up
        clock.times.clear()
        stats = wrapper.fit(loader, epochs=args.epochs)
    per_step = stats["bytes_sent_per_step"]
    rows_per_round = args.batch_size * args.workers
    steady = (len(clock.times) - 1) * rows_per_round / (clock.times[-1] - clock.times[0])
    return {"samples_per_s": steady, "fit_samples_per_s": stats["samples_per_s"],
            "bytes_per_step_per_worker": sum(per_step) / len(per_step)}


def run(args: argparse.Namespace) -> int:
    args = plain_args(args)
    if args.device == "cuda":
        from paraloom.bench.gpu_scaling import run_gpu

        return run_gpu(args, _data(args), lambda: _model(args), _sgd)
    cores = machine()["cores"] or 1
    threads = max(1, cores // args.workers)
    data = _data(args)
    results: dict[str, Any] = {"machine": machine(), "config": vars(args).copy(),
                               "threads_per_worker": threads, "samples_per_s": {}}
    sps = results["samples_per_s"]
    sps["single_1_thread"] = _single(args, data, 1)
    sps[f"single_{cores}_threads"] = _single(args, data, cores)
    sps["ddp"] = _ddp(args, data, threads)
    results["bytes_per_step_per_worker"] = {
        "ddp": 2 * (args.workers - 1) / args.workers * 4 * sum(
            p.numel() for p in _model(args).parameters())}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        try:
            r = _wrapper(args, data, mode)
        except (ImportError, ValueError) as e:  # a mode this version does not have
            results.setdefault("skipped", {})[mode] = str(e)
            continue
        sps[f"paraloom_{mode}"] = r["samples_per_s"]
        results.setdefault("whole_fit_samples_per_s", {})[f"paraloom_{mode}"] = \
            r["fit_samples_per_s"]
        results["bytes_per_step_per_worker"][f"paraloom_{mode}"] = r["bytes_per_step_per_worker"]
    linear = args.workers * sps["single_1_thread"]
    results["ratio_to_linear"] = {k: v / linear for k, v in sps.items()}
    results["ratio_to_ddp"] = {k: v / sps["ddp"] for k, v in sps.items()}
    path = write_results(args.out, results)
    _print(results, path)
    return 0


def _print(results: dict[str, Any], path: Path) -> None:
    print(f"{'contender':<28}{'samples/s':>12}{'/linear':>10}{'/DDP':>8}{'bytes/step':>14}")
    for k, v in results["samples_per_s"].items():
        b = results["bytes_per_step_per_worker"].get(k)
        print(f"{k:<28}{v:>12.0f}{results['ratio_to_linear'][k]:>10.2f}"
              f"{results['ratio_to_ddp'][k]:>8.2f}{'' if b is None else f'{b:>14.0f}'}")
    for mode, why in results.get("skipped", {}).items():
        print(f"skipped {mode}: {why}")
    for k, v in results.get("whole_fit_samples_per_s", {}).items():
        print(f"{k}: {v:.0f} samples/s over the whole fit() (start-up and final sync included)")
    print(f"results written to {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
