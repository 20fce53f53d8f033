"""Per-replica data loading: each replica runs its own DataLoader over its share of the data.

The parent turns the user's ``DataLoader`` into a ``LoaderSpec`` (the dataset and the loader's
settings, sent once with ``Begin``). For a map-style dataset it deals each epoch's batches of
indices (the user's sampler, iterated in the parent: a few integers per sample) round-robin to
the replicas, as ``LoaderEpoch``; each replica's DataLoader, with the user's ``num_workers``,
``collate_fn``, ``pin_memory``, ... loads its own batches, so no sample passes through the
parent. An ``IterableDataset`` is iterated whole by every replica, which shards it with
``paraloom.replica_info()``. A ``LoaderRound`` names the batch's position, so a replica that
starts mid-epoch (exact resume, or a restart after a failure) skips to it without loading what
came before.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from paraloom.data import iter_tensors
from paraloom.sharding import ReplicaInfo, WorkerInit

__all__ = ["LoaderSpec", "loader_spec", "ReplicaLoader", "SeededBatch", "epoch_batches", "digest"]

# DataLoader settings that travel to the replicas unchanged.
_OPTIONS = ("num_workers", "pin_memory", "pin_memory_device", "timeout", "prefetch_factor",
            "persistent_workers", "in_order")


@dataclass(frozen=True)
class LoaderSpec:
    """A DataLoader's dataset and settings, rebuilt in each replica."""

    dataset: Dataset[Any]
    stream: bool
    """An IterableDataset: every replica iterates its own copy."""
    batch_size: int | None
    batched: bool = True
    """The loader makes batches (``batch_size`` or ``batch_sampler=``); False with
    ``batch_size=None``: each index is a batch of its own."""
    drop_last: bool = False
    collate_fn: Callable[[Any], Any] | None = None
    worker_init_fn: Callable[[int], object] | None = None
    multiprocessing_context: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def num_workers(self) -> int:
        return int(self.options.get("num_workers", 0))


def loader_spec(data: object) -> LoaderSpec | None:
    """The spec for a source each replica loads itself; None for one dealt otherwise (a map-style
    DataLoader with ``num_workers=0`` is dealt as index lists; other iterables go through the
    parent)."""
    if isinstance(data, IterableDataset):
        return LoaderSpec(data, stream=True, batch_size=None)
    if not isinstance(data, DataLoader):
        return None
    stream = isinstance(data.dataset, IterableDataset)
    if not stream and data.num_workers == 0 and not data.pin_memory:
        return None
    context = data.multiprocessing_context
    method = context if context is None or isinstance(context, str) \
        else context.get_start_method()
    options = {k: getattr(data, k) for k in _OPTIONS if hasattr(data, k)}
    return LoaderSpec(data.dataset, stream=stream, batch_size=data.batch_size,
                      batched=data.batch_sampler is not None, drop_last=data.drop_last,
                      collate_fn=data.collate_fn, worker_init_fn=data.worker_init_fn,
                      multiprocessing_context=method,
                      options=options)


class SeededBatch(list[int]):
    """A batch of indices with the seed its rows are loaded under (see ``_SeededDataset``)."""

    seed: int | None = None


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


@contextlib.contextmanager
def _kept_rngs() -> Iterator[None]:
    """Leave torch's, Python's and numpy's global RNGs as they were (loading in the replica's
    own process must not move the RNG its training draws dropout from)."""
    numpy = sys.modules.get("numpy")
    py_state = random.getstate()
    np_state = numpy.random.get_state() if numpy is not None else None
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py_state)
            if numpy is not None:
                numpy.random.set_state(np_state)


class _SeededDataset(Dataset[Any]):
    """The user's map-style dataset; a ``SeededBatch`` is loaded with the global RNGs seeded
    from the batch's position in the epoch, so random augmentations do not depend on which
    loader worker loads it, nor on where a resumed run started."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __getitems__(self, batch: list[int]) -> list[Any]:
        seed = getattr(batch, "seed", None)
        if seed is None:
            return self._rows(batch)
        if get_worker_info() is not None:  # a loader worker: its RNG is only for loading
            _seed_all(seed)
            return self._rows(batch)
        with _kept_rngs():
            _seed_all(seed)
            return self._rows(batch)

    def _rows(self, batch: list[int]) -> list[Any]:
        getitems = getattr(self.dataset, "__getitems__", None)
        return list(getitems(list(batch))) if getitems else [self.dataset[i] for i in batch]


class _Plan:
    """The batches a replica's DataLoader loads this epoch, from ``start`` on (its
    ``batch_sampler``; replaced in place each epoch so persistent loader workers live on)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.seeds: list[int] = []
        self.start = 0

    def __iter__(self) -> Iterator[SeededBatch]:
        for indices, seed in zip(self.batches[self.start:], self.seeds[self.start:],
                                 strict=True):
            batch = SeededBatch(indices)
            batch.seed = seed
            yield batch

    def __len__(self) -> int:
        return len(self.batches) - self.start


_END = object()


