"""How objects travel to worker processes: cloudpickle, with tensors in shared memory.

Workers do not import the user's ``__main__`` (see ``launch.no_main_reimport``), so anything
defined in a script (a Dataset, a collate function, a namedtuple batch) must travel by value:
cloudpickle does that, and torch's reducers put tensor storage in shared memory instead of the
pickle.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from collections import ChainMap
from collections.abc import Callable, Iterable
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler
from typing import Any, TypeGuard

import cloudpickle
import torch
import torch.multiprocessing  # noqa: F401  (registers torch's shared-memory reducers)

from paraloom.data import map_tensors
from paraloom.errors import NotPicklableError
from paraloom.training.messages import Begin, Pickled, Round, RoundBatch, ToReplica
from paraloom.training.parametrized import ModulePickler

# torch's reducer rebuilds a sparse tensor (SGD's momentum of a sparse embedding's gradient)
# without saying whether to check its invariants, and then warns, once, that they go unchecked
# and that memory errors may follow: this one came from a worker of the same fit, built by torch.
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled",
                        module="torch.multiprocessing.reductions")

__all__ = ["SharedOutbox", "carries_user_objects", "dumps", "fetched", "pack", "release_unfetched",
           "shared_copy"]


class _Pickler(ModulePickler):
    """cloudpickle with torch's shared-memory reducers, noting the file-descriptor handles they
    register (``handles``: the keys of this process's ``resource_sharer``)."""

    def __init__(self, file: io.BytesIO, handles: list[int]) -> None:
        # Set first: the C pickler reads its dispatch table when it is initialised.
        self.dispatch_table = ChainMap(
            {kind: _noting(reduce, handles)
             for kind, reduce in ForkingPickler._extra_reducers.items()},  # type: ignore[attr-defined]
            cloudpickle.CloudPickler.dispatch_table)
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)


def _noting(reduce: Callable[[Any], Any], handles: list[int]) -> Callable[[Any], Any]:
    """``reduce``, noting in ``handles`` the file descriptors its result hands over."""
    def reduced(obj: Any) -> Any:
        result = reduce(obj)
        if isinstance(result, tuple) and len(result) > 1:
            _note_handles(result[1], handles)
        return result
    return reduced


def _note_handles(args: tuple[Any, ...], handles: list[int]) -> None:
    """The descriptor handles in a reducer's arguments, nested ones too (a sparse tensor's
    are in its indices' and values' own reductions)."""
    for arg in args:
        if isinstance(arg, resource_sharer.DupFd):
            handles.append(arg._id[1])  # type: ignore[attr-defined]
        elif isinstance(arg, tuple):
            _note_handles(arg, handles)


def dumps(obj: object, handles: list[int] | None = None) -> bytes:
    """Pickle for a worker process: classes by value, CPU tensors as shared-memory handles.

    Each result can be loaded once (it carries file-descriptor handles), by ``pickle.loads``;
    ``handles`` gets the keys of the descriptors it holds (``release_unfetched``).
    """
    buffer = io.BytesIO()
    _Pickler(buffer, [] if handles is None else handles).dump(obj)
    return buffer.getvalue()


def release_unfetched(handles: Iterable[int]) -> None:
    """Close the descriptors this process still holds for ``handles`` that no worker fetched.

    A message left in a dead worker's queue is never loaded: the duplicated descriptor of each
    of its tensors stayed in ``multiprocessing``'s sharer, and kept its shared memory, for the
    life of the process (38 descriptors, and 16 MiB of 4 MiB batches, per failed fit). A
    fetched handle is no longer held, so releasing every handle a worker was sent is safe once
    it can fetch no more.
    """
    sharer = getattr(resource_sharer, "_resource_sharer", None)
    cache, lock = _held(), getattr(sharer, "_lock", None)
    if cache is None or lock is None:  # another Python: leave it be
        return
    with lock:
        closers = [cache.pop(key)[1] for key in set(handles) if key in cache]
    for close in closers:
        with contextlib.suppress(OSError):
            close()


