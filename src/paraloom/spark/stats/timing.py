"""Timing hooks for a task's recorder: torch.distributed collectives and synchronizer steps.

Time inside collectives counts as ``communicate``, time in the synchronizer's encoder as
``encode``, and the rest of its step hooks as synchronization (``apply``, see ``split_round``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, ParamSpec, TypeVar

import torch.distributed as dist

from paraloom.spark.stats.recorder import PhaseRecorder
from paraloom.sync.base import StepContext, Synchronizer

__all__ = ["timed_collectives", "TimedSynchronizer"]

P = ParamSpec("P")
R = TypeVar("R")
_COLLECTIVES = ("all_gather", "all_reduce", "broadcast", "all_gather_into_tensor",
                "reduce_scatter_tensor", "all_to_all_single", "barrier", "gather", "scatter",
                "reduce", "all_gather_object", "broadcast_object_list")


class _Timed(Generic[P, R]):
    """``fn``, each call's seconds added to the recorder's pending ``phase``."""

    def __init__(self, fn: Callable[P, R], recorder: PhaseRecorder, phase: str) -> None:
        functools.update_wrapper(self, fn)
        self.fn, self.recorder, self.phase = fn, recorder, phase

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.recorder.pending[self.phase] += time.perf_counter() - start


@contextlib.contextmanager
def timed_collectives(recorder: PhaseRecorder) -> Iterator[None]:
    """Count time spent in torch.distributed collectives as ``communicate``.

    The module functions are replaced for the duration of the block and restored after: a
    Spark task owns its Python process while it runs, and synchronizers call
    ``torch.distributed.<collective>`` by attribute, so this sees every collective they make
    (DDP's C++ reducer excepted: that time shows as compute).
    """
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    for name, fn in saved.items():
        setattr(dist, name, _Timed(fn, recorder, "communicate"))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


class TimedSynchronizer(Synchronizer):
    """Wraps a synchronizer to time its step hooks; everything else is the wrapped one's.

    ``recorder`` is set after the replica made its own copy of this object. The wrapped
    synchronizer's counters (``bytes_sent``, ``stats()``) are reported unchanged. Every public
    ``Synchronizer`` method that is not timed here goes to the wrapped one as it is (see
    ``_forward_untimed``), so a hook added to the base class reaches it too.
    """

    def __init__(self, inner: Synchronizer) -> None:  # no super().__init__: counters are inner's
        self.inner = inner
        self.name = inner.name
        self.recorder: PhaseRecorder | None = None

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def setup(self, ctx: StepContext) -> None:
        self.inner.setup(ctx)
        encode = getattr(self.inner, "_encode", None)  # SharedGradients' encoder, if any
        if self.recorder is not None and callable(encode) and not isinstance(encode, _Timed):
            # an instance attribute shadows the method, for this replica's copy only
            vars(self.inner)["_encode"] = _Timed(encode, self.recorder, "encode")

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


def _forwarding(name: str) -> Callable[..., Any]:
    """A method that calls the wrapped synchronizer's ``name``."""
    def forward(self: TimedSynchronizer, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    return forward


def _forward_untimed() -> None:
    """Give ``TimedSynchronizer`` every public ``Synchronizer`` method it does not define, as
    a call to the wrapped synchronizer's: inheriting them would run the base class's no-ops
    (``__getattr__`` is not consulted for what the class has)."""
    for name, member in vars(Synchronizer).items():
        if name.startswith("_") or name in vars(TimedSynchronizer) or \
                not inspect.isfunction(member):  # static helpers stay the base class's
            continue
        setattr(TimedSynchronizer, name, _forwarding(name))


_forward_untimed()
