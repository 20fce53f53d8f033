"""One ParameterAveragingTrainingMaster task: load the round's parameters, train, return sums.

An ordinary (non-barrier) Spark task: it talks to no peer, so Spark retries it on its own when
it fails. It returns its parameters (and optimizer state) *multiplied by its example count*, so
that the driver's ``treeAggregate`` of these records, divided by the total count, is the
example-weighted average.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import zip_longest
from typing import TYPE_CHECKING, Any

import numpy as np

from paraloom.spark.data import Chunk, Features, Pair
from paraloom.spark.data.stream import stream_batches
from paraloom.spark.runtime import (
    cached,
    flatten,
    peak_rss,
    split_optimizer_state,
    task_threads,
    unpack,
)
from paraloom.spark.stats import PhaseRecorder
from paraloom.spark.training.task import batch_tensors, load_spec, make_runner
from paraloom.training.messages import Begin, Round
from paraloom.training.runner import ReplicaRunner

if TYPE_CHECKING:
    from pyspark import Broadcast

__all__ = ["RoundConfig", "averaging_task", "add_results", "weighted"]


@dataclass(frozen=True)
class RoundConfig:
    """One averaging round: which minibatches each partition trains, and how."""

    fit_id: str
    epoch: int
    round: int
    batch_size: int
    frequency: int
    seed: int
    origin: float
    features: Features
    save_updater: bool = True
    threads: int | None = None
    collect_stats: bool = False
    window_rows: int = 512
    """Rows a task shuffles and holds at once (``prefetch_batches`` minibatches)."""


def _runner(spec_bytes: bytes, cfg: RoundConfig,
            index: int) -> tuple[ReplicaRunner, dict[str, Any]]:
    """This worker's replica for the fit, and the optimizer state it was built with.

    One replica per Python worker and fit: rounds reload its parameters, not its structure.
    The built-with state is what DL4J's saveUpdater=false restarts from every round.
    """
    def build() -> tuple[ReplicaRunner, dict[str, Any]]:
        runner = make_runner(load_spec(spec_bytes), rank=index, world_size=1, device="cpu",
                             recorder=None)
        return runner, copy.deepcopy(runner.replica.optimizer.state_dict())

    return cached(f"averaging/{cfg.fit_id}", build)


def _read(data: bytes | Broadcast[bytes]) -> bytes:
    """The bytes themselves, or a broadcast variable's (fetched on first use)."""
    return data if isinstance(data, bytes) else data.value


def averaging_task(spec_bytes: bytes | Broadcast[bytes], state_bytes: bytes | Broadcast[bytes],
                   cfg: RoundConfig, index: int,
                   chunks: Iterable[Chunk]) -> Iterator[dict[str, Any]]:
    """Train partition ``index``'s minibatches of this round; yield one summable record.

    ``spec_bytes`` / ``state_bytes`` may be broadcast variables (read on first use here).
    """
    task_threads(cfg.threads)
    rec = PhaseRecorder(index, cfg.origin)
    begin, t = rec.now(), time.perf_counter()
    source = iter(chunks)
    batches = stream_batches(source, cfg.batch_size, seed=cfg.seed, epoch=cfg.epoch, rank=index,
                             window_rows=cfg.window_rows, first=cfg.round * cfg.frequency,
                             count=cfg.frequency)
    head = next(batches, None)
    data_s = time.perf_counter() - t
    if head is None:  # a short partition in a late round: nothing to average in
        for _ in source:  # read to the end, so that Spark can reuse this Python worker
            pass
        yield {"n": 0, "stats": [rec.to_dict()] if cfg.collect_stats else [],
               "peak_rss": peak_rss()}
        return
    t = time.perf_counter()
    state = _read(state_bytes)
    spec = _read(spec_bytes)
    communicate_s, t = time.perf_counter() - t, time.perf_counter()
    runner, pristine = _runner(spec, cfg, index)
    packed = unpack(state)
    runner.begin(Begin(packed.model))
    runner.replica.optimizer.load_state_dict(packed.optimizer or copy.deepcopy(pristine))
    apply_s = time.perf_counter() - t
    loss_sum, rows_total = _train(runner, itertools.chain([head], batches), cfg, rec, begin,
                                  {"data": data_s, "communicate": communicate_s,
                                   "apply": apply_s})
    for _ in source:  # the rest of the partition: read past, so that the worker is reused
        pass
    t = time.perf_counter()
    record = _record(runner, rows_total, loss_sum, cfg)
    rec.columns["encode"][-1] += round(time.perf_counter() - t, 6)
    record["stats"] = [rec.to_dict()] if cfg.collect_stats else []
    record["bytes_received"] = len(state)
    record["peak_rss"] = peak_rss()
    yield record