def fetched(handles: list[int]) -> list[int]:
    """``handles`` without those fetched already (no longer held)."""
    cache = _held()
    return [] if cache is None else [key for key in handles if key in cache]


def _held() -> dict[int, Any] | None:
    """The descriptors this process's sharer holds for a receiver, by key (CPython's private
    ``resource_sharer._resource_sharer._cache``); None where it has no such table."""
    cache = getattr(getattr(resource_sharer, "_resource_sharer", None), "_cache", None)
    return cache if isinstance(cache, dict) else None


def _shared_empty(like: torch.Tensor) -> torch.Tensor:
    """An uninitialized CPU tensor like ``like`` (shape, dtype, layout), in shared memory."""
    shared = torch.empty_like(like, device="cpu")
    shared.share_memory_()  # type: ignore[no-untyped-call]
    return shared


def _shared(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu":
        return t
    if t.layout != torch.strided:  # sparse: torch's reducer shares its indices and values
        return t.detach().clone()
    return _shared_empty(t).copy_(t)


def shared_copy(batch: Any) -> Any:
    """The batch with every CPU tensor copied into fresh shared memory.

    One copy, which moving the tensor into shared memory would make anyway; it also means a
    source that refills one buffer for every batch cannot change a batch already dealt.
    """
    return map_tensors(batch, _shared)


class SharedOutbox:
    """Shared-memory tensors a worker copies a state into, reused from one send to the next.

    Sending a CPU tensor through a queue moves it into a fresh shared-memory segment, which
    the receiver then maps: 280 ms per 150 MB here, for a 37M-parameter model at the end of
    every fit(). A state copied into the same segments again costs a copy (17 ms), and a
    receiver that still holds the segments from the last send maps nothing new (torch caches
    received storages by segment). The receiver must copy out what it keeps: the next send
    overwrites the segments.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def copy(self, obj: Any) -> Any:
        """``obj`` with every tensor copied into this outbox's shared memory (as CPU tensors)."""
        position = 0

        def put(t: torch.Tensor) -> torch.Tensor:
            nonlocal position
            if t.layout != torch.strided:  # a sparse state (SGD's momentum of a sparse
                return _shared(t)          # embedding's gradient) has no storage to reuse
            index, position = position, position + 1
            kept = self._buffers[index: index + 1]
            if kept and kept[0].shape == t.shape and kept[0].dtype == t.dtype:
                return kept[0].copy_(t.detach())
            self._buffers[index: index + 1] = [_shared_empty(t)]  # replaces, or appends
            return self._buffers[index].copy_(t.detach())

        with torch.no_grad():
            copied = map_tensors(obj, put)
        del self._buffers[position:]
        return copied


def carries_user_objects(message: ToReplica) -> TypeGuard[Begin | Round | RoundBatch]:
    """Whether a message holds the user's objects (batches, a dataset, a model state), which
    travel pickled by value with their tensors in shared memory (``pack``)."""
    if isinstance(message, RoundBatch):
        return any(isinstance(r, Round) for r in message.rounds)
    return isinstance(message, Round | Begin)


def pack(message: Begin | Round | RoundBatch) -> Pickled:
    """``message`` pickled for a worker (``dumps``), with its first round's id so that a
    batch that fails to load is reported on its own round; ``NotPicklableError`` names the
    part that cannot travel."""
    handles: list[int] = []
    try:
        if isinstance(message, Round | RoundBatch):
            first = message.rounds[0] if isinstance(message, RoundBatch) else message
            return Pickled(dumps(message, handles), first.round_id, tuple(handles))
        return Pickled(dumps(message, handles), handles=tuple(handles))
    except Exception as e:
        if isinstance(message, Round | RoundBatch):
            what = f"batch of round {message.round_id}"
        elif _unpicklable(message.dataset):
            what = "dataset"
        else:
            what = "model or optimizer state"
        raise NotPicklableError(f"the {what} cannot be sent to the workers: "
                                f"{type(e).__name__}: {e}") from e


def _unpicklable(obj: object) -> bool:
    try:
        dumps(obj)
    except Exception:
        return True
    return False
