"""Training statistics: where each worker's time went, per round and per phase.

Phases: ``data`` (building the minibatch), ``compute`` (forward, backward, optimizer step),
``encode`` (threshold-encoding the update), ``communicate`` (time inside torch.distributed
collectives, including waiting there for slower peers), ``apply`` (the rest of the
synchronization: decoding and applying updates, loading parameters), ``wait`` (rounds without a
batch of one's own, and the end-of-fit synchronization). Times are seconds since the driver
started ``fit()`` (wall clocks: exact on one machine, NTP-close on a cluster).

``TrainingStats`` holds them for every worker and exports JSON and a self-contained HTML page
with a timeline per worker (``export_html``), which DL4J's ``exportStatsAsHtml`` promised for
its shared master but never delivered.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from paraloom.sync.base import StepContext, Synchronizer

__all__ = ["PHASES", "PhaseRecorder", "TimedSynchronizer", "timed_collectives", "TrainingStats"]

PHASES = ("data", "compute", "encode", "communicate", "apply", "wait")
_COLLECTIVES = ("all_gather", "all_reduce", "broadcast", "all_gather_into_tensor",
                "reduce_scatter_tensor", "all_to_all_single", "barrier", "gather", "scatter",
                "reduce", "all_gather_object", "broadcast_object_list")


class PhaseRecorder:
    """One worker's rounds as columns: start time and the duration of each phase."""

    def __init__(self, rank: int, origin: float) -> None:
        self.rank = rank
        self.origin = origin
        self.columns: dict[str, list[float]] = {"start": [], **{p: [] for p in PHASES}}
        self.events: list[dict[str, Any]] = []
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
        self.events.append({"name": name, "start": round(start, 6),
                            "duration": round(duration, 6)})

    def take(self) -> dict[str, float]:
        """The encode / communicate / sync seconds gathered since the last call, then reset."""
        out, self.pending = self.pending, {"encode": 0.0, "communicate": 0.0, "sync": 0.0}
        return out

    def to_dict(self, **extra: Any) -> dict[str, Any]:
        """JSON-able: rank, host, pid, the round columns, the events, and ``extra``."""
        return {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
                "rounds": self.columns, "events": self.events, **extra}


def _timed(fn: Callable[..., Any], recorder: PhaseRecorder, phase: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            recorder.pending[phase] += time.perf_counter() - start

    wrapper._paraloom_timed = True  # type: ignore[attr-defined]
    return wrapper


@contextlib.contextmanager
def timed_collectives(recorder: PhaseRecorder) -> Iterator[None]:
    """Count time spent in torch.distributed collectives as ``communicate``.

    The module functions are replaced for the duration of the block and restored after: a
    Spark task owns its Python worker while it runs, and synchronizers call
    ``torch.distributed.<collective>`` by attribute, so this sees every collective they make
    (DDP's C++ reducer excepted: that time shows as compute).
    """
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    for name, fn in saved.items():
        setattr(dist, name, _timed(fn, recorder, "communicate"))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


class TimedSynchronizer(Synchronizer):
    """Wraps a synchronizer to time its step hooks; everything else is the wrapped one's.

    ``recorder`` is set after the replica made its own copy of this object. The wrapped
    synchronizer's counters (``bytes_sent``, ``stats()``) are reported unchanged.
    """

    def __init__(self, inner: Synchronizer) -> None:  # no super().__init__: counters are inner's
        self.inner = inner
        self.recorder: PhaseRecorder | None = None

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    def setup(self, ctx: StepContext) -> None:
        self.inner.setup(ctx)
        encode = getattr(self.inner, "_encode", None)  # SharedGradients' encoder, if any
        if self.recorder is not None and callable(encode) and \
                not getattr(encode, "_paraloom_timed", False):
            self.inner._encode = _timed(encode, self.recorder, "encode")  # type: ignore[attr-defined]

    def wrap_model(self, model: Any, ctx: StepContext) -> Any:
        return self.inner.wrap_model(model, ctx)

    def finish(self, ctx: StepContext) -> None:
        self.inner.finish(ctx)

    def before_step(self, ctx: StepContext) -> None:
        self.inner.before_step(ctx)

    def after_backward(self, ctx: StepContext) -> None:
        self.inner.after_backward(ctx)

    def after_step(self, ctx: StepContext) -> None:
        self._timed_hook(self.inner.after_step, ctx)

    def idle_step(self, ctx: StepContext) -> None:
        self._timed_hook(self.inner.idle_step, ctx)

    def _timed_hook(self, hook: Callable[[StepContext], None], ctx: StepContext) -> None:
        start = time.perf_counter()
        try:
            hook(ctx)
        finally:
            if self.recorder is not None:
                self.recorder.pending["sync"] += time.perf_counter() - start

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def split_round(total: float, taken: dict[str, float], idle: bool) -> dict[str, float]:
    """Phase durations of one ``ReplicaRunner.round`` from its wall time and the hook timings."""
    if idle:
        return {"wait": total}
    sync = taken["sync"]
    encode, communicate = taken["encode"], taken["communicate"]
    return {"compute": total - sync, "encode": encode, "communicate": communicate,
            "apply": sync - encode - communicate}


@dataclass
class TrainingStats:
    """Per-worker round timings and events of one ``fit()``, plus the driver's own events."""

    master: str
    workers: list[dict[str, Any]]
    driver: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    def phase_totals(self) -> dict[int, dict[str, float]]:
        """Seconds per phase for each worker rank."""
        return {w["rank"]: {p: float(sum(w["rounds"][p])) for p in PHASES} for w in self.workers}

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-able."""
        return {"master": self.master, "summary": self.summary,
                "phase_totals": {str(k): v for k, v in self.phase_totals().items()},
                "workers": self.workers, "driver": self.driver}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def export_json(self, path: str | Path) -> Path:
        """Write ``to_dict()`` as JSON; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    def export_html(self, path: str | Path) -> Path:
        """Write a self-contained HTML page (inline SVG, no scripts, no network); returns it."""
        from paraloom.spark.stats.html import render_html

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render_html(self), encoding="utf-8")
        return path

    @staticmethod
    def merge_rounds(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One record per rank from several tasks' records (averaging: one task per round)."""
        by_rank: dict[int, dict[str, Any]] = {}
        for part in sorted(parts, key=lambda p: (p["rank"], p["rounds"]["start"][:1])):
            into = by_rank.setdefault(part["rank"], {**part, "rounds": {k: [] for k in
                                                                          part["rounds"]},
                                                     "events": [], "hosts": []})
            for k, v in part["rounds"].items():
                into["rounds"][k].extend(v)
            into["events"].extend(part["events"])
            if part["host"] not in into["hosts"]:
                into["hosts"].append(part["host"])
        return [by_rank[r] for r in sorted(by_rank)]
