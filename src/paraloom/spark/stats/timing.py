"""Timing hooks for a task's recorder: torch.distributed collectives and synchronizer steps.

Time inside collectives counts as ``communicate``, time in the synchronizer's encoder as
``encode``, and the rest of its step hooks as synchronization (``apply``, see ``split_round``).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import torch.distributed as dist
from torch import Tensor, nn

from paraloom.spark.stats.recorder import PhaseRecorder
from paraloom.sync.base import StepContext, Synchronizer

__all__ = ["timed_collectives", "TimedSynchronizer"]

P = ParamSpec("P")
R = TypeVar("R")
_COLLECTIVES = ("all_gather", "all_reduce", "broadcast", "all_gather_into_tensor",
                "reduce_scatter_tensor", "all_to_all_single", "barrier", "gather", "scatter",
                "reduce", "all_gather_object", "broadcast_object_list")


def _timed(fn: Callable[P, R], recorder: PhaseRecorder, phase: str) -> Callable[P, R]:
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
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

    def wrap_model(self, model: nn.Module, ctx: StepContext) -> nn.Module:
        return self.inner.wrap_model(model, ctx)

    def run_step_fn(self, step_fn: Callable[[nn.Module, Any], Any], module: nn.Module,
                    batch: Any, ctx: StepContext) -> Any:
        return self.inner.run_step_fn(step_fn, module, batch, ctx)

    def finish(self, ctx: StepContext) -> None:
        self.inner.finish(ctx)

    def before_step(self, ctx: StepContext) -> None:
        self.inner.before_step(ctx)

    def abort_step(self, ctx: StepContext) -> None:
        self.inner.abort_step(ctx)

    def shared_parameters(self, ctx: StepContext) -> dict[int, Tensor]:
        return self.inner.shared_parameters(ctx)

    def after_backward(self, ctx: StepContext) -> None:
        self.inner.after_backward(ctx)

    def after_step(self, ctx: StepContext) -> None:
        self._timed_hook(self.inner.after_step, ctx)

    def idle_step(self, ctx: StepContext) -> None:
        self._timed_hook(self.inner.idle_step, ctx)

    def synchronized(self) -> bool:
        return self.inner.synchronized()

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