class ReplicaLoader:
    """One replica's DataLoader: advanced one batch per ``LoaderRound``."""

    def __init__(self, spec: LoaderSpec, rank: int, world_size: int) -> None:
        self.spec = spec
        self.rank = rank
        self._plan = _Plan()
        self._loader: DataLoader[Any] | None = None
        self._iter: Iterator[Any] | None = None
        self._epoch: int | None = None
        self._seed = 0
        self._next = 0
        self._ahead: Any = None  # a stream's next batch, read to learn whether there is one
        self._worker_init = WorkerInit(ReplicaInfo(rank, world_size), spec.worker_init_fn)

    def start_epoch(self, epoch: int, seed: int, batches: list[list[int]] | None,
                    first: int = 0, stride: int = 1) -> None:
        """The epoch's plan: a map-style dataset's batches for this replica (the ``first``-th
        of the epoch, then every ``stride``-th), or a stream's seed."""
        self._close_iter()
        self._epoch, self._seed = epoch, seed
        if batches is not None:
            self._plan.batches = batches
            self._plan.seeds = [seed + first + stride * i for i in range(len(batches))]

    def take(self, epoch: int, position: int) -> Any | None:
        """The batch at ``position`` of this replica's share of ``epoch``; None when a stream
        has ended (the replica then takes part idly)."""
        if epoch != self._epoch:
            raise RuntimeError(f"a LoaderRound for epoch {epoch} came before its LoaderEpoch "
                               f"(the replica is at epoch {self._epoch})")
        if self._iter is None or position != self._next:
            self._open(position)
        self._next = position + 1
        if self._ahead is not None:
            batch, self._ahead = self._ahead, None
        else:
            assert self._iter is not None
            batch = next(self._iter, _END)
        return None if batch is _END else batch

    def has_more(self) -> bool:
        """Whether a stream has another batch (read now and kept for the next ``take``)."""
        if not self.spec.stream:
            return self._next < len(self._plan.batches)
        if self._ahead is None and self._iter is not None:
            self._ahead = next(self._iter, _END)
        return self._ahead is not None and self._ahead is not _END

    def close(self) -> None:
        """Stop the loader workers."""
        self._close_iter()
        self._loader = None

    def _open(self, position: int) -> None:
        self._close_iter()
        loader = self._loader if self._loader is not None else self._build()
        self._loader = loader
        loader.generator = torch.Generator().manual_seed(self._seed + self.rank)
        if self.spec.stream:
            self._iter = iter(loader)
            with _kept_rngs():  # a stream cannot seek: read past what was trained
                for _ in range(position):
                    if next(self._iter, _END) is _END:
                        break
        else:
            self._plan.start = position
            self._iter = iter(loader)

    def _build(self) -> DataLoader[Any]:
        spec = self.spec
        common: dict[str, Any] = dict(spec.options, worker_init_fn=self._worker_init,
                                      multiprocessing_context=spec.multiprocessing_context
                                      or _default_start_method())
        if spec.num_workers == 0:
            for k in ("prefetch_factor", "persistent_workers", "multiprocessing_context"):
                common.pop(k, None)
        else:
            _expose_script_classes(spec.collate_fn, spec.worker_init_fn,
                                  *vars(type(spec.dataset)).values())
        if spec.stream:
            return DataLoader(spec.dataset, batch_size=spec.batch_size,
                              drop_last=spec.drop_last, collate_fn=spec.collate_fn, **common)
        if not spec.batched:  # batch_size=None: the sampler yields one index per batch
            return DataLoader(spec.dataset, batch_size=None, sampler=_Singles(self._plan),
                              collate_fn=spec.collate_fn, **common)
        return DataLoader(_SeededDataset(spec.dataset), batch_sampler=self._plan,
                          collate_fn=spec.collate_fn, **common)

    def _close_iter(self) -> None:
        self._iter, self._ahead = None, None


def _expose_script_classes(*functions: object) -> None:
    """Put the classes from the user's script that ``functions`` name in this process's
    ``__main__``: they came by value (cloudpickle), and loader processes send their batches
    back with plain pickle, which finds a class by module and name (a batch of a namedtuple
    or a dataclass from the script failed to pickle there, and the fit waited on it)."""
    main = sys.modules.get("__main__")
    for value in (v for fn in functions for v in _names_of(fn)):
        if main is not None and isinstance(value, type) and value.__module__ == "__main__" \
                and "." not in value.__qualname__ and not hasattr(main, value.__qualname__):
            setattr(main, value.__qualname__, value)


def _names_of(fn: object) -> list[object]:
    """What a function's globals and closure hold (nothing for another object)."""
    found = list(getattr(fn, "__globals__", {}).values())
    for cell in getattr(fn, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # an empty cell
            found.append(cell.cell_contents)
    return found


def _default_start_method() -> str | None:
    """Fork loader workers where the OS can: they inherit the dataset, which the replica got by
    value (a spawned loader worker would have to import its class, and the replica process does
    not import your script)."""
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else None


class _Singles:
    """A plan of one-index batches as a sampler of indices (``batch_size=None``)."""

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan

    def __iter__(self) -> Iterator[int]:
        for batch in self.plan:
            yield batch[0]

    def __len__(self) -> int:
        return len(self.plan)


def draw_base_seed(data: DataLoader[Any], workers: int) -> None:
    """Draw what iterating ``data`` draws before its sampler runs (the loader workers' base
    seed), so that its shuffle comes out as in a loop over the loader: from its own
    ``generator``, or without one from torch's RNG when one worker trains, on the caller's
    RNG as a loop would (its dropout masks then match too). With more workers the fit draws
    their seeds from torch's RNG, so the order is not a loop's anyway, and this draw is left
    out (which keeps the orders multi-worker runs had)."""
    if data.generator is not None or workers == 1:
        torch.empty((), dtype=torch.int64).random_(generator=data.generator)


def digest(batch: Any) -> str:
    """A short fingerprint of a batch's tensors (to spot replicas that read the same data)."""
    h = hashlib.blake2b(digest_size=12)
    for t in iter_tensors(batch):
        t = t.detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def epoch_batches(data: DataLoader[Any], workers: int) -> list[list[int]]:
    """The batches of indices a map-style DataLoader loads this epoch, in order (its sampler,
    drawn from its generator or torch's RNG as iterating the loader would)."""
    draw_base_seed(data, workers)
    if data.batch_sampler is not None:
        return [list(b) for b in data.batch_sampler]
    return [[i] for i in data.sampler]
