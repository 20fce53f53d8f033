"""NetworkSettings for the shared-gradients master: port range, announced host, interface."""

from __future__ import annotations

import datetime
import os
import socket
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from paraloom.spark import NetworkSettings, SharedTrainingMaster
from paraloom.spark.training.rendezvous import meet


class OneTask:
    """A one-task barrier context (what meet needs from BarrierTaskContext)."""

    def partitionId(self) -> int:  # noqa: N802 (Spark's name)
        return 0

    def getTaskInfos(self) -> list:  # noqa: N802
        return [SimpleNamespace(address="127.0.0.1:7077")]

    def allGather(self, message: str) -> list[str]:  # noqa: N802
        return [message]


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports that are free now."""
    for start in range(41000, 60000, 97):
        try:
            socks = []
            for p in range(start, start + n):
                s = socket.socket()
                s.bind(("0.0.0.0", p))
                socks.append(s)
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        if len(socks) == n:
            return start
    raise RuntimeError("no free port range")


def test_store_listens_in_the_range_skipping_a_busy_port_and_announces_the_host():
    first = _free_ports(3)
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
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    NetworkSettings(interface="lo").apply_interface()
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    assert NetworkSettings(port_range=[5000, 5010]).port_range == (5000, 5010)
    assert SharedTrainingMaster(network=NetworkSettings(port_range=(5000, 5010))).network
