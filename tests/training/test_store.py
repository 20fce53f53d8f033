"""The rendezvous stores listen on the address asked for, not on every interface: torch's
store server binds ``*:port`` whatever host name it is given."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch._C._distributed_c10d import TCPStore

from paraloom import ParallelWrapper
from paraloom.spark.training.rendezvous import NetworkSettings, meet
from paraloom.training.store import listening_store

pytestmark = pytest.mark.timeout(120)


def _address(hex_address: str) -> str:
    """An address as /proc/net/tcp{,6} writes it (little-endian words), as text."""
    if len(hex_address) == 8:
        return ".".join(str(int(hex_address[i:i + 2], 16)) for i in (6, 4, 2, 0))
    words = [bytes.fromhex(hex_address[i:i + 8])[::-1] for i in range(0, 32, 8)]
    return str(ipaddress.IPv6Address(b"".join(words)))


def _listening() -> list[tuple[str, int, str]]:
    """Every listening TCP socket: (address, port, inode), from /proc/net/tcp and tcp6."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].split(":")
                if fields[3] == "0A":  # LISTEN
                    found.append((_address(address), int(hex_port, 16), fields[9]))
    return found


def listening_addresses(port: int) -> set[str]:
    """The addresses something listens on at ``port``."""
    return {address for address, p, _ in _listening() if p == port}


def addresses_listened_on_by(pid: int) -> list[str]:
    """The addresses process ``pid``'s listening sockets are bound to."""
    fd_dir = Path(f"/proc/{pid}/fd")
    inodes = set()
    for fd in fd_dir.iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    return [address for address, _, inode in _listening() if inode in inodes]


def test_a_listening_store_binds_its_address_and_refuses_another_hosts() -> None:
    store = listening_store("127.0.0.1", 0, datetime.timedelta(seconds=5))
    assert listening_addresses(store.port) == {"127.0.0.1"}
    with pytest.raises(OSError):
        listening_store("192.0.2.99", 0, datetime.timedelta(seconds=5))  # TEST-NET-1


def test_the_training_pools_store_listens_on_loopback_only() -> None:
    """It was open on *:port: any host that reached the machine could read and write the
    keys the workers meet by."""
    model = nn.Linear(4, 1)
    with ParallelWrapper(model, loss_fn=nn.MSELoss(), workers=2, progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as wrapper:
        wrapper.fit([(torch.randn(4, 4), torch.randn(4, 1))] * 2)
        port = wrapper._pool._store.port
        assert listening_addresses(port) == {"127.0.0.1"}
        # The workers' gloo sockets too (GLOO_SOCKET_IFNAME=lo; on a host whose name resolves
        # to a LAN address they listened there).
        listening = [a for pid in wrapper.worker_pids for a in addresses_listened_on_by(pid)]
        assert listening == ["127.0.0.1", "127.0.0.1"]


class OneTask:
    """A one-task barrier context (what meet needs from BarrierTaskContext)."""

    def partitionId(self) -> int:  # noqa: N802 (Spark's name)
        return 0

    def getTaskInfos(self) -> list:  # noqa: N802
        return [SimpleNamespace(address="127.0.0.1:7077")]

    def allGather(self, message: str) -> list[str]:  # noqa: N802
        return [message]


def test_the_spark_store_listens_on_the_announced_address_only() -> None:
    """NetworkSettings(host="127.0.0.1") left it open on *:port to the network."""
    rdv, store = meet(OneTask(), None, 10, NetworkSettings(host="127.0.0.1"))
    assert store is not None and listening_addresses(store.port) == {"127.0.0.1"}
    rdv, store = meet(OneTask(), None, 10)  # the task's address: 127.0.0.1 here
    assert store is not None and listening_addresses(store.port) == {"127.0.0.1"}
    # Another machine's address: every interface, IPv6 and IPv4, as torch's store listened.
    rdv, store = meet(OneTask(), None, 10, NetworkSettings(host="10.1.2.3"))
    assert store is not None and listening_addresses(store.port) == {"::"}
    assert rdv.host == "10.1.2.3"
    # A host name is not looked up (the others may resolve it otherwise): every interface.
    rdv, store = meet(OneTask(), None, 10, NetworkSettings(host="localhost"))
    assert store is not None and listening_addresses(store.port) == {"::"}
    client = TCPStore("127.0.0.1", store.port, is_master=False,
                      timeout=datetime.timedelta(seconds=5))
    client.set("k", "v")
    assert store.get("k") == b"v"
    if socket.has_ipv6:  # and over IPv6, as the old store answered on ::1
        rdv, store = meet(OneTask(), None, 10, NetworkSettings(host="::1"))
        assert store is not None and listening_addresses(store.port) == {"::1"}


def test_a_worker_whose_parent_died_before_the_store_answered_exits_at_once() -> None:
    """A parent killed while its pool started left a worker retrying the store's connection
    for the whole timeout (10 minutes by default), holding the forkserver with it."""
    import socket
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
