"""Shared fixtures: small real data sets, and a check that no test leaks worker processes."""

from __future__ import annotations

import contextlib
import ipaddress
import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from paraloom.datasets import digits


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cuda`` tests run where torch sees a GPU and are skipped elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def digits_train():
    return digits("train")


@pytest.fixture(scope="session")
def digits_test():
    return digits("test")


@pytest.fixture
def digits_loader(digits_train):
    torch.manual_seed(0)
    return DataLoader(digits_train, batch_size=32, shuffle=True)


@pytest.fixture(autouse=True)
def _cpu_threads():
    """Keep each test's own torch threads modest: the machine has 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    yield
    torch.set_num_threads(before)


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


def _addresses(port: int) -> set[str]:
    """The addresses something listens on at ``port``."""
    return {address for address, p, _ in _listening() if p == port}


def _of_process(pid: int) -> list[str]:
    """The addresses process ``pid``'s listening sockets are bound to."""
    fd_dir = Path(f"/proc/{pid}/fd")
    inodes = set()
    for fd in fd_dir.iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    return [address for address, _, inode in _listening() if inode in inodes]


class _Listening:
    """What listens where, from /proc (``addresses(port)``, ``of_process(pid)``)."""

    addresses = staticmethod(_addresses)
    of_process = staticmethod(_of_process)


@pytest.fixture
def listening() -> _Listening:
    """The TCP sockets listening on this machine: for tests of what a server binds."""
    return _Listening()
