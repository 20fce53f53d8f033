"""Spark at data scale (``paraloom bench spark --mode data``): Parquet straight into training.

Writes synthetic rows (64 float features, a class the features determine) as Parquet from the
executors at each of ``--sizes`` (and a held-out test set), then, in one Spark session with
Spark's Python workers reused (its default):

* ``fit_paths_averaging`` / ``fit_paths_shared``: ``SparkModel.fit_paths`` on the folder with
  each master, every task streaming its share of the row groups, samples/s of the whole call;
* ``fit_dataframe``: ``SparkModel.fit`` (averaging master) on ``spark.read.parquet(folder)``,
  which it trains from the files as ``fit_paths`` does;
* ``fit_dataframe_computed``: the same on that DataFrame filtered (``label >= 0``: every row),
  whose partitions reach the tasks through Spark (spread over the workers by a shuffle unless
  there are exactly as many as workers, then streamed into training); not run by default;
* ``torch_distributor``: PyTorch DDP launched by ``TorchDistributor``, each rank reading its
  share of the Parquet files with pyarrow (the same model, batch size and epochs).

Each reports samples/s end to end, the seconds before the first step, the driver's peak RSS
(sampled every 20 ms) and the executors' Python peak RSS (per task), and the accuracy on the
test rows. Goals: both masters' ``fit_paths`` >= 1.0x TorchDistributor at 1M rows and more,
accuracy within 1 point of it, the executors' peak flat (100 MB) and samples/s within 10% from
the second-largest size to the largest.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paraloom.arguments import count, count_list
from paraloom.bench.common import machine, plain_args, pyplot, save_figure, write_results
from paraloom.bench.spark_ddp import (
    accuracy,
    bench_model,
    ddp_parquet,
    parquet_arrays,
    write_parquet,
)

if TYPE_CHECKING:
    import numpy as np
    from pyspark.sql import SparkSession

    from paraloom.spark import SparkModel

__all__ = ["add_arguments", "run", "RssSampler"]

CONTENDERS = ("fit_paths_averaging", "fit_paths_shared", "fit_dataframe", "torch_distributor")
OPTIONAL = ("fit_dataframe_computed",)


class RssSampler:
    """Peak resident memory of this process over a ``with`` block, sampled every ``period_s``."""

    def __init__(self, period_s: float = 0.02) -> None:
        self.period_s, self.peak, self.start = period_s, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def rss() -> int:
        """Current RSS in bytes (Linux /proc; ru_maxrss elsewhere)."""
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            import resource

            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak = max(self.peak, self.rss())

    def __enter__(self) -> RssSampler:
        self.start = self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.peak = max(self.peak, self.rss())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=count_list, default="100000,1000000,10000000",
                   help="--mode data: rows of each Parquet set, comma-separated")
    p.add_argument("--test-rows", type=count, default=20_000, help="held-out rows for accuracy")
    p.add_argument("--files", type=count, default=8, help="Parquet files per data set")
    p.add_argument("--data-averaging-frequency", type=count, default=50,
                   help="--mode data: minibatches per averaging round")
    p.add_argument("--data-contenders", default=",".join(CONTENDERS))
    p.add_argument("--keep-data", default=None, help="a folder to keep the Parquet in")
    p.add_argument("--driver-memory", default="4g", help="spark.driver.memory (local mode: "
                   "the executors' heap too)")


def _spark_model(spark: SparkSession, args: argparse.Namespace, master_name: str) -> SparkModel:
    from paraloom.spark import ParameterAveragingTrainingMaster, SharedTrainingMaster, SparkModel

    model = bench_model()
    master = (SharedTrainingMaster(args.batch_size, args.workers) if master_name == "shared"
              else ParameterAveragingTrainingMaster(args.batch_size,
                                                    args.data_averaging_frequency, args.workers))
    return SparkModel(spark, model, master, loss_fn=nn.CrossEntropyLoss(),
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))


def _fit_result(summary: dict[str, Any], seconds: float, rss: RssSampler, model: nn.Module,
                test: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    peak = summary.get("worker_peak_rss_mb")
    return {"samples": summary["samples"], "seconds": seconds,
            "samples_per_s": summary["samples"] / seconds, "loss": summary["loss"],
            "seconds_to_first_step": summary.get("seconds_to_first_step"),
            "stages": summary.get("stages"), "accuracy": accuracy(model, test),
            "driver_peak_rss_mb": rss.peak / 2**20,
            "driver_rss_growth_mb": (rss.peak - rss.start) / 2**20,
            "worker_peak_rss_mb": max(peak) if isinstance(peak, list) else peak}


def _fit_paths(spark: SparkSession, path: str, args: argparse.Namespace, master: str,
               test: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    net = _spark_model(spark, args, master)
    with RssSampler() as rss:
        start = time.perf_counter()
        summary = net.fit_paths(path, epochs=args.epochs)
        seconds = time.perf_counter() - start
    return _fit_result(summary, seconds, rss, net.model, test)


def _fit_dataframe(spark: SparkSession, path: str, args: argparse.Namespace,
                   test: tuple[np.ndarray, np.ndarray], computed: bool) -> dict[str, Any]:
    df = spark.read.parquet(path)
    if computed:
        df = df.where("label >= 0")
    net = _spark_model(spark, args, "averaging")
    with RssSampler() as rss:
        start = time.perf_counter()
        summary = net.fit(df, epochs=args.epochs)
        seconds = time.perf_counter() - start
    return _fit_result(summary, seconds, rss, net.model, test)


def _torch_distributor(spark: SparkSession, path: str, args: argparse.Namespace,
                       test: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    from pyspark.ml.torch.distributor import TorchDistributor

    distributor = TorchDistributor(num_processes=args.workers, local_mode=True, use_gpu=False)
    with RssSampler() as rss:
        start = time.perf_counter()
        out = distributor.run(ddp_parquet, path, args.batch_size, args.epochs, time.time())
        seconds = time.perf_counter() - start
    if out is None:
        raise RuntimeError("TorchDistributor returned no result from rank 0")
    model = bench_model()
    model.load_state_dict(out["state"])
    return {"samples": out["samples"], "seconds": seconds,
            "samples_per_s": out["samples"] / seconds,
            "train_samples_per_s": out["samples"] / out["loop_seconds"],
            "seconds_to_first_step": out["seconds_to_first_step"],
            "accuracy": accuracy(model, test),
            "driver_peak_rss_mb": rss.peak / 2**20,
            "driver_rss_growth_mb": (rss.peak - rss.start) / 2**20,
            "worker_peak_rss_mb": out["worker_peak_rss_mb"]}


def _runners(spark: SparkSession, args: argparse.Namespace, test: tuple[np.ndarray, np.ndarray]
             ) -> dict[str, Callable[[str], dict[str, Any]]]:
    return {"fit_paths_averaging": lambda p: _fit_paths(spark, p, args, "averaging", test),
            "fit_paths_shared": lambda p: _fit_paths(spark, p, args, "shared", test),
            "fit_dataframe": lambda p: _fit_dataframe(spark, p, args, test, computed=False),
            "fit_dataframe_computed": lambda p: _fit_dataframe(spark, p, args, test,
                                                               computed=True),
            "torch_distributor": lambda p: _torch_distributor(spark, p, args, test)}


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise SystemExit(f"--sizes {text!r}: expected comma-separated row counts") from None
    if not sizes or sizes[0] < 1:
        raise SystemExit(f"--sizes {text!r}: expected row counts >= 1")
    return sizes


def run(args: argparse.Namespace) -> int:
    from paraloom.spark.cli import session

    args = plain_args(args)
    sizes = _sizes(args.sizes)
    # A cached 10M-row DataFrame and its shuffle do not fit local mode's default 1 GB heap.
    spark, created = session(args.master, {"spark.sql.shuffle.partitions": str(args.workers),
                                           "spark.driver.memory": args.driver_memory})
    spark.sparkContext.setLogLevel("ERROR")
    base = args.keep_data or tempfile.mkdtemp(prefix="paraloom-bench-spark-")
    results: dict[str, Any] = {"machine": machine(), "config": vars(args).copy(),
                               "load_average": os.getloadavg(), "sizes": {}}
    names = [c.strip() for c in args.data_contenders.split(",") if c.strip()]
    unknown = sorted(set(names) - set(CONTENDERS) - set(OPTIONAL))
    if unknown:
        raise SystemExit(f"unknown --data-contenders {unknown}; expected some of "
                         f"{list(CONTENDERS + OPTIONAL)}")
    try:
        test_path = os.path.join(base, "test")
        write_parquet(spark, test_path, args.test_rows, 2, first=10**9)
        runners = _runners(spark, args, parquet_arrays(test_path))
        for rows in sizes:
            path = os.path.join(base, f"rows-{rows}")
            size: dict[str, Any] = {"write_seconds": write_parquet(spark, path, rows, args.files)}
            results["sizes"][str(rows)] = size
            for name in names:
                size[name] = _measure(runners[name], path)
                print(f"{rows:>9} rows  {name:<20} {_brief(size[name])}", flush=True)
                write_results(args.out, results)  # kept if a later contender brings Spark down
            if not args.keep_data:
                shutil.rmtree(path, ignore_errors=True)
    finally:
        if created:
            spark.stop()
        if not args.keep_data:
            shutil.rmtree(base, ignore_errors=True)
    results["load_average_after"] = os.getloadavg()
    results["goals"] = _goals(results["sizes"])
    written = write_results(args.out, results)
    _plot(results, written.with_suffix(".png"))
    for goal, value in results["goals"].items():
        print(f"{goal}: {value}")
    print(f"results written to {written}")
    return 0


def _measure(runner: Callable[[str], dict[str, Any]], path: str) -> dict[str, Any]:
    """One contender's figures, or its error (the others still run)."""
    try:
        return runner(path)
    except Exception as e:  # noqa: BLE001 - recorded in the results, the run goes on
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


