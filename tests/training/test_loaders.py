"""Per-replica data loading: each worker runs its own DataLoader over its share of the data."""

from __future__ import annotations

import os
import threading
import warnings

import pytest
import torch
from fault_helpers import FailWhenArmed, digits_loader
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    SequentialSampler,
    get_worker_info,
)
from training_helpers import digest

import paraloom
from paraloom import (
    NotPicklableError,
    ParallelWrapper,
    TrainingCheckpoint,
    WorkerError,
)
from paraloom.listeners import CheckpointListener
from paraloom.training import recovery

pytestmark = pytest.mark.timeout(120)


class Rows(Dataset):
    """Row i is (i repeated 4 times, i); ``noise`` adds a random augmentation."""

    def __init__(self, n, noise=False, fail_at=None):
        self.n, self.noise, self.fail_at = n, noise, fail_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise ValueError(f"row {i} is corrupt")
        x = torch.full((4,), float(i))
        if self.noise:
            x = x + torch.rand(4)
        return x, torch.tensor(i)


class Stream(IterableDataset):
    """Items ``0..n-1``, sharded by replica and loader worker; ``sizes`` instead gives replica r
    the items of its own range (uneven shards); ``batched`` yields each as a batch of one."""

    def __init__(self, n=0, sizes=None, shard=True, batched=False):
        self.n, self.sizes, self.shard, self.batched = n, sizes, shard, batched

    def __iter__(self):
        info = paraloom.replica_info()
        rank, world = (info.rank, info.world_size) if info and self.shard else (0, 1)
        if self.sizes is not None:
            start = sum(self.sizes[:rank])
            items = range(start, start + self.sizes[rank])
        else:
            items = range(rank, self.n, world)
        worker = get_worker_info()
        if worker is not None and self.shard:
            items = items[worker.id::worker.num_workers]
        for i in items:
            x, y = torch.full((4,), float(i)), torch.tensor(i)
            yield (x[None], y[None]) if self.batched else (x, y)


class Counter(nn.Module):
    """A small model whose buffer counts how often each row was trained on (in one process)."""

    def __init__(self, n):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
        self.register_buffer("counts", torch.zeros(n))


def counting_step(model, batch):
    x, y = batch
    model.counts.index_add_(0, y, torch.ones(len(y)))
    return (model.net(x / 50).squeeze(1) - y / 50).pow(2).mean()


class CountingStep:
    """``counting_step`` that also writes the rows it trained on to its process's file, so that
    a test counts what every replica trained whatever averaging makes of the buffers."""

    def __init__(self, directory):
        self.directory = str(directory)

    def __call__(self, model, batch):
        with open(os.path.join(self.directory, f"{os.getpid()}.rows"), "a") as f:
            f.write(" ".join(str(i) for i in batch[1].tolist()) + "\n")
        return counting_step(model, batch)


_ROWS = 64


@pytest.fixture(scope="module")
def wrapper(tmp_path_factory):
    """One pool of 2 workers for the tests below (starting one takes seconds)."""
    model = Counter(_ROWS)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rows = tmp_path_factory.mktemp("rows")
    with ParallelWrapper(model, step_fn=CountingStep(rows), optimizer=optimizer, workers=2,
                         averaging_frequency=2, progress=False) as w:
        w.rows = rows
        yield w


def _restart(w):
    """The wrapper's model and optimizer as they were built (seeded), no listeners, no rows
    counted."""
    torch.manual_seed(0)
    w.model.load_state_dict(Counter(_ROWS).state_dict())
    w._user_optimizer.state.clear()
    w.listeners[:] = []
    for path in w.rows.glob("*.rows"):
        path.unlink()


def _fit(w, data, epochs=1, **fit_options):
    """The fit's stats, and how often each row was trained on, summed over the replicas."""
    _restart(w)
    stats = w.fit(data, epochs=epochs, **fit_options)
    seen = [int(i) for path in w.rows.glob("*.rows") for i in path.read_text().split()]
    return torch.bincount(torch.tensor(seen, dtype=torch.long), minlength=_ROWS), stats


@pytest.mark.parametrize("drop_last", [False, True])
def test_map_loader_trains_every_index_once_per_epoch(wrapper, drop_last):
    # 43 rows in batches of 4: 11 batches (the last of 3 rows), 6 and 5 per worker.
    loader = DataLoader(Rows(43), batch_size=4, shuffle=True, num_workers=2,
                        drop_last=drop_last, persistent_workers=True, prefetch_factor=2,
                        generator=torch.Generator().manual_seed(3))
    counts, stats = _fit(wrapper, loader, epochs=2)
    counts = counts[:43]
    if drop_last:  # one whole batch of 3 a epoch is left out; the rest trained once
        assert set(counts.unique().tolist()) <= {0, 1, 2}
        assert int(counts.sum()) == 2 * 40
        assert stats["batches"] == 20 and stats["samples"] == 80
    else:
        assert counts.tolist() == [2] * 43
        assert stats["batches"] == 22 and stats["samples"] == 86
        assert stats["rounds"] == 12  # 6 rounds a epoch, the last with one idle worker


