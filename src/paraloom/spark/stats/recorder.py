"""Phase timings as a task records them: one column per phase, one row per training round (a
worker's minibatch, or its idle turn, as in ParallelWrapper; not an averaging round).

Phases: ``data`` (building the minibatch), ``compute`` (forward, backward, optimizer step),
``encode`` (threshold-encoding the update), ``communicate`` (time inside torch.distributed
collectives, including waiting there for slower peers), ``apply`` (the rest of the
synchronization: decoding and applying updates, loading parameters), ``wait`` (rounds without a
batch of one's own, and the end-of-fit synchronization). Times are seconds since the driver
started ``fit()`` (wall clocks: exact on one machine, NTP-close on a cluster).
"""

from __future__ import annotations

import os
import socket
import time
from typing import TypedDict

__all__ = ["PHASES", "PhaseRecorder", "split_round", "Event", "WorkerStats"]

PHASES = ("data", "compute", "encode", "communicate", "apply", "wait")


class Event(TypedDict):
    """A one-off span (setup, rendezvous, a broadcast): seconds since the driver's fit start."""

    name: str
    start: float
    duration: float


class _WorkerStats(TypedDict):
    rank: int
    host: str
    pid: int
    rounds: dict[str, list[float]]
    """``"start"`` and one column per phase, one row per round."""
    events: list[Event]


class WorkerStats(_WorkerStats, total=False):
    """One worker's timings as its task records them (``PhaseRecorder.to_dict``), JSON-able."""

    hosts: list[str]
    """Every host that ran one of the worker's tasks (``TrainingStats.merge_rounds``)."""


class PhaseRecorder:
    """One worker's rounds as columns: start time and the duration of each phase."""

    def __init__(self, rank: int, origin: float) -> None:
        self.rank = rank
        self.origin = origin
        self.columns: dict[str, list[float]] = {"start": [], **{p: [] for p in PHASES}}
        self.events: list[Event] = []
        self.pending = {"encode": 0.0, "communicate": 0.0, "sync": 0.0}

    def now(self) -> float:
        """Seconds since the driver's fit start."""
        return time.time() - self.origin

    def add(self, start: float, **phases: float) -> None:
        """Record one round that began at ``start`` (seconds since the origin)."""
        unknown = set(phases) - set(PHASES)
        if unknown:
            raise ValueError(f"unknown phase(s) {sorted(unknown)}; expected {PHASES}")
        self.columns["start"].append(round(start, 6))
        for p in PHASES:
            self.columns[p].append(round(max(0.0, phases.get(p, 0.0)), 6))

    def event(self, name: str, start: float, duration: float) -> None:
        """A one-off span: setup, rendezvous, loading data, the final synchronization."""
        self.events.append(Event(name=name, start=round(start, 6),
                                 duration=round(duration, 6)))

    def take(self) -> dict[str, float]:
        """The encode / communicate / sync seconds gathered since the last call, then reset."""
        out, self.pending = self.pending, {"encode": 0.0, "communicate": 0.0, "sync": 0.0}
        return out

    def to_dict(self) -> WorkerStats:
        """JSON-able: rank, host, pid, the round columns, the events."""
        return WorkerStats(rank=self.rank, host=socket.gethostname(), pid=os.getpid(),
                           rounds=self.columns, events=self.events)


def split_round(total: float, taken: dict[str, float], idle: bool) -> dict[str, float]:
    """Phase durations of one ``ReplicaRunner.round`` from its wall time and the hook timings."""
    if idle:
        return {"wait": total}
    sync = taken["sync"]
    encode, communicate = taken["encode"], taken["communicate"]
    return {"compute": total - sync, "encode": encode, "communicate": communicate,
            "apply": sync - encode - communicate}
