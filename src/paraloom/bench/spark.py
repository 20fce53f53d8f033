"""Spark training throughput: both masters against ParallelWrapper and TorchDistributor's DDP.

One run, one Spark session (``local[2]`` by default), the same LeNet and the same synthetic
data for every contender, one after the other:

* ``spark_shared``: SparkModel + SharedTrainingMaster (threshold-encoded update sharing);
* ``spark_averaging``: SparkModel + ParameterAveragingTrainingMaster;
* ``parallel_wrapper``: ParallelWrapper in shared_gradients mode, on this machine, no Spark;
* ``ddp_torch_distributor``: PyTorch DDP launched by Spark's own ``TorchDistributor``.

``samples_per_s`` is end to end (the call, including Spark's job, shuffle and start-up costs);
``train_samples_per_s`` is the training loop alone where the contender reports it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from paraloom.arguments import count
from paraloom.bench.common import bar_plot, machine, plain_args, results_path, write_results
from paraloom.models import LeNet

if TYPE_CHECKING:
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    from paraloom.spark.training import TrainingMaster

__all__ = ["add_arguments", "run"]


class _Measured(TypedDict):
    samples_per_s: float
    train_samples_per_s: float | None
    seconds: float
    bytes_per_step_per_worker: float


class Measured(_Measured, total=False):
    """One contender's numbers, as written to the results file."""

    stage_attempts: int
    ratio_to_ddp: float | None


class DdpLoop(TypedDict):
    """What rank 0 of the TorchDistributor run returns."""

    samples: int
    loop_seconds: float


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--master", default="local[2]", help="Spark master URL")
    p.add_argument("--workers", type=count, default=2)
    p.add_argument("--batch-size", type=count, default=64, help="rows per worker and step")
    p.add_argument("--samples", type=count, default=8192, help="training rows per epoch")
    p.add_argument("--epochs", type=count, default=2)
    p.add_argument("--image-size", type=count, default=28, help="28: MNIST-sized LeNet")
    p.add_argument("--averaging-frequency", type=count, default=5)
    p.add_argument("--threshold", type=float, default=1e-3, help="initial adaptive threshold")
    p.add_argument("--contenders", default="ddp_torch_distributor,spark_shared,"
                                           "spark_averaging,parallel_wrapper")
    p.add_argument("--out", type=results_path, default=None,
                   help="default benchmarks/results/spark.json (spark_data.json for --mode data)")
    p.add_argument("--mode", choices=("training", "data"), default="training",
                   help="training: the masters against ParallelWrapper and DDP on in-memory "
                        "data; data: Parquet of each of --sizes rows (driver memory, "
                        "fit_paths against a cached DataFrame and TorchDistributor)")
    from paraloom.bench.spark_data import add_arguments as data_arguments

    data_arguments(p)


def _data(samples: int, image_size: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(samples, 1, image_size, image_size, generator=g)
    return TensorDataset(x, torch.randint(0, 10, (samples,), generator=g))


def _model(image_size: int) -> nn.Module:
    torch.manual_seed(0)
    return LeNet(image_size=image_size)


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _spark(args: argparse.Namespace, spark: SparkSession, data: TensorDataset,
           kind: str) -> Measured:
    from paraloom.spark import (
        AdaptiveThreshold,
        ParameterAveragingTrainingMaster,
        SharedTrainingMaster,
        SparkModel,
    )

    master: TrainingMaster
    if kind == "shared":
        master = SharedTrainingMaster(
            args.batch_size, args.workers,
            threshold_algorithm=AdaptiveThreshold(args.threshold, max_sparsity=5e-3))
    else:
        master = ParameterAveragingTrainingMaster(args.batch_size, args.averaging_frequency,
                                                  args.workers)
    model = _model(args.image_size)
    net = SparkModel(spark, model, master, loss_fn=nn.CrossEntropyLoss(),
                     optimizer=_sgd(model.parameters()))
    x, y = data.tensors
    # Small slices keep each task under Spark's recommended size; the master repartitions.
    rows = spark.sparkContext.parallelize(list(zip(x.numpy(), y.tolist(), strict=True)),
                                          8 * args.workers)
    start = time.perf_counter()
    summary = net.fit(rows, epochs=args.epochs)
    seconds = time.perf_counter() - start
    per_step = summary.get("bytes_sent_per_step") or [summary.get("bytes_per_step_per_worker")]
    return Measured(samples_per_s=summary["samples"] / seconds,
                    train_samples_per_s=summary.get("train_samples_per_s"), seconds=seconds,
                    bytes_per_step_per_worker=sum(per_step) / len(per_step),
                    stage_attempts=summary["stage_attempts"])


def _wrapper(args: argparse.Namespace, data: TensorDataset) -> Measured:
    from paraloom import ParallelWrapper
    from paraloom.sync.thresholds import AdaptiveThreshold, ResidualClipping

    model = _model(args.image_size)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=_sgd(model.parameters()),
                         workers=args.workers, training_mode="shared_gradients", progress=False,
                         threshold_algorithm=AdaptiveThreshold(args.threshold,
                                                               max_sparsity=5e-3),
                         residual_post_processor=ResidualClipping(5.0, 5)) as wrapper:
        wrapper.fit(loader, epochs=1)  # starts the worker processes
        start = time.perf_counter()
        stats = wrapper.fit(loader, epochs=args.epochs)
        seconds = time.perf_counter() - start
    per_step = stats["bytes_sent_per_step"]
    return Measured(samples_per_s=stats["samples"] / seconds, train_samples_per_s=None,
                    seconds=seconds, bytes_per_step_per_worker=sum(per_step) / len(per_step))