def test_map_loader_with_a_batch_sampler_keeps_its_batches(wrapper):
    """``batch_sampler=`` leaves the DataLoader's batch_size None: it still makes batches."""
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(43)), 9,
                                            drop_last=False)
    loader = DataLoader(Rows(43), batch_sampler=sampler, num_workers=2)
    counts, stats = _fit(wrapper, loader)
    assert counts[:43].tolist() == [1] * 43
    assert stats["batches"] == 5 and stats["samples"] == 43


class EpochHalves(torch.utils.data.Sampler):
    """The first half of the rows in even epochs, the second in odd ones (``set_epoch``)."""

    def __init__(self, n):
        self.n, self.epoch, self.told = n, 0, []

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.told.append(epoch)

    def __len__(self):
        return self.n // 2

    def __iter__(self):
        half = self.n // 2
        return iter(range(half) if self.epoch % 2 == 0 else range(half, self.n))


def test_a_sampler_is_told_each_epoch_as_lightning_tells_it(wrapper):
    sampler = EpochHalves(40)
    loader = DataLoader(Rows(40), batch_size=4, sampler=sampler)
    counts, stats = _fit(wrapper, loader, epochs=3)
    assert sampler.told == [0, 1, 2]
    assert counts[:20].tolist() == [2] * 20 and counts[20:40].tolist() == [1] * 20
    assert stats["samples"] == 60


def _pairs(rows):
    xs, ys = zip(*rows, strict=True)
    return torch.stack(xs), torch.stack(ys)


def test_map_loader_with_a_sampler_a_collate_fn_and_one_worker_in_process():
    sampler = torch.utils.data.SubsetRandomSampler(range(0, 30, 3),
                                                   generator=torch.Generator().manual_seed(1))
    loader = DataLoader(Rows(30), batch_size=3, sampler=sampler, collate_fn=_pairs,
                        num_workers=1)
    model = Counter(30)
    with ParallelWrapper(model, step_fn=counting_step, workers=1, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.01)) as w:
        w.fit(loader)
    assert model.counts.round().long().tolist() == [1 if i % 3 == 0 else 0 for i in range(30)]


@pytest.mark.parametrize("sizes", [[7, 2], [0, 5]])
def test_iterable_dataset_with_uneven_shards_ends_without_a_hang(wrapper, sizes):
    # Replica 0 reads `sizes[0]` rows, replica 1 `sizes[1]`: the one that ends first takes
    # part idly until the other is done; every row trained once, no round without a batch.
    n = sum(sizes)
    counts, stats = _fit(wrapper, DataLoader(Stream(sizes=sizes), batch_size=2,
                                             num_workers=1), epochs=2)
    assert counts[:n].tolist() == [2] * n
    assert stats["samples"] == 2 * n
    assert stats["rounds"] == 2 * -(-max(sizes) // 2)


def test_iterable_dataset_yielding_batches_is_read_by_every_worker(wrapper):
    counts, stats = _fit(wrapper, Stream(n=10, batched=True))  # an IterableDataset of batches
    assert counts[:10].tolist() == [1] * 10
    assert stats["batches"] == 10


def test_a_stream_that_does_not_shard_gets_a_warning_naming_the_fix(wrapper):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts, _ = _fit(wrapper, DataLoader(Stream(n=8, shard=False), batch_size=2))
    assert counts[:8].tolist() == [2] * 8  # what the warning is about: each row trained twice
    messages = [str(w.message) for w in caught if "replica_info" in str(w.message)]
    assert len(messages) == 1 and "get_worker_info" in messages[0]


def test_replica_info_is_none_outside_training():
    assert paraloom.replica_info() is None


def test_exact_resume_mid_epoch_with_two_loader_workers(wrapper, tmp_path):
    # Random augmentation in the loader workers, dropout in the replicas: a run resumed from
    # mid-epoch skips the trained batches without loading them and still ends bit-identical.
    def loader():
        return DataLoader(Rows(50, noise=True), batch_size=4, shuffle=True, num_workers=2)

    _restart(wrapper)
    wrapper.listeners[:] = [CheckpointListener(tmp_path, every_n_iterations=1,
                                               every_n_epochs=None, keep_last=100)]
    wrapper.fit(loader(), epochs=2)  # 13 batches a epoch: 7 rounds
    reference = digest(wrapper.model)
    checkpoints = [TrainingCheckpoint.load(p) for p in sorted(tmp_path.iterdir())]
    positions = {(c.epoch, c.batch): c for c in checkpoints}
    assert {(0, 6), (1, 4)} <= set(positions)
    for name in ("epoch0-iter", "epoch1-iter"):
        path = next(p for p in tmp_path.iterdir() if name in p.name and
                    0 < TrainingCheckpoint.load(p).batch < 13)
        _fit(wrapper, loader(), epochs=2, resume_from=path)
        assert digest(wrapper.model) == reference, path.name


def test_an_error_in_a_loader_worker_names_the_worker_and_keeps_the_traceback(wrapper):
    loader = DataLoader(Rows(16, fail_at=9), batch_size=2, num_workers=1)
    with pytest.raises(WorkerError) as caught:
        _fit(wrapper, loader)
    error = caught.value
    assert error.worker == 0 and "row 9 is corrupt" in str(error)  # batch 4: worker 0's third
    assert "in __getitem__" in error.remote_traceback


class _Locked(Rows):
    def __init__(self, n):
        super().__init__(n)
        self.lock = threading.Lock()


def test_a_dataset_that_cannot_be_pickled_is_named(wrapper):
    loader = DataLoader(_Locked(8), batch_size=2, num_workers=1)
    with pytest.raises(NotPicklableError, match="_Locked.*picklable"):
        _fit(wrapper, loader)


def test_a_worker_replaced_mid_epoch_goes_on_from_its_share_of_the_batches(tmp_path,
                                                                            monkeypatch):
    # The new worker gets the epoch's plan again (its LoaderEpoch outlives the restore point)
    # and each replayed round names its position: the result is the uninterrupted one.
    monkeypatch.setattr(recovery, "_MIN_INTERVAL_S", 0.0)  # a restore point every round
    base = digits_loader(rows=192)
    torch.manual_seed(1)
    model = FailWhenArmed(tmp_path / "failed", tmp_path / "armed", how="kill", at=5)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer, workers=2,
                         max_failures=1, progress=False) as w:
        def fit():
            model.load_state_dict(start)
            optimizer.state.clear()
            return w.fit(DataLoader(base.dataset, batch_size=32, shuffle=True, num_workers=1,
                                    generator=torch.Generator().manual_seed(5)), epochs=2)

        fit()
        reference = digest(model)
        (tmp_path / "armed").touch()
        stats = fit()
    assert (tmp_path / "failed").exists() and stats["failures"] == 1
    assert stats["batches"] == 12
    assert digest(model) == reference


