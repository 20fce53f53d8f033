"""One ParameterAveragingTrainingMaster task: load the averaging round's parameters, train,
return them with the example count.

An ordinary (non-barrier) Spark task: it talks to no peer, so Spark retries it on its own when
it fails. ``treeAggregate`` adds what the tasks return (``add_results``) as float64 vectors
*multiplied by each task's example count*, so that the driver's total, divided by the total
count, is the example-weighted average.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import zip_longest
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

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
from paraloom.spark.runtime.executor import reset_peak_rss
from paraloom.spark.runtime.state import Layout, OptimizerState, Packed
from paraloom.spark.stats import PhaseRecorder, WorkerStats
from paraloom.spark.training.diloco_task import (
    dense_delta,
    diloco_sums,
    keep_state,
    load_local,
    save_local,
    trainable_names,
    updated_state,
)
from paraloom.spark.training.messages import AveragingSums
from paraloom.spark.training.task import batch_tensors, load_spec, make_runner
from paraloom.sync.pseudo_gradients import TopK
from paraloom.training.messages import Begin, Round
from paraloom.training.runner import ReplicaRunner

if TYPE_CHECKING:
    from pyspark import Broadcast

__all__ = ["AveragingRound", "averaging_task", "add_results", "weighted"]


@dataclass(frozen=True)
class AveragingRound:
    """One averaging round (one Spark job): which minibatches each partition trains, and how.

    Every partition trains its next ``frequency`` minibatches (DL4J's averagingFrequency),
    starting from the parameters the driver broadcast; the driver then averages the results.
    """

    fit_id: str
    epoch: int
    index: int
    """Which averaging round of the epoch: each partition trains its minibatches from
    ``index * frequency`` on."""
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
    encoding: TopK | None = None
    """DiLoCo (``diloco_task``): how the pseudo-gradient travels; None: plain averaging."""
    sequence: int = 0
    """This averaging round's number in the fit (epochs included): DiLoCo's local files."""
    drop_last: bool = False
    """Whether a partition's short last minibatch is left out."""
    update: Broadcast[bytes] | None = None
    """DiLoCo: the sparse update from the last round's shared state to this one's
    (``diloco.state_update``), read instead of the full state where this machine kept it."""


def _runner(spec_bytes: bytes, cfg: AveragingRound,
            index: int) -> tuple[ReplicaRunner, OptimizerState]:
    """This worker's replica for the fit, and the optimizer state it was built with.

    One replica per executor Python process and fit: averaging rounds reload its parameters,
    not its structure. The built-with state is what DL4J's saveUpdater=false restarts from
    every averaging round.
    """
    def build() -> tuple[ReplicaRunner, OptimizerState]:
        runner = make_runner(load_spec(spec_bytes), rank=index, world_size=1, device="cpu",
                             recorder=None)
        return runner, copy.deepcopy(runner.replica.optimizer.state_dict())

    return cached(f"averaging/{cfg.fit_id}", build)


def _read(data: bytes | Broadcast[bytes]) -> bytes:
    """The bytes themselves, or a broadcast variable's (fetched on first use)."""
    return data if isinstance(data, bytes) else data.value


def _drain(source: Iterator[Chunk]) -> None:
    """Read the rest of the partition, so that Spark can reuse this Python process."""
    for _ in source:
        pass


def _stats(rec: PhaseRecorder, cfg: AveragingRound) -> tuple[WorkerStats, ...]:
    return (rec.to_dict(),) if cfg.collect_stats else ()


def averaging_task(spec_bytes: bytes | Broadcast[bytes], state_bytes: bytes | Broadcast[bytes],
                   cfg: AveragingRound, index: int,
                   chunks: Iterable[Chunk]) -> Iterator[AveragingSums]:
    """Train partition ``index``'s minibatches of this averaging round; yield its one record.

    ``spec_bytes`` / ``state_bytes`` may be broadcast variables (read on first use here).
    """
    task_threads(cfg.threads)
    reset_peak_rss()  # a reused Python process: this task's peak, not its earlier tasks'
    rec = PhaseRecorder(index, cfg.origin)
    begin, t = rec.now(), time.perf_counter()
    source = iter(chunks)
    batches = stream_batches(source, cfg.batch_size, seed=cfg.seed, epoch=cfg.epoch, rank=index,
                             window_rows=cfg.window_rows, first=cfg.index * cfg.frequency,
                             count=cfg.frequency, drop_last=cfg.drop_last)
    head = next(batches, None)
    data_s = time.perf_counter() - t
    if head is None:  # a short partition in a late averaging round: nothing to average in
        _drain(source)
        yield AveragingSums(0, stats=_stats(rec, cfg), peak_rss=peak_rss())
        return
    t = time.perf_counter()
    packed, received = _shared_state(state_bytes, cfg)
    spec = _read(spec_bytes)
    communicate_s, t = time.perf_counter() - t, time.perf_counter()
    runner, pristine = _runner(spec, cfg, index)
    runner.begin(Begin(packed.model))
    local = load_local(cfg.fit_id, index, cfg.sequence) if cfg.encoding else None
    inner = local.get("optimizer") if local and cfg.save_updater else None
    runner.replica.optimizer.load_state_dict(inner or packed.optimizer or
                                             copy.deepcopy(pristine))
    apply_s = time.perf_counter() - t
    loss_sum, rows_total = _train(runner, itertools.chain([head], batches), cfg, rec, begin,
                                  {"data": data_s, "communicate": communicate_s,
                                   "apply": apply_s})
    _drain(source)
    t = time.perf_counter()
    if cfg.encoding is None:
        sums = _sums(runner, rows_total, loss_sum, cfg)
    else:
        sums = _pseudo_sums(runner, packed.model, local, cfg, index)
        sums = replace(sums, n=rows_total, loss_sum=loss_sum, steps=runner.steps)
    rec.columns["encode"][-1] += round(time.perf_counter() - t, 6)
    yield replace(sums, stats=_stats(rec, cfg), bytes_received=received, peak_rss=peak_rss())


def _shared_state(state_bytes: bytes | Broadcast[bytes], cfg: AveragingRound
                  ) -> tuple[Packed, int]:
    """The round's parameters (and optimizer state), and the bytes read for them: with DiLoCo,
    the sparse update where this machine kept the last round's state (the full broadcast is
    then never fetched), else the full state; DiLoCo keeps it for the next round."""
    if cfg.update is not None:
        update = cfg.update.value
        model = updated_state(cfg.fit_id, cfg.sequence, update)
        if model is not None:
            return Packed(model=model), len(update)
    state = _read(state_bytes)
    packed = unpack(state)
    if cfg.encoding is not None:
        keep_state(cfg.fit_id, cfg.sequence, packed.model)
    return packed, len(state)


def _train(runner: ReplicaRunner, batches: Iterator[Pair], cfg: AveragingRound,
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


def _sums(runner: ReplicaRunner, n: int, loss_sum: float, cfg: AveragingRound) -> AveragingSums:
    """The trained replica's vectors (not yet weighted) and counts."""
    runner.finish(with_state=False)
    state, optimizer_state = runner.final_state()
    model, layout = flatten(state)
    optimizer, optimizer_layout, skeleton = None, None, None
    if cfg.save_updater:
        tensors, skeleton = split_optimizer_state(optimizer_state)
        optimizer, optimizer_layout = flatten(tensors)
    sent = model.nbytes + (optimizer.nbytes if optimizer is not None else 0)
    return AveragingSums(n, loss_sum, runner.steps, model, layout, optimizer, optimizer_layout,
                         skeleton, bytes_sent=sent)


def _pseudo_sums(runner: ReplicaRunner, anchor: dict[str, torch.Tensor],
                 local: dict[str, Any] | None, cfg: AveragingRound, index: int
                 ) -> AveragingSums:
    """DiLoCo: the trained replica's pseudo-gradient message; its residual and (with
    ``save_updater``) its inner optimizer's state kept on this machine for the next round."""
    assert cfg.encoding is not None
    runner.finish(with_state=False)
    state, optimizer_state = runner.final_state()
    residual = local.get("residual") if local else None
    sums, kept = diloco_sums(anchor, state, trainable_names(runner.replica.model),
                             residual if isinstance(residual, torch.Tensor) else None,
                             cfg.encoding)
    record: dict[str, Any] = {}
    if kept is not None:
        record["residual"] = kept
    if cfg.save_updater:
        record["optimizer"] = optimizer_state
    if record:
        save_local(cfg.fit_id, index, cfg.sequence, record)
    return sums


def _times(vector: np.ndarray | None, n: int) -> np.ndarray | None:
    return None if vector is None else vector.astype(np.float64) * n


def weighted(sums: AveragingSums) -> AveragingSums:
    """``sums`` with its vectors turned into float64 sums weighted by its example count.

    Tasks send their plain vectors (float32 for float32 models: half the bytes); the sums,
    inside treeAggregate and on the driver, are float64.
    """
    if sums.weighted:
        return sums
    pseudo = dense_delta(sums.delta) if sums.delta is not None else sums.pseudo
    return replace(sums, model=_times(sums.model, sums.n),
                   optimizer=_times(sums.optimizer, sums.n), pseudo=_times(pseudo, sums.n),
                   delta=None, weighted=True)


def _check_layouts(a: AveragingSums, b: AveragingSums) -> None:
    """Vectors add up only when every replica flattened the same tensors in the same order."""
    pairs: tuple[tuple[str, Layout | None, Layout | None], ...] = (
        ("layout", a.layout, b.layout),
        ("optimizer layout", a.optimizer_layout, b.optimizer_layout))
    for what, x, y in pairs:
        if x != y:
            first = next(((u, v) for u, v in zip_longest(x or [], y or []) if u != v), (x, y))
            raise ValueError(f"two partitions returned {what}s that differ (first difference: "
                             f"{first[0]} against {first[1]}); every replica must train the "
                             f"same model with the same optimizer")


def _plus(into: np.ndarray | None, other: np.ndarray | None) -> np.ndarray | None:
    """``into + other``, added in place: ``into`` is the accumulator's own weighted vector."""
    if into is not None and other is not None:
        into += other
    return into


def add_results(a: AveragingSums | None, b: AveragingSums | None) -> AveragingSums | None:
    """treeAggregate's combiner: sums of weighted vectors and counts; stats joined."""
    if a is None:
        return b
    if b is None:
        return a
    a, b = weighted(a), weighted(b)
    peak, stats = max(a.peak_rss, b.peak_rss), a.stats + b.stats
    if not b.n:
        return replace(a, peak_rss=peak, stats=stats)
    if not a.n:
        return replace(b, peak_rss=peak, stats=stats)
    _check_layouts(a, b)
    return replace(a, n=a.n + b.n, loss_sum=a.loss_sum + b.loss_sum, steps=a.steps + b.steps,
                   model=_plus(a.model, b.model), optimizer=_plus(a.optimizer, b.optimizer),
                   pseudo=_plus(a.pseudo, b.pseudo),
                   bytes_received=a.bytes_received + b.bytes_received,
                   bytes_sent=a.bytes_sent + b.bytes_sent, peak_rss=peak, stats=stats)