def ddp_train(samples: int, image_size: int, batch_size: int, epochs: int) -> DdpLoop:
    """One TorchDistributor process: DDP over gloo on this rank's share of the same data."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _data(samples, image_size).tensors
    model = nn.parallel.DistributedDataParallel(_model(image_size))
    opt, loss_fn = _sgd(model.parameters()), nn.CrossEntropyLoss()
    steps = len(x) // (batch_size * world)
    start = time.perf_counter()
    for _ in range(epochs):
        for s in range(steps):  # DistributedSampler's layout: rank r takes every world-th batch
            i = (s * world + rank) * batch_size
            opt.zero_grad()
            loss_fn(model(x[i:i + batch_size]), y[i:i + batch_size]).backward()
            opt.step()
    dist.barrier()
    seconds = time.perf_counter() - start
    dist.destroy_process_group()
    return DdpLoop(samples=epochs * steps * batch_size * world, loop_seconds=seconds)


def _ddp(args: argparse.Namespace) -> Measured:
    from pyspark.ml.torch.distributor import TorchDistributor

    distributor = TorchDistributor(num_processes=args.workers, local_mode=False, use_gpu=False)
    start = time.perf_counter()
    out = distributor.run(ddp_train, args.samples, args.image_size, args.batch_size,
                          args.epochs)
    seconds = time.perf_counter() - start
    if out is None:  # TorchDistributor returns rank 0's value; None means it had none
        raise RuntimeError("TorchDistributor returned no result from rank 0")
    params = sum(p.numel() for p in _model(args.image_size).parameters())
    return Measured(samples_per_s=out["samples"] / seconds,
                    train_samples_per_s=out["samples"] / out["loop_seconds"], seconds=seconds,
                    bytes_per_step_per_worker=2 * (args.workers - 1) / args.workers * 4 * params)


def _warm_up(sc: SparkContext, workers: int) -> None:
    """Start the executors' Python processes and import torch in them, so no contender pays
    for it."""
    sc.parallelize(range(workers), workers).map(
        lambda _: __import__("paraloom.spark.training.shared_task").__name__).collect()


def run(args: argparse.Namespace) -> int:
    from paraloom.spark.cli import session

    if getattr(args, "mode", "training") == "data":
        from paraloom.bench import spark_data

        args.out = args.out or "benchmarks/results/spark_data.json"
        return spark_data.run(args)
    args.out = args.out or "benchmarks/results/spark.json"
    args = plain_args(args)
    data = _data(args.samples, args.image_size)
    spark, created = session(args.master)
    contenders: dict[str, Measured] = {}
    results = {"machine": machine(), "config": vars(args).copy(),
               "spark_master": args.master, "contenders": contenders}
    try:
        _warm_up(spark.sparkContext, args.workers)
        runners: dict[str, Callable[[], Measured]] = {
            "spark_shared": lambda: _spark(args, spark, data, "shared"),
            "spark_averaging": lambda: _spark(args, spark, data, "averaging"),
            "parallel_wrapper": lambda: _wrapper(args, data),
            "ddp_torch_distributor": lambda: _ddp(args)}
        for name in [c.strip() for c in args.contenders.split(",") if c.strip()]:
            if name not in runners:
                raise SystemExit(f"unknown contender {name!r}; expected {sorted(runners)}")
            contenders[name] = runners[name]()
    finally:
        if created:
            spark.stop()
    ddp = contenders.get("ddp_torch_distributor")
    for r in contenders.values():
        r["ratio_to_ddp"] = r["samples_per_s"] / ddp["samples_per_s"] if ddp else None
    path = write_results(args.out, results)
    _print(contenders, path)
    bar_plot(path, f"Spark training, {args.workers} workers ({args.master})",
             {name: r["samples_per_s"] for name, r in contenders.items()}, "samples/s")
    return 0


def _cell(value: float | None, width: int, digits: int = 0) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def _print(contenders: dict[str, Measured], path: Path) -> None:
    print(f"{'contender':<24}{'samples/s':>11}{'train loop':>12}{'/DDP':>7}{'bytes/step':>13}")
    for name, r in contenders.items():
        print(f"{name:<24}{_cell(r['samples_per_s'], 11)}{_cell(r['train_samples_per_s'], 12)}"
              f"{_cell(r.get('ratio_to_ddp'), 7, 2)}{_cell(r['bytes_per_step_per_worker'], 13)}")
    print(f"results written to {path}")