def test_a_loaders_own_generator_gives_the_order_a_loop_over_the_loader_gives():
    from paraloom.training.dealing import batch_rounds
    from paraloom.training.loaders import epoch_batches

    def loader():
        return DataLoader(Rows(24), batch_size=4, shuffle=True,
                          generator=torch.Generator().manual_seed(7))

    looping, sampled, dealt = loader(), loader(), loader()
    looped = [[y.tolist() for _, y in looping] for _ in range(2)]
    assert [epoch_batches(sampled, 2) for _ in range(2)] == looped  # workers' own loaders
    by_index = [[b for r in batch_rounds(dealt, object(), 2, 0, 0, lambda b: b)  # type: ignore[arg-type]
                 for b in r] for _ in range(2)]
    assert by_index == looped  # indices dealt by the parent


class _Pairs(Dataset):
    """Ten samples of five features and one target."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((5,), float(i)), torch.zeros(1)


def _squared_error(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return (model(batch[0]) - batch[1]).pow(2).mean()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_loader_without_batching_counts_one_sample_a_batch(workers):
    """DataLoader(batch_size=None) yields single samples: each counted its first dimension,
    the features (samples 50 for 10)."""
    model = nn.Linear(5, 1)
    with ParallelWrapper(model, step_fn=_squared_error, workers=workers, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.01)) as wrapper:
        stats = wrapper.fit(DataLoader(_Pairs(), batch_size=None), epochs=2)
        assert stats["batches"] == 20 and stats["samples"] == 20
        # An IterableDataset's items are what it yields: batches, as when it is passed alone
        # (each was counted one sample: 2 for 10).
        stats = wrapper.fit(DataLoader(_PairBatches(), batch_size=None))
        assert stats["batches"] == 2 and stats["samples"] == 10
        # A BatchSampler as the sampler: dataset[indices] is a batch of them.
        sampler = BatchSampler(SequentialSampler(range(10)), batch_size=4, drop_last=False)
        stats = wrapper.fit(DataLoader(_Indexed(), sampler=sampler, batch_size=None))
        assert stats["batches"] == 3 and stats["samples"] == 10


class _PreBatched(Dataset):
    """Four items, each a batch of three rows: what DataLoader(batch_size=None) is for."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((3, 5), float(i)), torch.zeros(3, 1)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_without_batching_over_batches_counts_their_rows(num_workers: int) -> None:
    """Each item counted one sample: 4 for 12."""
    model = nn.Linear(5, 1)
    with ParallelWrapper(model, step_fn=_squared_error, workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.01)) as wrapper:
        stats = wrapper.fit(DataLoader(_PreBatched(), batch_size=None,
                                       num_workers=num_workers), epochs=2)
    assert stats["batches"] == 8 and stats["samples"] == 24


class _PairBatches(IterableDataset):
    """``_Pairs`` in two batches of five, sharded over the replicas."""

    def __iter__(self):
        info = paraloom.replica_info() or paraloom.ReplicaInfo(0, 1)
        for start in range(info.rank * 5, 10, 5 * info.world_size):
            yield torch.full((5, 5), float(start)), torch.zeros(5, 1)


class _Indexed(Dataset):
    """Rows of ``_Pairs`` taken several at once: ``dataset[[0, 1, 2]]`` is a batch."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(rows, dtype=torch.float32)[:, None].expand(-1, 5), \
            torch.zeros(len(rows), 1)
