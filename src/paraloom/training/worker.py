"""The loop every replica runs, in a worker process or in the calling process.

``ReplicaRunner`` speaks the protocol between a launcher and one replica; ``worker_main`` is
the entry point of a ParallelWrapper worker process. Messages to a worker, in order:

    ("begin", state, dataset, snapshot,     master parameters; dataset for index dealing; a
     optimizer_state, seed)                 checkpoint's replica when resuming; the user's
                                            optimizer state (pickled bytes); an RNG seed
    ("round", round_id, payload)            payload: ("batch", batch) | ("indices", list) | None
    ("snapshot", tag)                       report this replica's full state (for checkpoints)
    ("finish",)                             final synchronization; report the result
    ("stop",)                               leave the loop

Replies on the shared result queue: ("ready", rank), ("step", rank, round_id, loss, rows, synced),
("snapshot", rank, tag, state), ("finished", rank, result),
("error", rank, round_id, message, traceback, exception type name).
"""

from __future__ import annotations

import copy
import datetime
import os
import pickle
import queue
import traceback
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
from torch import nn

from paraloom.data import IndexedDataset, batch_size, cpu_copy, split_batch
from paraloom.errors import NotPicklableError
from paraloom.sync.base import Synchronizer
from paraloom.training.optim import OptimizerSpec
from paraloom.training.replica import Replica

__all__ = ["WorkerSpec", "ReplicaRunner", "worker_main", "pickle_spec"]

_POLL_S = 0.5


@dataclass
class WorkerSpec:
    """Everything a replica needs; pickled once (with cloudpickle) when the pool starts."""

    model: nn.Module
    optimizer: OptimizerSpec
    loss_fn: Any
    step_fn: Any
    synchronizer: Synchronizer
    precision: str = "32-true"


def pickle_spec(spec: WorkerSpec) -> bytes:
    """Pickle what the workers need, by value for classes and lambdas defined in scripts."""
    try:
        return cloudpickle.dumps(spec)
    except Exception as e:
        raise NotPicklableError(
            f"cannot send the {_unpicklable_part(spec)} to the worker processes: "
            f"{type(e).__name__}: {e}. Define it at module level, keep open files, locks, "
            "threads and generators out of it, and guard your script with "
            "`if __name__ == \"__main__\":`; workers=1 trains without pickling") from e


def _unpicklable_part(spec: WorkerSpec) -> str:
    for name in ("model", "loss_fn", "step_fn", "optimizer", "synchronizer"):
        try:
            cloudpickle.dumps(getattr(spec, name))
        except Exception:
            return {"optimizer": "optimizer (or optimizer factory)"}.get(name, name)
    return "training setup"


class ReplicaRunner:
    """One replica driven by launcher messages."""

    def __init__(self, spec: WorkerSpec, *, rank: int = 0, world_size: int = 1,
                 device: torch.device | str = "cpu", group: Any = None) -> None:
        self.rank = rank
        self.replica = Replica(spec.model, spec.optimizer, loss_fn=spec.loss_fn,
                               step_fn=spec.step_fn, synchronizer=copy.deepcopy(spec.synchronizer),
                               device=device, group=group, rank=rank, world_size=world_size,
                               precision=spec.precision)
        self.dataset: IndexedDataset | None = None
        self.steps = 0

    def begin(self, state: dict[str, torch.Tensor] | None, dataset: IndexedDataset | None,
              snapshot: dict[str, Any] | None = None,
              optimizer_state: dict[str, Any] | None = None, seed: int | None = None) -> None:
        """Start a fit(): load the master state (or a snapshot), set up the synchronizer.

        ``seed`` (with no snapshot) seeds this replica's RNG as ``seed + rank``.
        """
        self.dataset = dataset
        self.steps = 0
        seed = None if seed is None or snapshot is not None else seed + self.rank
        self.replica.begin_fit(state, snapshot, optimizer_state, seed)

    def round(self, payload: Any) -> tuple[float | None, int, bool]:
        """Train on this round's payload; returns (loss, rows, whether replicas synced)."""
        if payload is None:
            return self.replica.step(None), 0, self._synced()
        kind, value = payload
        if kind == "indices":
            if self.dataset is None:
                raise RuntimeError("got indices before a dataset: the launcher must send "
                                   "the dataset with begin")
            batch = self.dataset.gather(value)
        elif kind == "pickled":
            batch = pickle.loads(value)
        else:
            batch = value
        loss = self.replica.step(batch)
        self.steps += 1
        return loss, _rows(batch), self._synced()

    def _synced(self) -> bool:
        return bool(getattr(self.replica.sync, "synced_last_step", True))

    def finish(self, send_state: bool) -> dict[str, Any]:
        """End of fit(): final synchronization; rank 0 returns parameters and optimizer state."""
        self.replica.finish()
        result: dict[str, Any] = {"stats": self.replica.sync.stats(), "steps": self.steps}
        if send_state:
            result["state"] = self.replica.state()
            result["optimizer"] = cpu_copy(self.replica.optimizer.state_dict())
        return result


def _rows(batch: Any) -> int:
    try:
        return batch_size(split_batch(batch)[0])
    except TypeError:
        return batch_size(batch)


@dataclass
class WorkerConfig:
    """Process-level settings of one worker."""

    rank: int
    world_size: int
    store_port: int
    backend: str
    device: str
    threads: int
    timeout_s: float
    parent_pid: int


def _next_message(tasks: Any, parent_pid: int) -> Any:
    """Wait for the next task; exit if the parent process has gone."""
    while True:
        try:
            return tasks.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent_pid:
                raise SystemExit("paraloom worker: parent process exited") from None


def _init_group(cfg: WorkerConfig) -> Any:
    if cfg.world_size == 1:
        return None
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    store = dist.TCPStore("127.0.0.1", cfg.store_port, is_master=False, timeout=timeout)
    dist.init_process_group(cfg.backend, store=store, rank=cfg.rank, world_size=cfg.world_size,
                            timeout=timeout)
    return dist.group.WORLD


def worker_main(cfg: WorkerConfig, spec_bytes: bytes, tasks: Any, results: Any) -> None:
    """Entry point of a worker process."""
    round_id = None
    try:
        torch.set_num_threads(cfg.threads)
        if cfg.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(cfg.device))
        group = _init_group(cfg)
        spec = pickle.loads(spec_bytes)
        runner = ReplicaRunner(spec, rank=cfg.rank, world_size=cfg.world_size,
                               device=cfg.device, group=group)
        results.put(("ready", cfg.rank))
        while True:
            msg = _next_message(tasks, cfg.parent_pid)
            if msg[0] == "round":
                round_id = msg[1]
                results.put(("step", cfg.rank, round_id, *runner.round(msg[2])))
            elif msg[0] == "begin":
                *blobs, seed = msg[1:]
                runner.begin(*(pickle.loads(m) if m is not None else None for m in blobs),
                             seed=seed)
            elif msg[0] == "snapshot":
                results.put(("snapshot", cfg.rank, msg[1], runner.replica.snapshot()))
            elif msg[0] == "finish":
                round_id = None
                results.put(("finished", cfg.rank, runner.finish(send_state=cfg.rank == 0)))
            elif msg[0] == "stop":
                break
    except BaseException as e:  # reported to the parent, which raises WorkerError
        results.put(("error", cfg.rank, round_id, f"{type(e).__name__}: {e}",
                     traceback.format_exc(), type(e).__name__))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
