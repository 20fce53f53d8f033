"""NetworkSettings for the shared-gradients master: port range, announced host, interface."""

from __future__ import annotations

import datetime
import os
import socket
from types import SimpleNamespace

import numpy as np
import pytest
import spark_helpers as h
import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import TCPStore

from paraloom.spark import NetworkSettings, SharedTrainingMaster, SparkModel, SparkTrainingError
from paraloom.spark.training.rendezvous import interface_address, meet


class OneTask:
    """A one-task barrier context (what meet needs from BarrierTaskContext)."""

    def partitionId(self) -> int:  # noqa: N802 (Spark's name)
        return 0

    def getTaskInfos(self) -> list:  # noqa: N802
        return [SimpleNamespace(address="127.0.0.1:7077")]

    def allGather(self, message: str) -> list[str]:  # noqa: N802
        return [message]


def test_store_listens_in_the_range_skipping_a_busy_port_and_announces_the_host():
    first = h.free_ports(3)
    busy = dist.TCPStore("0.0.0.0", first, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=5))
    try:
        network = NetworkSettings(port_range=(first, first + 2), host="10.1.2.3")
        rdv, store = meet(OneTask(), None, 10, network)
        assert rdv.port == store.port == first + 1 and rdv.host == "10.1.2.3"
        assert rdv.errors == ()
        # every port taken: the error is announced (peers do not wait), naming the range
        full = NetworkSettings(port_range=(first, first + 1))
        rdv, none = meet(OneTask(), None, 10, full)
        assert none is None
        assert rdv.errors and f"no free port in port_range=({first}, {first + 1})" in \
            rdv.errors[0][1]
    finally:
        del busy


def test_settings_are_checked_and_the_interface_reaches_gloo_and_nccl(monkeypatch):
    for bad in ((2, 1), (0, 10), (1, 70000), (1, 2, 3), (1.0, 2)):
        with pytest.raises(ValueError, match="port_range="):
            NetworkSettings(port_range=bad)
    with pytest.raises(ValueError, match="interface=''"):
        NetworkSettings(interface="")
    with pytest.raises(TypeError, match="expected a NetworkSettings"):
        SharedTrainingMaster(network={"port_range": (1, 2)})
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth9")
    with NetworkSettings(interface="lo").interface_env():
        assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    # a reused Python worker's later tasks see what was there before
    assert "GLOO_SOCKET_IFNAME" not in os.environ and os.environ["NCCL_SOCKET_IFNAME"] == "eth9"
    assert NetworkSettings(port_range=[5000, 5010]).port_range == (5000, 5010)
    assert SharedTrainingMaster(network=NetworkSettings(port_range=(5000, 5010))).network


def test_the_interface_gives_the_announced_address_and_a_missing_one_is_named():
    assert interface_address("lo") == "127.0.0.1"
    rdv, store = meet(OneTask(), None, 10, NetworkSettings(interface="lo"))
    assert rdv.host == "127.0.0.1" and rdv.port == store.port and rdv.errors == ()
    # host= wins over the interface's address
    rdv, _ = meet(OneTask(), None, 10, NetworkSettings(interface="lo", host="10.1.2.3"))
    assert rdv.host == "10.1.2.3"
    # a host without the interface fails the rendezvous at once, naming it and the fix
    rdv, none = meet(OneTask(), None, 10, NetworkSettings(interface="nosuch0"))
    assert none is None
    assert "interface='nosuch0'" in rdv.errors[0][1] and "'lo'" in rdv.errors[0][1]


def test_a_fit_whose_hosts_lack_the_interface_fails_naming_it(spark, sc):
    """The rendezvous error of a task reaches the driver as the cause, not as "a peer failed"."""
    model = nn.Linear(64, 10)
    master = SharedTrainingMaster(16, workers=2, network=NetworkSettings(interface="nosuch0"),
                                  rendezvous_timeout=60, timeout=30)
    net = SparkModel(spark, model, master, loss_fn=nn.CrossEntropyLoss(),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    rows = sc.parallelize([(np.zeros(64, np.float32), i % 10) for i in range(64)], 2)
    with pytest.raises(SparkTrainingError, match=r"interface='nosuch0'.*its interfaces are"):
        net.fit(rows)


def test_the_spark_store_listens_on_the_announced_address_only(listening) -> None:
    """NetworkSettings(host="127.0.0.1") left it open on *:port to the network."""
    rdv, store = meet(OneTask(), None, 10, NetworkSettings(host="127.0.0.1"))
    assert store is not None and listening.addresses(store.port) == {"127.0.0.1"}
    rdv, store = meet(OneTask(), None, 10)  # the task's address: 127.0.0.1 here
    assert store is not None and listening.addresses(store.port) == {"127.0.0.1"}
    # Another machine's address: every interface, IPv6 and IPv4, as torch's store listened.
    rdv, store = meet(OneTask(), None, 10, NetworkSettings(host="10.1.2.3"))
    assert store is not None and listening.addresses(store.port) == {"::"}
    assert rdv.host == "10.1.2.3"
    # A host name is not looked up (the others may resolve it otherwise): every interface.
    rdv, store = meet(OneTask(), None, 10, NetworkSettings(host="localhost"))
    assert store is not None and listening.addresses(store.port) == {"::"}
    client = TCPStore("127.0.0.1", store.port, is_master=False,
                      timeout=datetime.timedelta(seconds=5))
    client.set("k", "v")
    assert store.get("k") == b"v"
    if socket.has_ipv6:  # and over IPv6, as the old store answered on ::1
        rdv, store = meet(OneTask(), None, 10, NetworkSettings(host="::1"))
        assert store is not None and listening.addresses(store.port) == {"::1"}
