"""The TorchDistributor contender of ``paraloom bench spark --mode data``, and the benchmark's
data: synthetic rows (64 float features, a class the features determine) written as Parquet
from the executors, and read back with pyarrow.

``ddp_parquet`` is one TorchDistributor rank: PyTorch DDP (gloo) on its share of the Parquet
files, each rank reading its files with pyarrow straight into the training loop, as a user of
TorchDistributor would write it.
"""

from __future__ import annotations

import itertools
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["FEATURES", "CLASSES", "bench_model", "write_parquet", "parquet_arrays",
           "accuracy", "ddp_parquet"]

FEATURES = 64
CLASSES = 10


def bench_model() -> nn.Module:
    """The model every contender trains (the same initial weights)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, CLASSES))


def _generate(batches: Iterator[Any]) -> Iterator[Any]:
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


def write_parquet(spark: SparkSession, path: str, rows: int, files: int, first: int = 0) -> float:
    """Rows ``first .. first+rows-1`` of the synthetic set as ``files`` Parquet files,
    generated on the executors; returns the seconds it took."""
    start = time.perf_counter()
    (spark.range(first, first + rows, numPartitions=files)
     .mapInArrow(_generate, "features array<float>, label long")
     .write.mode("overwrite").parquet(path))
    return time.perf_counter() - start


def parquet_arrays(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Every row of the Parquet files under ``path``: features (n, 64) and labels (n,)."""
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    table = pq.read_table(path, columns=["features", "label"])
    x = table.column("features").combine_chunks().flatten().to_numpy()
    return x.reshape(-1, FEATURES), table.column("label").to_numpy()


def accuracy(model: nn.Module, rows: tuple[np.ndarray, np.ndarray]) -> float:
    """Share of ``rows`` the model classifies right."""
    with torch.no_grad():
        predicted = model(torch.from_numpy(np.array(rows[0]))).argmax(1).numpy()
    return float((predicted == rows[1]).mean())


def _parquet_batches(files: list[str], batch_size: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """Full minibatches of (features, label) tensors from Parquet files, read in order."""
    import pyarrow.parquet as pq

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


def ddp_parquet(path: str, batch_size: int, epochs: int, started: float) -> dict[str, Any]:
    """One TorchDistributor rank: DDP on every world-th Parquet file, read with pyarrow.
    ``started``: the driver's clock when the run began (for the time to the first step)."""
    import pyarrow.parquet as pq
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    files = sorted(str(p) for p in Path(path).glob("*.parquet"))[rank::world]
    model = nn.parallel.DistributedDataParallel(bench_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    # Every rank must take the same number of steps: agree on the smallest share.
    rows = torch.tensor([sum(pq.ParquetFile(f).metadata.num_rows for f in files)])
    dist.all_reduce(rows, op=dist.ReduceOp.MIN)
    steps = int(rows.item()) // batch_size
    start, samples, first_step = time.perf_counter(), 0, None
    for _ in range(epochs):
        for x, y in itertools.islice(_parquet_batches(files, batch_size), steps):
            if first_step is None:
                first_step = time.time() - started
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            samples += batch_size * world
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                         int((first_step or 0.0) * 1e6)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    dist.destroy_process_group()
    return {"samples": samples, "loop_seconds": seconds, "worker_peak_rss_mb": peak[0].item()
            / 2**20, "seconds_to_first_step": peak[1].item() / 1e6, "state": state}

