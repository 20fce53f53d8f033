"""What a message that no worker read held is released: its tensors travel as duplicated file
descriptors of shared memory, which this process keeps until a worker fetches them."""

from __future__ import annotations

import os
import shutil
from multiprocessing import resource_sharer

import pytest
import torch
from torch import nn

from paraloom import ParallelWrapper, WorkerError
from paraloom.training.transport import dumps, release_unfetched

pytestmark = pytest.mark.timeout(120)


def test_a_tensor_travels_as_a_handle_not_in_the_pickle() -> None:
    handles: list[int] = []
    data = dumps(torch.randn(1000, 1000), handles)
    assert len(data) < 10_000 and len(handles) == 1  # 4 MB of values, outside the pickle
    release_unfetched(handles)
    assert handles[0] not in resource_sharer._resource_sharer._cache  # type: ignore[attr-defined]


class _Raising(nn.Module):
    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise ValueError("the loss failed")


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_failed_fits_leave_no_descriptor_or_shared_memory_behind() -> None:
    """The batches queued behind a failed round stayed in the parent's descriptor sharer for
    good: 38 descriptors and 16 MiB of 4 MiB batches more after every failed fit."""
    model = nn.Linear(4096, 2)
    data = [(torch.randn(256, 4096), torch.randint(0, 2, (256,))) for _ in range(24)]  # 4 MiB
    with ParallelWrapper(model, loss_fn=_Raising(), workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as wrapper:
        cache = resource_sharer._resource_sharer._cache  # type: ignore[attr-defined]
        with pytest.raises(WorkerError, match="the loss failed"):
            wrapper.fit(data)
        # Other pools of this process (other tests') may hold handles of their own.
        waiting, descriptors = len(cache), _descriptors()
        used = shutil.disk_usage("/dev/shm").used
        for _ in range(3):
            with pytest.raises(WorkerError, match="the loss failed"):
                wrapper.fit(data)
        assert len(cache) <= waiting, f"{len(cache) - waiting} more descriptors wait for " \
            "workers that are gone"
        assert _descriptors() <= descriptors + 4
        grown = shutil.disk_usage("/dev/shm").used - used
        assert grown < 8 * 2**20, f"/dev/shm grew by {grown / 2**20:.0f} MiB"


def test_a_closed_wrapper_still_referenced_holds_no_pipes_port_or_thread(listening) -> None:
    """The last fit's run kept the closed pool: 19 descriptors (its queues' pipes, the store's
    socket and event loop), a listening port and a thread per closed wrapper kept in a list."""
    import gc
    import threading

    def fit_and_close() -> ParallelWrapper:
        model = nn.Linear(4, 2)
        with ParallelWrapper(model, loss_fn=nn.CrossEntropyLoss(), workers=2, progress=False,
                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as w:
            w.fit([(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(4)])
        return w

    kept = [fit_and_close()]  # the first one's imports and threads are the baseline
    gc.collect()
    descriptors, threads = _descriptors(), threading.active_count()
    ports = len(listening.of_process(os.getpid()))
    kept += [fit_and_close() for _ in range(3)]
    gc.collect()
    assert _descriptors() <= descriptors + 2, f"{_descriptors() - descriptors} more descriptors"
    assert len(listening.of_process(os.getpid())) <= ports
    assert threading.active_count() <= threads
    assert all(w.recoveries == [] and w.live_stats()["batches"] == 4 for w in kept)
