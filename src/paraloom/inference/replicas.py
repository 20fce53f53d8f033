"""Model replicas: building and warming copies, versions, and the in-place slot pool."""

from __future__ import annotations

import copy
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import nn

from paraloom.inference.errors import InferenceClosedError, QueueFullError, RequestTimeoutError
from paraloom.inference.payload import UnsplittableOutputError, call_model, split_rows
from paraloom.precision import Precision

__all__ = ["build_replica", "Generation", "build_generation", "warm_up",
           "check_rows_first", "example_of", "SlotPool"]

Example = tuple[Hashable, Hashable, tuple[torch.Tensor, ...]]  # (key, spec, tensors)
_GOOD_KEYS = 8  # batch keys a version remembers having run on, for its requests' errors


def build_replica(model: nn.Module, device: torch.device, precision: Precision) -> nn.Module:
    """A private copy of the model on ``device``, in eval mode, without gradients."""
    try:
        with torch.no_grad():  # a TorchScript module's copy would otherwise be autograd clones
            replica = copy.deepcopy(model)
    except Exception as exc:
        raise TypeError(f"cannot copy the model ({type(model).__name__}) to build replicas: "
                        f"{exc}. Make it deep-copyable (copy.deepcopy) or pass a plain "
                        "nn.Module") from exc
    replica = precision.convert_module(replica.to(device))
    replica.eval()
    for parameter in replica.parameters():  # not requires_grad_: TorchScript modules lack it
        parameter.requires_grad_(False)
    return replica


class Generation:
    """One version of the model: a replica per worker slot, and what it is known to accept.

    A batch is bound to the generation it started on, so swapping in a new generation never
    touches a batch in flight; the old replicas are freed when their last batch is done.
    """

    __slots__ = ("version", "replicas", "devices", "precision", "merges", "known", "good_keys",
                 "unmergeable", "rows_checked", "checking")

    def __init__(self, version: int, replicas: list[nn.Module], devices: list[torch.device],
                 precision: Precision, *, merges: bool = True) -> None:
        self.version = version
        self.merges = merges
        """Whether requests are merged by rows: if not, an input's first dimension need not
        be its rows (a time-major LSTM's ``(T, N, F)``), and ``known`` keeps it whole."""
        self.replicas = replicas
        self.devices = devices
        self.precision = precision
        # (key, spec, one row of tensors, or all of them when not merging) of an input this
        # version ran on; replaced as a whole, so readers on other threads never see a
        # half-updated pair.
        self.known: Example | None = None
        self.good_keys: dict[Hashable, None] = {}
        """The last ``_GOOD_KEYS`` distinct batch keys this version ran on, oldest first."""
        self.unmergeable = False
        """Set once a merged batch's output could not be split by rows: from then on each
        request of this version runs alone (``refuse_merging``)."""
        self.rows_checked = False  # whether check_rows_first ran on this version
        self.checking = threading.Lock()
        """Held while ``check_rows_first`` runs: another worker's merged batch waits for its
        verdict instead of being split by rows that may not be its rows."""

    @property
    def good_key(self) -> Hashable | None:
        """The batch key of an input this version accepted, or None if none yet."""
        known = self.known
        return None if known is None else known[0]

    def accepted(self, key: Hashable, spec: Hashable, tensors: tuple[torch.Tensor, ...]) -> None:
        """Remember an input this version ran on, for error messages and warming successors."""
        known = self.known
        if known is None or known[0] != key:
            # A copy of one row: a view would keep the whole request's memory alive.
            self.known = (key, spec, tuple((t[:1] if self.merges else t).clone()
                                           for t in tensors))
            keys = dict(self.good_keys)  # replaced whole, as ``known`` is
            keys.pop(key, None)
            keys[key] = None
            while len(keys) > _GOOD_KEYS:
                del keys[next(iter(keys))]
            self.good_keys = keys

    def refuse_merging(self, why: str) -> None:
        """Run each request of this version alone from now on, and warn once, naming ``why``."""
        if not self.unmergeable:
            self.unmergeable = True
            warnings.warn(f"model version {self.version}: {why}. Requests are now run one at "
                          "a time, as in inference_mode='sequential'", RuntimeWarning,
                          stacklevel=2)

    def forward(self, slot: int, spec: Hashable, tensors: Sequence[torch.Tensor]) -> Any:
        """Run slot's replica on tensors already on its device (inference mode is the caller's)."""
        device = self.devices[slot]
        tensors = self.precision.convert_inputs(tensors)
        with self.precision.forward_context(device):
            output = call_model(self.replicas[slot], spec, tensors)
        return self.precision.convert_output(output)


def build_generation(model: nn.Module, version: int, devices: list[torch.device],
                     precision: Precision, *, merges: bool = True) -> Generation:
    """Check the devices can run the precision and build one replica per device
    (``merges``: whether the pool merges requests by rows)."""
    for device in dict.fromkeys(devices):
        precision.check_device(device)
    return Generation(version, [build_replica(model, d, precision) for d in devices], devices,
                      precision, merges=merges)


