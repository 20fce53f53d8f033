"""The body of one SharedTrainingMaster barrier task: rendezvous, train every epoch, report.

Spark-free (the barrier context is passed in), so it also runs under a fake context in plain
processes. Every wait is bounded (``rendezvous_timeout_s`` for the one allGather,
``timeout_s`` for every collective). How failures end (details in ``board.py``):

* a Python error in one rank (bad data, a loss that raises, NaN) is posted on rank 0's store
  and reported in a ``WorkerFailed`` record; its peers find it there and report it too. The stage
  completes, and the driver raises that error: a retry would only repeat it.
* a rank that dies (killed process, lost executor) fails its task, and so do its peers, which
  find nothing posted; Spark re-runs the whole barrier stage, whose rank 0 resumes from its
  last checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from paraloom.devices import task_device
from paraloom.safetensors_files import atomic_write
from paraloom.spark.data import Chunk, Features, batch_count
from paraloom.spark.data.sources import StreamedPartition, TaskData
from paraloom.spark.data.stream import stream_batches
from paraloom.spark.runtime import (
    Packed,
    gpu_addresses,
    pack,
    peak_rss,
    state_digest,
    task_threads,
    unpack,
)
from paraloom.spark.runtime.executor import reset_peak_rss
from paraloom.spark.stats import PhaseRecorder, split_round, timed_collectives
from paraloom.spark.training.board import ErrorBoard, leave_group, settle
from paraloom.spark.training.messages import (
    TaskRecord,
    WorkerFailed,
    WorkerFinished,
    WorkerReport,
    WorkerRerun,
)
from paraloom.spark.training.rendezvous import (
    BarrierContext,
    NetworkSettings,
    Rendezvous,
    connect,
    init_group,
    local_rank,
    meet,
)
from paraloom.spark.training.rounds import agree_rounds, epoch_rounds
from paraloom.spark.training.task import EpochLoss, batch_tensors, failure, load_spec, make_runner
from paraloom.training.messages import Begin, IdleRound, Round
from paraloom.training.runner import ReplicaRunner

__all__ = ["SharedConfig", "shared_task", "checkpoint_path"]

_DEBUG = os.environ.get("PARALOOM_SPARK_DEBUG", "") not in ("", "0")


def _debug(rank: int, message: str) -> None:
    """With PARALOOM_SPARK_DEBUG=1, a progress line on stderr (the executor's log)."""
    if _DEBUG:
        print(f"[paraloom {time.strftime('%H:%M:%S')} pid {os.getpid()} rank {rank}] {message}",
              file=sys.stderr, flush=True)


@dataclass(frozen=True)
class SharedConfig:
    """Everything a barrier task needs besides the spec, the state and its rows."""

    fit_id: str
    world_size: int
    epochs: int
    batch_size: int
    seed: int
    origin: float
    features: Features
    timeout_s: float = 300.0
    rendezvous_timeout_s: float = 300.0
    backend: str | None = None
    threads: int | None = None
    """torch threads per task; None: ``cpu_count // workers_per_node``, else spark.task.cpus."""
    workers_per_node: int | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 50
    collect_stats: bool = False
    network: NetworkSettings | None = None
    window_rows: int = 512
    """Rows a task shuffles and holds at once (``prefetch_batches`` minibatches)."""
    drop_last: bool = False
    """Whether a partition's short last minibatch is left out."""


def checkpoint_path(directory: str, fit_id: str) -> Path:
    """Where rank 0 keeps this fit's latest checkpoint."""
    return Path(directory) / f"paraloom-{fit_id}.safetensors"


@dataclass
class _Prepared:
    runner: ReplicaRunner
    start: Packed
    data: TaskData
    """This rank's rows, read once per epoch."""
    device: str
    backend: str


def _prepare(spec_bytes: bytes, state_bytes: bytes, cfg: SharedConfig, context: BarrierContext,
             load: Callable[[], TaskData], rec: PhaseRecorder) -> _Prepared:
    rank = context.partitionId()
    threads = cfg.threads
    if threads is None and cfg.workers_per_node:
        threads = max(1, (os.cpu_count() or 1) // cfg.workers_per_node)
    task_threads(threads)
    begin, t = rec.now(), time.perf_counter()
    data = load()
    rec.event("load data", begin, time.perf_counter() - t)
    _debug(rank, f"{data.rows} rows ({type(data).__name__})")
    local, per_host = local_rank([info.address for info in context.getTaskInfos()], rank)
    device, backend = task_device(local, per_host, gpu_addresses(), cfg.backend)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    runner = make_runner(load_spec(spec_bytes), rank=rank, world_size=cfg.world_size,
                         device=device, recorder=rec if cfg.collect_stats else None)
    return _Prepared(runner, unpack(state_bytes), data, device, backend)


def shared_task(spec_bytes: bytes, state_bytes: bytes, cfg: SharedConfig,
                context: BarrierContext, chunks: Iterable[Chunk],
                source: Callable[[], TaskData] | None = None) -> Iterator[TaskRecord]:
    """Train this rank's replica on its rows for every epoch; yield its one record.

    The rows are ``chunks`` (the task's partition: trained on as it arrives, and stored on
    local disk on the way for the later epochs), or what ``source`` returns (then ``chunks`` is
    read through and dropped).
    """
    if source is None:
        def source() -> TaskData:
            return StreamedPartition(chunks)
    else:
        for _ in chunks:
            pass
    reset_peak_rss()  # a reused Python process: this task's peak, not its earlier tasks'
    rank = context.partitionId()
    tasks = len(context.getTaskInfos())
    _debug(rank, f"task started (fit {cfg.fit_id}, {tasks} task(s))")
    if tasks != cfg.world_size:
        # Spark re-ran only some partitions: the others completed this fit (see board.py).
        yield WorkerRerun(rank, tasks)
        return
    rec = PhaseRecorder(rank, cfg.origin)
    prepared, setup_error, setup_tb = None, None, None
    try:
        prepared = _prepare(spec_bytes, state_bytes, cfg, context, source, rec)
    except Exception as e:  # announced at the rendezvous so that no peer waits for us
        setup_error, setup_tb = f"{type(e).__name__}: {e}", traceback.format_exc()
    _debug(rank, f"set up ({setup_error or 'ok'}); rendezvous")
    begin, t = rec.now(), time.perf_counter()
    rdv, store = meet(context, setup_error, cfg.rendezvous_timeout_s, cfg.network)
    rec.event("rendezvous", begin, time.perf_counter() - t)
    _debug(rank, f"met: store {rdv.host}:{rdv.port}, run {rdv.run_id}, errors {rdv.errors}")
    if rdv.errors or prepared is None:
        if prepared is not None:
            prepared.data.close()
        yield _setup_failure(rank, setup_error, setup_tb, rdv.errors)
        return
    record = _train_in_group(prepared, cfg, rank, rec, rdv, store)
    _debug(rank, f"done: {'error' if isinstance(record, WorkerFailed) else 'ok'}")
    yield record


def _train_in_group(p: _Prepared, cfg: SharedConfig, rank: int, rec: PhaseRecorder,
                    rdv: Rendezvous, store: TCPStore | None) -> WorkerFinished | WorkerFailed:
    """Join the stage attempt's process group, train, leave it; a Python error becomes this
    rank's record, its own or a peer's (``settle``), and a dead peer fails the task."""
    board = None
    network = cfg.network or NetworkSettings()
    # gloo binds to the interface as the group forms, NCCL at its first collective: the
    # variables stay set until the task ends.
    with network.interface_env():
        try:
            begin, t = rec.now(), time.perf_counter()
            group_store = store or connect(rdv, cfg.timeout_s)
            board = ErrorBoard(group_store, rank, cfg.world_size, rdv.run_id)
            init_group(rdv, rank, cfg.world_size, p.backend, cfg.timeout_s, group_store)
            rec.event("process group", begin, time.perf_counter() - t)
            return _train(p, cfg, rank, rec, f"{rdv.host}:{rdv.port}")
        except Exception as e:
            _debug(rank, f"failed: {type(e).__name__}: {e}")
            return settle(e, board, rank)  # re-raises when a peer died: Spark re-runs it
        finally:
            leave_group()
            p.data.close()


def _setup_failure(rank: int, error: str | None, tb: str | None,
                   announced: tuple[tuple[int, str], ...]) -> WorkerFailed:
    """This rank's record when some rank could not set up: its own error (in its setup, or
    in the rendezvous itself, e.g. no free port or no such interface), else the first
    announced one, relayed (so the driver names the cause, not "a peer failed")."""
    own = dict(announced).get(rank)
    if error or own:
        return failure(rank, error or own or "", tb)
    cause, message = announced[0]
    return failure(rank, message, cause_rank=cause)


def _resume(cfg: SharedConfig, rank: int, device: str) -> Packed | None:
    """Rank 0's latest checkpoint of this fit, broadcast to every rank (None: start afresh)."""
    data = b""
    if rank == 0 and cfg.checkpoint_dir:
        path = checkpoint_path(cfg.checkpoint_dir, cfg.fit_id)
        if path.exists():
            data = path.read_bytes()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if int(size.item()) == 0:
        return None
    if rank == 0:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=0)
    packed = unpack(buf.cpu().numpy().tobytes())
    if packed.meta.get("fit_id") != cfg.fit_id:
        raise ValueError(f"checkpoint of fit {packed.meta.get('fit_id')!r} found where fit "
                         f"{cfg.fit_id!r} was expected; clear the checkpoint_dir")
    return packed


def _checkpoint(p: _Prepared, cfg: SharedConfig, position: dict[str, int]) -> None:
    assert cfg.checkpoint_dir is not None
    replica = p.runner.replica
    sync_state = _jsonable(replica.sync.state_dict())
    data = pack(replica.model_state(), replica.optimizer.state_dict(),
                {"fit_id": cfg.fit_id, **position, "sync": sync_state})
    path = checkpoint_path(cfg.checkpoint_dir, cfg.fit_id)
    os.makedirs(path.parent, exist_ok=True)

    def write(tmp: str) -> None:
        Path(tmp).write_bytes(data)

    atomic_write(path, write)  # a crash mid-write leaves the previous checkpoint intact


def _jsonable(state: Mapping[str, object]) -> dict[str, object]:
    """The entries of a synchronizer's state that a checkpoint's JSON header can hold."""
    out = {}
    for key, value in state.items():
        try:
            json.dumps(value)
        except TypeError:
            continue  # tensors: per-replica state that a resumed run rebuilds
        out[key] = value
    return out


def _train(p: _Prepared, cfg: SharedConfig, rank: int, rec: PhaseRecorder,
           rendezvous: str) -> WorkerFinished:
    known = p.data.rows
    count = None if known is None else batch_count(known, cfg.batch_size, cfg.drop_last)
    rounds = None if count is None else agree_rounds(count, p.device)
    if rounds == 0:
        raise ValueError("no worker has a full minibatch of rows (drop_last=True)"
                         if cfg.drop_last else "no worker has any training rows: the data is "
                         "empty")
    resume = _resume(cfg, rank, p.device)
    start = resume or p.start
    p.runner.begin(Begin(start.model))
    if start.optimizer is not None:
        p.runner.replica.optimizer.load_state_dict(start.optimizer)
    if resume is not None and resume.meta.get("sync"):
        p.runner.replica.sync.load_state_dict(resume.meta["sync"])
    position = (int(start.meta.get("epoch", 0)), int(start.meta.get("round", 0)),
                int(start.meta.get("step", 0)))
    timing = timed_collectives(rec) if cfg.collect_stats else contextlib.nullcontext()
    with timing:
        t = time.perf_counter()
        losses, samples, first_step, rounds = _loop(p, cfg, rank, rec, rounds, position)
        loop_s = time.perf_counter() - t
        begin, t = rec.now(), time.perf_counter()
        p.runner.finish(with_state=False)
        # The residuals (updates the messages left unsent) end with this stage's tasks: every
        # replica applies them all, so the model returned holds every update trained.
        flush = getattr(p.runner.replica.sync, "flush_residuals", None)
        if flush is not None:
            flush(p.runner.replica.ctx)
        if rank == 0 and cfg.checkpoint_dir:  # after finish: what a retry returns as it is
            _checkpoint(p, cfg, {"epoch": cfg.epochs, "round": 0,
                                 "step": position[2] + p.runner.steps})
        state = pack(*p.runner.final_state()) if rank == 0 else b""
        rec.event("finish", begin, time.perf_counter() - t)
    report = WorkerReport(
        rank=rank, rounds_per_epoch=rounds, steps=p.runner.steps, samples=samples,
        loop_seconds=loop_s, rows=p.data.rows or 0, losses=losses.by_epoch(),
        sync=p.runner.replica.sync.stats(),
        digest=state_digest(p.runner.replica.model_state()), device=p.device,
        resumed_from_step=position[2] if resume is not None else None,
        peak_rss=peak_rss(), rendezvous=rendezvous,
        stats=rec.to_dict() if cfg.collect_stats else None, first_step_s=first_step)
    return WorkerFinished(rank, report, state)


def _loop(p: _Prepared, cfg: SharedConfig, rank: int, rec: PhaseRecorder, rounds: int | None,
          position: tuple[int, int, int]) -> tuple[EpochLoss, int, float | None, int]:
    """Train from ``position`` (epoch, round, step) to the fit's end; the losses, the samples
    trained, when the first step began, and the rounds of an epoch.

    ``rounds``: an epoch's rounds where the ranks agreed them beforehand, else None (they agree
    as the rows stream in: ``epoch_rounds``).
    """
    first_epoch, first_round, step = position
    losses, samples, saved, epoch_ended = EpochLoss.empty(), 0, step, False
    first_step: float | None = None
    ahead = max(1, cfg.window_rows // cfg.batch_size)
    for epoch in range(first_epoch, cfg.epochs):
        skip = first_round if epoch == first_epoch else 0
        batches = stream_batches(p.data.chunks(epoch), cfg.batch_size, seed=cfg.seed, epoch=epoch,
                                 rank=rank, window_rows=cfg.window_rows, first=skip,
                                 drop_last=cfg.drop_last)
        begin, t = rec.now(), time.perf_counter()
        for r, arrays, last in epoch_rounds(batches, skip, rounds, ahead=ahead, device=p.device):
            message = Round(step, batch_tensors(arrays, cfg.features)) if arrays is not None \
                else IdleRound(step)
            data_s, t = time.perf_counter() - t, time.perf_counter()
            if first_step is None:
                first_step = time.time() - cfg.origin
            done = p.runner.train(message)
            phases = split_round(time.perf_counter() - t, rec.take(),
                                 isinstance(message, IdleRound))
            rec.add(begin, data=data_s, **phases)
            losses.add(epoch, done.loss, done.rows)
            samples += done.rows
            step += 1
            if last:
                rounds = r + 1
            if epoch == cfg.epochs - 1 and last:
                continue  # the fit's end: checkpointed after finish, which completes the sync
            # Only where the replicas agree (a periodic scheme's synchronization points):
            # rank 0's state is then everyone's, and a re-run resumes exactly. An epoch's end
            # is checkpointed there, or at the first such point after it.
            epoch_ended = epoch_ended or last
            if rank == 0 and cfg.checkpoint_dir and p.runner.replica.sync.synchronized() \
                    and (epoch_ended or step - saved >= cfg.checkpoint_every):
                nxt = (epoch + 1, 0) if last else (epoch, r + 1)
                _checkpoint(p, cfg, {"epoch": nxt[0], "round": nxt[1], "step": step})
                saved, epoch_ended = step, False
            begin, t = rec.now(), time.perf_counter()
    if rounds is None and first_round == 0 and first_epoch < cfg.epochs:  # not one round
        raise ValueError("no worker has any training rows: the data is empty")
    return losses, samples, first_step, rounds or 0