def _brief(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"failed: {r['error']}"
    worker = r.get("worker_peak_rss_mb")
    first = r.get("seconds_to_first_step")
    return (f"{r['samples_per_s']:>9.0f}/s  {r['seconds']:6.1f} s  acc {r['accuracy']:.4f}  "
            f"first step {first if first is None else round(first, 2)} s  driver peak "
            f"{r['driver_peak_rss_mb']:.0f} MB"
            + (f"  worker peak {worker:.0f} MB" if worker else ""))


def _goals(sizes: dict[str, Any]) -> dict[str, Any]:
    sizes = {k: {n: r for n, r in v.items() if not (isinstance(r, dict) and "error" in r)}
             for k, v in sizes.items()}
    keys = sorted(sizes, key=int)
    out: dict[str, Any] = {}
    large = sizes[keys[-1]]
    base = "torch_distributor"
    for name in ("fit_paths_averaging", "fit_paths_shared", "fit_dataframe"):
        if name not in large:
            continue
        if base in large:
            ratios = {k: round(sizes[k][name]["samples_per_s"] / sizes[k][base]["samples_per_s"],
                               3) for k in keys if base in sizes[k] and name in sizes[k]}
            out[f"{name}_over_torch_distributor"] = ratios
            big = [r for k, r in ratios.items() if int(k) >= 1_000_000]
            out[f"{name}_at_least_1.0_from_1M"] = all(r >= 1.0 for r in big) if big else None
            out[f"{name}_accuracy_minus_torch_distributor"] = round(
                large[name]["accuracy"] - large[base]["accuracy"], 4)
        if len(keys) > 1 and name.startswith("fit_paths") and name in sizes[keys[-2]]:
            prev = sizes[keys[-2]][name]
            growth = (large[name]["worker_peak_rss_mb"] or 0) - (prev["worker_peak_rss_mb"] or 0)
            out[f"{name}_worker_peak_growth_mb"] = round(growth, 1)
            out[f"{name}_worker_flat_within_100mb"] = growth <= 100
            speed = large[name]["samples_per_s"] / prev["samples_per_s"]
            out[f"{name}_largest_over_previous_speed"] = round(speed, 3)
            out[f"{name}_speed_within_10pct"] = speed >= 0.9
    phases = [n for n in CONTENDERS if n in large and n in sizes[keys[0]]]
    if len(keys) > 1 and phases:
        growth = max(large[n]["driver_peak_rss_mb"] for n in phases) - \
            max(sizes[keys[0]][n]["driver_peak_rss_mb"] for n in phases)
        out["driver_peak_growth_mb"] = round(growth, 1)
        out["driver_flat_within_200mb"] = growth <= 200
    return out


def _plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    sizes = sorted(results["sizes"], key=int)
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4))
    names = [n for n in CONTENDERS if n in results["sizes"][sizes[-1]]]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        values = [results["sizes"][s].get(name, {}).get("samples_per_s", 0) for s in sizes]
        speed.bar([j + i * width for j in range(len(sizes))], values, width, label=name)
        peaks = [results["sizes"][s].get(name, {}).get("worker_peak_rss_mb") for s in sizes]
        if all(peaks):
            memory.plot([int(s) for s in sizes], peaks, marker="o", label=name)
    speed.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(sizes))],
                     [f"{int(s):,} rows" for s in sizes])
    speed.set_ylabel("training samples/s (whole call)")
    speed.legend(fontsize=8)
    memory.set_xscale("log")
    memory.set_xlabel("rows")
    memory.set_ylabel("executor Python peak RSS (MB)")
    memory.set_ylim(bottom=0)
    memory.legend(fontsize=8)
    fig.suptitle(f"Parquet into training ({results['config']['master']}, "
                 f"load {results['load_average'][0]:.1f})")
    save_figure(fig, path)