def warm_up(generation: Generation, example: Example, *, merges: bool = False) -> None:
    """Run every replica once on ``example`` (so the first request pays no start-up cost);
    ``merges`` (the pool merges requests): also ``check_rows_first`` on it."""
    key, spec, tensors = example
    with torch.inference_mode():  # copies: a model that writes its input must not change it
        for slot, device in enumerate(generation.devices):
            generation.forward(slot, spec, [t.to(device, copy=True) for t in tensors])
        if merges:
            check_rows_first(generation, 0, spec, tensors)
    generation.accepted(key, spec, tensors)


def check_rows_first(generation: Generation, slot: int, spec: Hashable,
                     tensors: Sequence[torch.Tensor]) -> None:
    """Before a version's requests are merged: run ``tensors`` and them twice over, and if an
    output's first dimension does not follow the rows (an LSTM's h_n), run each request of
    this version alone (``refuse_merging``). Once per version, from the first input the model
    runs (one it refuses leaves the check to the next batch); inference mode is the caller's.
    One worker checks at a time; ``rows_checked`` is set once the verdict is in."""
    with generation.checking:
        if not generation.rows_checked:
            generation.rows_checked = _rows_follow(generation, slot, spec, tensors)


def _rows_follow(generation: Generation, slot: int, spec: Hashable,
                 tensors: Sequence[torch.Tensor]) -> bool:
    """check_rows_first's passes; False where the model refused ``tensors`` (no verdict)."""
    device = generation.devices[slot]
    rows = int(tensors[0].shape[0])
    try:  # on a copy: these are a request's tensors, which its own pass then reads
        once = generation.forward(slot, spec, [t.to(device, copy=True) for t in tensors])
    except Exception:  # noqa: BLE001 - the request's own failure: check the next batch's
        return False
    try:
        twice = generation.forward(slot, spec, [torch.cat([t, t]).to(device) for t in tensors])
    except Exception:  # noqa: BLE001 - a model of fixed rows: merged batches will tell
        return True
    try:
        split_rows(once, [rows])
        split_rows(twice, [rows, rows])
    except UnsplittableOutputError as exc:
        generation.refuse_merging(f"on an input and on it twice over, {exc}")
    return True


def example_of(generation: Generation) -> Example | None:
    """An input the generation ran on (one row), to warm its successor; None if none yet."""
    return generation.known


class SlotPool:
    """In-place mode: callers borrow a free replica slot; at most ``limit`` callers wait in line."""

    def __init__(self, slots: int, limit: int) -> None:
        self._free = list(range(slots - 1, -1, -1))
        self._limit = limit
        self._waiting = 0
        self._closed = False
        self._lock = threading.Lock()
        self._slot_free = threading.Condition(self._lock)
        self._line_free = threading.Condition(self._lock)

    def acquire(self, *, block: bool = True, timeout: float | None = None) -> int:
        """Borrow a slot, waiting up to ``timeout``: QueueFullError if the line stayed full
        (``limit`` callers waiting) that long, RequestTimeoutError if, in line, no slot came
        free in time (as a queued request that waited past its timeout)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._check_open()
            if self._free:
                return self._free.pop()
            if not block:
                raise _busy(self._waiting, "block=False")
            self._wait(self._line_free, lambda: self._waiting < self._limit, deadline, timeout)
            self._waiting += 1
            try:
                self._wait(self._slot_free, lambda: bool(self._free), deadline, timeout,
                           in_line=True)
            finally:
                self._waiting -= 1
                self._line_free.notify()
            return self._free.pop()

    def _wait(self, cond: threading.Condition, ready: Callable[[], bool],
              deadline: float | None, timeout: float | None, in_line: bool = False) -> None:
        while not ready():
            self._check_open()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0 and in_line:
                raise RequestTimeoutError(
                    f"the request waited {timeout:.3g} s for a free replica, past its timeout; "
                    "pass a longer timeout, add workers, or send fewer requests at once")
            if remaining is not None and remaining <= 0:
                raise _busy(self._waiting, f"timeout={timeout:.3g} s")
            cond.wait(remaining)
        self._check_open()

    def _check_open(self) -> None:
        if self._closed:
            raise InferenceClosedError("this ParallelInference is closed and accepts no more "
                                       "requests; create a new one")

    def release(self, slot: int) -> None:
        """Give a slot back and wake one waiting caller."""
        with self._lock:
            self._free.append(slot)
            self._slot_free.notify()

    def close(self) -> None:
        """Refuse new callers and wake every waiting one (they raise InferenceClosedError)."""
        with self._lock:
            self._closed = True
            self._slot_free.notify_all()
            self._line_free.notify_all()


def _busy(waiting: int, why: str) -> QueueFullError:
    return QueueFullError(f"every replica is busy and {waiting} callers are waiting for one "
                          f"({why}); retry later, or add workers, raise queue_limit or pass a "
                          "longer timeout")