def _train(runner: ReplicaRunner, batches: Iterator[Pair], cfg: RoundConfig,
           rec: PhaseRecorder, begin: float, first: dict[str, float]) -> tuple[float, int]:
    loss_sum, rows_total = 0.0, 0
    i = 0
    while True:
        start = begin if i == 0 else rec.now()
        t = time.perf_counter()
        arrays = next(batches, None)
        if arrays is None:
            break
        batch = batch_tensors(arrays, cfg.features)
        data_s, t = time.perf_counter() - t, time.perf_counter()
        done = runner.train(Round(i, batch))
        loss, rows = done.loss, done.rows
        extra = first if i == 0 else {}
        rec.add(start, compute=time.perf_counter() - t,
                **{**extra, "data": data_s + extra.get("data", 0.0)})
        loss_sum += float(loss or 0.0) * rows
        rows_total += rows
        i += 1
    return loss_sum, rows_total


def _record(runner: ReplicaRunner, n: int, loss_sum: float, cfg: RoundConfig) -> dict[str, Any]:
    runner.finish(with_state=False)
    state, optimizer_state = runner.final_state()
    model, layout = flatten(state)
    record: dict[str, Any] = {"n": n, "loss_sum": loss_sum, "model": model, "layout": layout,
                              "steps": runner.steps, "weighted": False}
    if cfg.save_updater:
        tensors, skeleton = split_optimizer_state(optimizer_state)
        opt, opt_layout = flatten(tensors)
        record.update(optimizer=opt, optimizer_layout=opt_layout, skeleton=skeleton)
    record["bytes_sent"] = sum(v.nbytes for k, v in record.items() if k in ("model", "optimizer"))
    return record


def weighted(record: dict[str, Any]) -> dict[str, Any]:
    """The record with its vectors turned into float64 sums weighted by its example count.

    Tasks send their plain vectors (float32 for float32 models: half the bytes); the sums,
    inside treeAggregate and on the driver, are float64.
    """
    if record.get("weighted", True):
        return record
    for key in ("model", "optimizer"):
        if key in record:
            record[key] = record[key].astype(np.float64) * record["n"]
    record["weighted"] = True
    return record


def add_results(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """treeAggregate's combiner: sums of weighted vectors and counts; stats lists joined."""
    if a is None:
        return b
    if b is None:
        return a
    a, b = weighted(a), weighted(b)
    a["peak_rss"] = b["peak_rss"] = max(a.get("peak_rss", 0), b.get("peak_rss", 0))
    if not b["n"]:
        a["stats"] = a.get("stats", []) + b.get("stats", [])
        return a
    if not a["n"]:
        b["stats"] = a.get("stats", []) + b.get("stats", [])
        return b
    for key in ("layout", "optimizer_layout"):
        if a.get(key) != b.get(key):
            first = next(((x, y) for x, y in zip_longest(a.get(key) or [], b.get(key) or [])
                          if x != y), (a.get(key), b.get(key)))
            raise ValueError(f"two partitions returned {key.replace('_', ' ')}s that differ "
                             f"(first difference: {first[0]} against {first[1]}); every "
                             f"replica must train the same model with the same optimizer")
    a["model"] += b["model"]
    if "optimizer" in a:
        a["optimizer"] += b["optimizer"]
    for key in ("n", "loss_sum", "steps", "bytes_received", "bytes_sent"):
        a[key] = a.get(key, 0) + b.get(key, 0)
    a["stats"] = a.get("stats", []) + b.get("stats", [])
    return a
