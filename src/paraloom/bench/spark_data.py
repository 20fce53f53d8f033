"""Spark at data scale (``paraloom bench spark --mode data``): Parquet in, bounded memory.

Writes ``--rows`` synthetic rows (64 float features, a learnable class label) as Parquet from
the executors, then, at ``--small-rows`` and at ``--rows``, in one Spark session:

* ``ingest``: rows/s of the executors reading and decoding the Parquet into array chunks
  (``mapInArrow``), counted on the executors;
* ``fit_paths``: ``SparkModel.fit_paths`` on the directory, samples/s of the whole call;
* ``fit_cached``: ``SparkModel.fit`` on the same data as a cached, counted DataFrame;
* ``torch_distributor``: PyTorch DDP launched by ``TorchDistributor``, each rank reading its
  share of the Parquet files with pyarrow (the same model, batch size and epochs).

For every Spark phase it samples the driver's RSS (this Python process) every 20 ms and reports
the peak; the fit summaries give the peak RSS of each executor Python process
(``spark.python.worker.reuse`` is off, so each task's process is fresh). Goals: driver peak
flat within 200 MB from the small to the large size; ``fit_paths`` >= 0.8 of ``fit_cached``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from paraloom.bench.common import machine, plain_args, pyplot, save_figure, write_results

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from paraloom.spark import SparkModel

__all__ = ["add_arguments", "run", "RssSampler"]

FEATURES = 64
CLASSES = 10


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
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the large Parquet set")
    p.add_argument("--small-rows", type=int, default=100_000, help="rows of the small one")
    p.add_argument("--files", type=int, default=8, help="Parquet files per data set")
    p.add_argument("--data-averaging-frequency", type=int, default=500,
                   help="--mode data: minibatches per averaging round")
    p.add_argument("--data-contenders", default="ingest,fit_paths,fit_cached,torch_distributor")
    p.add_argument("--keep-data", default=None, help="a folder to keep the Parquet in")


def _generate(rows: int, files: int) -> Callable[[Iterator[Any]], Iterator[Any]]:
    def gen(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa  # type: ignore[import-untyped]

        w = np.random.default_rng(12345).normal(size=(FEATURES, CLASSES)).astype(np.float32)
        for batch in batches:
            ids = batch.column(0).to_numpy()
            if not len(ids):
                continue
            g = np.random.default_rng(int(ids[0]))
            x = g.random((len(ids), FEATURES), dtype=np.float32)
            y = ((x - 0.5) @ w).argmax(1).astype(np.int64)
            offsets = pa.array(np.arange(0, (len(ids) + 1) * FEATURES, FEATURES, dtype=np.int32))
            yield pa.RecordBatch.from_arrays(
                [pa.ListArray.from_arrays(offsets, pa.array(x.reshape(-1))), pa.array(y)],
                names=["features", "label"])

    return gen


def write_parquet(spark: SparkSession, path: str, rows: int, files: int) -> float:
    """``rows`` synthetic rows as ``files`` Parquet files, generated on the executors."""
    start = time.perf_counter()
    (spark.range(rows, numPartitions=files)
     .mapInArrow(_generate(rows, files), "features array<float>, label long")
     .write.mode("overwrite").parquet(path))
    return time.perf_counter() - start


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, CLASSES))


def _spark_model(spark: SparkSession, args: argparse.Namespace) -> SparkModel:
    from paraloom.spark import ParameterAveragingTrainingMaster, SparkModel

    model = _model()
    master = ParameterAveragingTrainingMaster(args.batch_size, args.data_averaging_frequency,
                                              args.workers)
    return SparkModel(spark, model, master, loss_fn=nn.CrossEntropyLoss(),
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))


def _fit_result(summary: dict[str, Any], seconds: float, rss: RssSampler) -> dict[str, Any]:
    return {"samples": summary["samples"], "seconds": seconds,
            "samples_per_s": summary["samples"] / seconds, "loss": summary["loss"],
            "driver_peak_rss_mb": rss.peak / 2**20,
            "driver_rss_growth_mb": (rss.peak - rss.start) / 2**20,
            "worker_peak_rss_mb": summary.get("worker_peak_rss_mb")}


def _ingest(spark: SparkSession, path: str) -> dict[str, Any]:
    from paraloom.spark.data import Columns, num_rows
    from paraloom.spark.data.arrow import arrow_chunks

    with RssSampler() as rss:
        start = time.perf_counter()
        chunks = arrow_chunks(spark.read.parquet(path), Columns.of("features", "label"))
        rows = chunks.map(lambda c: num_rows(c[0])).sum()
        seconds = time.perf_counter() - start
    return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds,
            "driver_peak_rss_mb": rss.peak / 2**20,
            "driver_rss_growth_mb": (rss.peak - rss.start) / 2**20}


def _fit_paths(spark: SparkSession, path: str, args: argparse.Namespace) -> dict[str, Any]:
    net = _spark_model(spark, args)
    with RssSampler() as rss:
        start = time.perf_counter()
        summary = net.fit_paths(path, epochs=args.epochs)
        seconds = time.perf_counter() - start
    return _fit_result(summary, seconds, rss)


def _fit_cached(spark: SparkSession, path: str, args: argparse.Namespace) -> dict[str, Any]:
    df = spark.read.parquet(path).cache()
    df.count()  # in memory before the clock starts
    try:
        net = _spark_model(spark, args)
        with RssSampler() as rss:
            start = time.perf_counter()
            summary = net.fit(df, epochs=args.epochs)
            seconds = time.perf_counter() - start
    finally:
        df.unpersist()
    return _fit_result(summary, seconds, rss)


def _parquet_batches(files: list[str], batch_size: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """Full minibatches of (features, label) tensors from Parquet files, read in order."""
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    held = 0
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=batch_size):
            feats = batch.column(0)
            xs.append(feats.flatten().to_numpy().reshape(len(feats), FEATURES))
            ys.append(batch.column(1).to_numpy())
            held += batch.num_rows
            while held >= batch_size:
                x, y = np.concatenate(xs), np.concatenate(ys)
                yield torch.from_numpy(x[:batch_size]), torch.from_numpy(y[:batch_size])
                xs, ys, held = [x[batch_size:]], [y[batch_size:]], held - batch_size


def ddp_parquet(path: str, batch_size: int, epochs: int) -> dict[str, Any]:
    """One TorchDistributor rank: DDP on every world-th Parquet file, read with pyarrow."""
    import pyarrow.parquet as pq
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    files = sorted(str(p) for p in Path(path).glob("*.parquet"))[rank::world]
    model = nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    # Every rank must take the same number of steps: agree on the smallest share.
    rows = torch.tensor([sum(pq.ParquetFile(f).metadata.num_rows for f in files)])
    dist.all_reduce(rows, op=dist.ReduceOp.MIN)
    steps = int(rows.item()) // batch_size
    start, samples = time.perf_counter(), 0
    for _ in range(epochs):
        for x, y in itertools.islice(_parquet_batches(files, batch_size), steps):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            samples += batch_size * world
    dist.barrier()
    seconds = time.perf_counter() - start
    dist.destroy_process_group()
    return {"samples": samples, "loop_seconds": seconds}


def _torch_distributor(spark: SparkSession, path: str, args: argparse.Namespace) -> dict[str, Any]:
    from pyspark.ml.torch.distributor import TorchDistributor

    distributor = TorchDistributor(num_processes=args.workers, local_mode=True, use_gpu=False)
    with RssSampler() as rss:
        start = time.perf_counter()
        out = distributor.run(ddp_parquet, path, args.batch_size, args.epochs)
        seconds = time.perf_counter() - start
    if out is None:
        raise RuntimeError("TorchDistributor returned no result from rank 0")
    return {"samples": out["samples"], "seconds": seconds,
            "samples_per_s": out["samples"] / seconds,
            "train_samples_per_s": out["samples"] / out["loop_seconds"],
            "driver_peak_rss_mb": rss.peak / 2**20,
            "driver_rss_growth_mb": (rss.peak - rss.start) / 2**20}


def run(args: argparse.Namespace) -> int:
    from paraloom.spark.cli import session

    args = plain_args(args)
    spark, created = session(args.master, {"spark.python.worker.reuse": "false",
                                           "spark.sql.shuffle.partitions": str(args.workers)})
    spark.sparkContext.setLogLevel("ERROR")
    base = args.keep_data or tempfile.mkdtemp(prefix="paraloom-bench-spark-")
    results: dict[str, Any] = {"machine": machine(), "config": vars(args).copy(),
                               "load_average": os.getloadavg(), "sizes": {}}
    runners = {"ingest": lambda p: _ingest(spark, p),
               "fit_paths": lambda p: _fit_paths(spark, p, args),
               "fit_cached": lambda p: _fit_cached(spark, p, args),
               "torch_distributor": lambda p: _torch_distributor(spark, p, args)}
    names = [c.strip() for c in args.data_contenders.split(",") if c.strip()]
    unknown = sorted(set(names) - set(runners))
    if unknown:
        raise SystemExit(f"unknown --data-contenders {unknown}; expected {sorted(runners)}")
    try:
        for rows in sorted({args.small_rows, args.rows}):
            path = os.path.join(base, f"rows-{rows}")
            size: dict[str, Any] = {"write_seconds": write_parquet(spark, path, rows, args.files)}
            for name in names:
                size[name] = runners[name](path)
                print(f"{rows:>9} rows  {name:<18} {_brief(size[name])}", flush=True)
            results["sizes"][str(rows)] = size
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


def _brief(r: dict[str, Any]) -> str:
    speed = r.get("samples_per_s") or r.get("rows_per_s")
    worker = r.get("worker_peak_rss_mb")
    return (f"{speed:>10.0f}/s  {r['seconds']:6.1f} s  driver peak {r['driver_peak_rss_mb']:.0f} MB"
            + (f"  worker peak {worker:.0f} MB" if worker else ""))


def _goals(sizes: dict[str, Any]) -> dict[str, Any]:
    keys = sorted(sizes, key=int)
    small, large = sizes[keys[0]], sizes[keys[-1]]
    phases = [n for n in ("ingest", "fit_paths", "fit_cached", "torch_distributor") if n in large]
    out: dict[str, Any] = {}
    if phases:
        growth = max(large[n]["driver_peak_rss_mb"] for n in phases) - \
            max(small[n]["driver_peak_rss_mb"] for n in phases)
        out["driver_peak_growth_mb"] = round(growth, 1)
        out["driver_flat_within_200mb"] = growth <= 200
    if "fit_paths" in large and "fit_cached" in large:
        ratio = large["fit_paths"]["samples_per_s"] / large["fit_cached"]["samples_per_s"]
        out["fit_paths_over_fit_cached"] = round(ratio, 3)
        out["parquet_at_least_0.8"] = ratio >= 0.8
    if "fit_paths" in large and "fit_paths" in small:
        out["worker_peak_rss_mb"] = {k: sizes[k]["fit_paths"]["worker_peak_rss_mb"]
                                     for k in keys}
    if "torch_distributor" in large and "fit_paths" in large:
        out["fit_paths_over_torch_distributor"] = round(
            large["fit_paths"]["samples_per_s"] / large["torch_distributor"]["samples_per_s"], 3)
    return out


def _plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    sizes = sorted(results["sizes"], key=int)
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["fit_paths", "fit_cached", "torch_distributor"]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [results["sizes"][s].get(name, {}).get("samples_per_s", 0) for s in sizes]
        speed.bar([j + i * width for j in range(len(sizes))], values, width, label=name)
    speed.set_xticks([j + width for j in range(len(sizes))], [f"{int(s):,} rows" for s in sizes])
    speed.set_ylabel("training samples/s (whole call)")
    speed.legend()
    phases = ["ingest", "fit_paths", "fit_cached", "torch_distributor"]
    for name in phases:
        values = [results["sizes"][s].get(name, {}).get("driver_peak_rss_mb") for s in sizes]
        if all(v is not None for v in values):
            memory.plot([int(s) for s in sizes], values, marker="o", label=f"driver, {name}")
    workers = [results["sizes"][s].get("fit_paths", {}).get("worker_peak_rss_mb") for s in sizes]
    if all(workers):
        memory.plot([int(s) for s in sizes], workers, marker="s", linestyle="--",
                    label="Python worker, fit_paths")
    memory.set_xscale("log")
    memory.set_xlabel("rows")
    memory.set_ylabel("peak RSS (MB)")
    memory.set_ylim(bottom=0)
    memory.legend(fontsize=8)
    fig.suptitle(f"Spark at data scale ({results['config']['master']}, "
                 f"load {results['load_average'][0]:.1f})")
    save_figure(fig, path)
