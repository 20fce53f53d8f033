"""How one epoch of the user's data becomes rounds: one batch (or its indices, or its
position in a worker's share) for each worker, and the messages that deal them.

A round is one batch dealt to each worker; every replica steps once per round (a worker with no
batch in the short last round takes part idly). Three kinds of source:

- a DataLoader each worker runs itself (``LoaderSpec``): a round is the next position in each
  worker's share of the epoch's batches, which a ``LoaderEpoch`` sent at the epoch's start;
- a map-style dataset the workers gather rows of (``IndexedDataset``): a round holds index lists;
- anything else: the parent reads the batches and copies each to shared memory.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from paraloom.data import IndexedDataset, Prefetcher
from paraloom.training.loaders import LoaderSpec, draw_base_seed, epoch_batches
from paraloom.training.messages import IndexRound, LoaderEpoch, LoaderRound, Round, RoundMessage
from paraloom.training.pool import Pool
from paraloom.training.transport import shared_copy

__all__ = ["Source", "batch_rounds", "check_dealt", "data_generators", "data_rng",
           "loader_rounds", "round_message", "set_data_rng", "set_sampler_epoch",
           "total_batches", "yields_samples"]

Source = LoaderSpec | IndexedDataset | None
"""What the workers load themselves: their own DataLoader, a dataset to gather rows of by index,
or nothing (batches go through the parent)."""


def round_message(source: Source, round_id: int, epoch: int, payload: Any) -> RoundMessage:
    """The message that deals ``payload`` (a batch, an index list, a position) in a round."""
    if isinstance(source, LoaderSpec):
        return LoaderRound(round_id, epoch, payload)
    if source is not None:
        return IndexRound(round_id, payload)
    return Round(round_id, payload)


def batch_rounds(data: Any, source: Source, workers: int, skip: int, prefetch: int,
                 checked: Callable[[Any], Any]) -> Iterator[list[Any]]:
    """Group the epoch's batches past the first ``skip`` (index lists for an indexed dataset,
    batches copied to shared memory otherwise, each passed through ``checked``) into rounds of
    ``workers`` (the last may be short). ``prefetch`` batches are read ahead on a thread."""
    if source is not None:
        draw_base_seed(data, workers)
        batches = itertools.islice(data.batch_sampler, skip, None)
        payloads: Iterable[Any] = (list(b) for b in batches)
        prefetcher = None
    else:
        # Copy each batch as it is read: a source may refill one buffer for every batch.
        copied = (shared_copy(checked(b)) for b in itertools.islice(data, skip, None))
        prefetcher = Prefetcher(copied, prefetch) if prefetch else None
        payloads = prefetcher or copied
    try:
        chunk: list[Any] = []
        for payload in payloads:
            chunk.append(payload)
            if len(chunk) == workers:
                yield chunk
                chunk = []
        if chunk:
            yield chunk
    finally:
        if prefetcher is not None:
            prefetcher.close()


def loader_rounds(pool: Pool, data: DataLoader[Any], epoch: int, skip: int,
                  workers: int) -> Iterator[list[int]]:
    """Send each worker its share of the epoch's batches (``LoaderEpoch``: batch ``skip +
    rank``, then every ``workers``-th); a round is the next position in every share."""
    batches = epoch_batches(data, workers)[skip:]
    seed = int(torch.randint(0, 2**62, ()).item())
    for rank in range(workers):
        pool.send(rank, LoaderEpoch(epoch, seed, batches[rank::workers], skip + rank, workers))
    for position in range(-(-len(batches) // workers)):
        yield [position] * min(workers, len(batches) - position * workers)


def set_sampler_epoch(data: Any, epoch: int) -> None:
    """Tell the data source's samplers the epoch (``set_epoch``), as Lightning does before
    each epoch: a sampler that seeds its order with it (``DistributedSampler``'s kind) then
    gives each epoch its own order."""
    batch_sampler = getattr(data, "batch_sampler", None)
    told: list[object] = []
    for sampler in (getattr(data, "sampler", None), batch_sampler,
                    getattr(batch_sampler, "sampler", None)):
        if callable(getattr(sampler, "set_epoch", None)) and all(sampler is not s for s in told):
            sampler.set_epoch(epoch)  # type: ignore[union-attr]
            told.append(sampler)


def data_generators(data: Any) -> list[torch.Generator]:
    """The data source's own generators (a DataLoader's, its sampler's), each once."""
    found: list[torch.Generator] = []
    sampler = getattr(data, "sampler", None)
    batch_sampler = getattr(data, "batch_sampler", None)
    for g in (getattr(data, "generator", None), getattr(sampler, "generator", None),
              getattr(getattr(batch_sampler, "sampler", None), "generator", None)):
        if isinstance(g, torch.Generator) and all(g is not x for x in found):
            found.append(g)
    return found


def data_rng(generators: list[torch.Generator]) -> list[torch.Tensor]:
    """torch's RNG state and the data source's generators' states: where an epoch's order
    comes from."""
    return [torch.get_rng_state(), *(g.get_state() for g in generators)]


def set_data_rng(states: list[torch.Tensor], generators: list[torch.Generator]) -> None:
    """Put back what ``data_rng`` returned (a checkpoint's), so an epoch replays its order."""
    if len(states) != len(generators) + 1:
        raise ValueError(f"the checkpoint holds {len(states) - 1} data generator state(s) but "
                         f"this data source has {len(generators)}: resume with the same kind of "
                         "DataLoader (with or without generator=) as the interrupted run")
    torch.set_rng_state(states[0])
    for g, state in zip(generators, states[1:], strict=True):
        g.set_state(state)


def total_batches(data: Any, epochs: int) -> int | None:
    """Batches in ``epochs`` passes over ``data``, when it has a length."""
    try:
        return len(data) * epochs
    except TypeError:
        return None


def yields_samples(data: object) -> bool:
    """Whether each of ``data``'s "batches" is one sample: a ``DataLoader(batch_size=None)``
    over a map-style dataset indexed by single indices (``dataset[i]`` is a sample). Over an
    ``IterableDataset`` it yields what the dataset yields, batches as when the dataset is
    passed alone; with a ``BatchSampler`` as its sampler, ``dataset[indices]`` is a batch."""
    return isinstance(data, torch.utils.data.DataLoader) and data.batch_size is None \
        and data.batch_sampler is None \
        and not isinstance(data.dataset, torch.utils.data.IterableDataset) \
        and not isinstance(data.sampler, torch.utils.data.BatchSampler)


def check_dealt(dealt: int, epoch: int, first: bool) -> None:
    """Refuse an epoch that yielded no batch: an empty source, or a one-shot generator."""
    if dealt == 0 and first:
        raise ValueError("data yielded no batches at all (an empty generator or "
                         "IterableDataset?); expected at least one (inputs, targets) batch")
    if dealt == 0:
        raise ValueError(f"data yielded no batches in epoch {epoch}: pass a re-iterable "
                         "source (a DataLoader or a list), not a one-shot generator")
