"""``paraloom spark-train``: train on Spark (an embedded ``local[2]`` by default), then evaluate.

The model and data options are those of ``paraloom train``; ``--master`` takes any Spark
master URL (``local[4]``, ``spark://host:7077``, ``yarn``, ``k8s://...``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import TYPE_CHECKING

import pyspark  # noqa: F401  (the CLI reports a missing [spark] extra when this fails)

from paraloom.arguments import count, positive

if TYPE_CHECKING:
    import numpy as np
    from pyspark import RDD, SparkContext
    from pyspark.sql import SparkSession
    from torch.utils.data import TensorDataset

    from paraloom.spark.training import TrainingMaster

__all__ = ["add_arguments", "run", "session"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``spark-train`` options."""
    from paraloom.cli import add_data_arguments

    p.add_argument("--master", default="local[2]",
                   help="Spark master URL; local[N] runs an embedded Spark (no cluster needed; "
                        "default local[2])")
    p.add_argument("--training-master", default="shared",
                   choices=["shared", "averaging", "diloco"],
                   help="shared: SharedTrainingMaster (update sharing); averaging: "
                        "ParameterAveragingTrainingMaster; diloco: the same with "
                        "encoding='topk' (DiLoCo); default shared")
    p.add_argument("--model", default="lenet", choices=["lenet", "mlp"],
                   help="the built-in model (default lenet)")
    add_data_arguments(p)
    p.add_argument("--workers", type=count, default=None,
                   help="Spark workers (default: the cluster's task slots)")
    p.add_argument("--epochs", type=count, default=10, help="passes over the data (default 10)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the data's "
                   "order (default 0)")
    p.add_argument("--threshold", type=positive, default=None,
                   help="initial threshold of AdaptiveThreshold (shared master; default 5e-3)")
    p.add_argument("--averaging-frequency", type=count, default=None,
                   help="minibatches between averagings (averaging master: default 5; "
                        "diloco: 50)")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                   help="a Spark configuration entry; repeat for more")
    p.add_argument("--out", help="where to save the model (.safetensors)")
    p.add_argument("--stats-html", help="write training stats as a self-contained HTML page")
    p.add_argument("--stats-json", help="write training stats as JSON")


def _confs(entries: list[str]) -> dict[str, str]:
    out = {}
    for entry in entries:
        key, sep, value = entry.partition("=")
        if not sep or not key:
            raise ValueError(f"--conf {entry!r}; expected KEY=VALUE, e.g. "
                             f"--conf spark.executor.memory=4g")
        out[key.strip()] = value.strip()
    return out


def session(master: str, confs: dict[str, str] | None = None) -> tuple[SparkSession, bool]:
    """(a SparkSession for the master URL ``master``, whether this call created it).

    For a ``local`` master URL the executors use this Python and loopback networking, unless
    the environment already says otherwise (PYSPARK_PYTHON, SPARK_LOCAL_IP).
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    if master.startswith("local"):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder.master(master).appName("paraloom spark-train")
    settings = {"spark.ui.showConsoleProgress": "false", "spark.barrier.sync.timeout": "600",
                **(confs or {})}
    for key, value in settings.items():
        builder = builder.config(key, value)
    try:
        return builder.getOrCreate(), True
    except Exception as e:  # py4j's and pyspark's errors: a wall of Java, then a traceback
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or \
            [type(e).__name__]
        cause = next((line.rsplit("Exception: ", 1)[-1] for line in lines
                      if "Exception: " in line), lines[0])
        raise ValueError(f"--master {master!r}: Spark did not start ({cause}); expected "
                         "local[N] with N >= 1, local[*], spark://HOST:PORT of a running "
                         "master, yarn or k8s://...") from None


def _rows(sc: SparkContext, dataset: TensorDataset,
          partitions: int) -> RDD[tuple[np.ndarray, int]]:
    x, y = dataset.tensors
    return sc.parallelize(list(zip(x.numpy(), y.numpy().tolist(), strict=True)), partitions)


def _master(args: argparse.Namespace) -> TrainingMaster:
    """The ``--training-master`` with its options (another master's is refused, not ignored)."""
    from paraloom.spark import (
        AdaptiveThreshold,
        ParameterAveragingTrainingMaster,
        SharedTrainingMaster,
    )

    _refuse_other_masters_options(args)
    if args.training_master == "shared":
        tau = 5e-3 if args.threshold is None else args.threshold
        return SharedTrainingMaster(batch_size_per_worker=args.batch_size, workers=args.workers,
                                    threshold_algorithm=AdaptiveThreshold(tau))
    return ParameterAveragingTrainingMaster(
        batch_size_per_worker=args.batch_size, averaging_frequency=args.averaging_frequency,
        workers=args.workers, encoding="topk" if args.training_master == "diloco" else None)


def _refuse_other_masters_options(args: argparse.Namespace) -> None:
    if args.threshold is not None and args.training_master != "shared":
        raise ValueError(f"--threshold is an option of --training-master shared, and the "
                         f"master is {args.training_master}; drop it, or pass "
                         "--training-master shared")
    if args.averaging_frequency is not None and args.training_master == "shared":
        raise ValueError("--averaging-frequency is an option of --training-master averaging "
                         "or diloco, and the master is shared; drop it, or pass "
                         "--training-master averaging")


def run(args: argparse.Namespace) -> int:
    """Train, print the test metrics, save the model and the stats if asked."""
    import torch
    from torch import nn

    import paraloom
    from paraloom.cli import check_writable
    from paraloom.datasets import load_dataset
    from paraloom.models import build_model
    from paraloom.spark import SparkModel

    if not 0 <= args.momentum < 1:
        raise ValueError(f"--momentum {args.momentum}; expected a value in [0, 1), e.g. 0.9")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr {args.lr}; expected a finite learning rate > 0, e.g. 0.05")
    for flag, path, example in (("--out", args.out, "model.safetensors"),
                                ("--stats-html", args.stats_html, "stats.html"),
                                ("--stats-json", args.stats_json, "stats.json")):
        if path:  # before the cluster trains: a bad path must not lose the model after
            check_writable(path, flag, example)
    torch.manual_seed(args.seed)
    train = load_dataset(args.dataset, "train", args.data_dir)
    test = load_dataset(args.dataset, "test", args.data_dir)
    model = build_model(args.model, train[0][0].shape)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    master = _master(args)  # its options checked before Spark starts
    spark, created = session(args.master, _confs(args.conf))
    try:
        net = SparkModel(spark, model, master, loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer)
        partitions = master.resolve_workers(spark.sparkContext)
        summary = net.fit(_rows(spark.sparkContext, train, partitions), epochs=args.epochs,
                          seed=args.seed, collect_stats=bool(args.stats_html or args.stats_json))
        if args.out:  # first: a failing evaluation must not lose what was trained
            paraloom.save(model, args.out, metadata={"dataset": args.dataset})
            print(f"saved {args.out}")
        result = net.evaluate(_rows(spark.sparkContext, test, partitions))
    finally:
        if created:
            spark.stop()
    print(result.report())
    print(f"{summary['samples_per_s']:.0f} samples/s end to end ({summary['seconds']:.1f} s, "
          f"{summary['workers']} workers, {args.training_master} master, {args.master})")
    stats = net.training_stats()
    if stats is not None and args.stats_html:
        print(f"stats written to {stats.export_html(args.stats_html)}")
    if stats is not None and args.stats_json:
        print(f"stats written to {stats.export_json(args.stats_json)}")
    return 0
