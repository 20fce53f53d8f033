"""The rendezvous stores listen on the address asked for, not on every interface: torch's
store server binds ``*:port`` whatever host name it is given."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
from torch import nn

from paraloom import ParallelWrapper
from paraloom.training.store import listening_store

pytestmark = pytest.mark.timeout(120)


def test_a_listening_store_binds_its_address_and_refuses_another_hosts(listening) -> None:
    store = listening_store("127.0.0.1", 0, datetime.timedelta(seconds=5))
    assert listening.addresses(store.port) == {"127.0.0.1"}
    with pytest.raises(OSError):
        listening_store("192.0.2.99", 0, datetime.timedelta(seconds=5))  # TEST-NET-1


def test_the_training_pools_store_listens_on_loopback_only(listening) -> None:
    """It was open on *:port: any host that reached the machine could read and write the
    keys the workers meet by."""
    model = nn.Linear(4, 1)
    with ParallelWrapper(model, loss_fn=nn.MSELoss(), workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as wrapper:
        wrapper.fit([(torch.randn(4, 4), torch.randn(4, 1))] * 2)
        port = wrapper._pool._store.port
        assert listening.addresses(port) == {"127.0.0.1"}
        # The workers' gloo sockets too (GLOO_SOCKET_IFNAME=lo; on a host whose name resolves
        # to a LAN address they listened there).
        listening = [a for pid in wrapper.worker_pids for a in listening.of_process(pid)]
        assert listening == ["127.0.0.1", "127.0.0.1"]


def test_a_worker_whose_parent_died_before_the_store_answered_exits_at_once() -> None:
    """A parent killed while its pool started left a worker retrying the store's connection
    for the whole timeout (10 minutes by default), holding the forkserver with it."""
    import subprocess
    import time

    from paraloom.training.worker import WorkerConfig, _store

    gone = subprocess.Popen(["true"])
    gone.wait()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = WorkerConfig(rank=1, world_size=2, store_port=port, backend="gloo", device="cpu",
                       threads=1, timeout_s=60.0, parent_pid=gone.pid)
    started = time.monotonic()
    with pytest.raises(SystemExit, match="parent process exited"):
        _store(cfg)
    assert time.monotonic() - started < 5.0
