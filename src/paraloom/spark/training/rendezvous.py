"""How barrier tasks find each other: one ``allGather``, then a torch.distributed group.

Spark-free: the barrier context is passed in (a ``BarrierContext``: anything with
``partitionId()``, ``getTaskInfos()`` and ``allGather(str)``), so these functions are tested
without a cluster.
``BarrierTaskContext.allGather`` costs about a second (Spark polls), so it is called exactly
once per task: rank 0 opens a ``TCPStore`` on a free port first and announces it, with a run id
for this stage attempt; every other rank announces only whether its own setup failed.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import ipaddress
import json
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict, TypeVar

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from paraloom.training.group import Membership
from paraloom.training.store import listening_store

__all__ = ["BarrierContext", "NetworkSettings", "Rendezvous", "task_host", "local_rank",
           "bounded_call", "interface_address", "meet", "connect", "init_group"]

T = TypeVar("T")


class _TaskInfo(Protocol):
    """A ``BarrierTaskInfo``: where one barrier task runs."""

    @property
    def address(self) -> str: ...


class BarrierContext(Protocol):
    """What the rendezvous uses of pyspark's ``BarrierTaskContext`` (tests pass a fake one)."""

    def partitionId(self) -> int: ...

    def getTaskInfos(self) -> Sequence[_TaskInfo]: ...

    def allGather(self, message: str = "") -> list[str]: ...


@dataclass(frozen=True)
class NetworkSettings:
    """Where the shared-gradients master talks (DL4J's VoidConfiguration port and network).

    ``port_range=(first, last)``: rank 0's rendezvous store listens on the first free port
    in it (inclusive; default: any free port). ``host``: the address the other ranks connect
    to (default: ``interface``'s address on rank 0's host if given, else the address Spark
    gives rank 0's task). ``interface``: the network interface gloo / NCCL bind to for the
    collectives (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, e.g. "eth1"; default: their
    own choice); every task checks that its host has it.
    """

    port_range: tuple[int, int] | None = None
    host: str | None = None
    interface: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.port_range, list):
            object.__setattr__(self, "port_range", tuple(self.port_range))
        if self.port_range is not None:
            ok = (isinstance(self.port_range, tuple) and len(self.port_range) == 2
                  and all(isinstance(p, int) and not isinstance(p, bool)
                          for p in self.port_range))
            if not ok or not 1 <= self.port_range[0] <= self.port_range[1] <= 65535:
                raise ValueError(f"port_range={self.port_range!r}; expected (first, last) "
                                 f"ports with 1 <= first <= last <= 65535")
        for name in ("host", "interface"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name}={value!r}; expected a non-empty string or None")

    @contextlib.contextmanager
    def interface_env(self) -> Iterator[None]:
        """Point gloo and NCCL at ``interface`` while the group forms and trains; the
        previous values come back after (a reused Python process runs later tasks too)."""
        if not self.interface:
            yield
            return
        names = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
        before = {n: os.environ.get(n) for n in names}
        os.environ.update(dict.fromkeys(names, self.interface))
        try:
            yield
        finally:
            for n, value in before.items():
                if value is None:
                    os.environ.pop(n, None)
                else:
                    os.environ[n] = value


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` on this host (Linux); a ValueError
    naming the host's interfaces when it has no such interface."""
    names = [n for _, n in socket.if_nameindex()]
    if name not in names:
        raise ValueError(f"NetworkSettings(interface={name!r}): {socket.gethostname()} has no "
                         f"such network interface; its interfaces are {names}. Name one that "
                         f"every executor host has, or leave interface unset")
    try:
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            request = struct.pack("256s", name.encode()[:15])
            reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
        return socket.inet_ntoa(reply[20:24])
    except (ImportError, OSError) as e:
        raise ValueError(f"NetworkSettings(interface={name!r}): no IPv4 address found for it "
                         f"on {socket.gethostname()} ({e}); give host= the address the other "
                         f"workers should connect to") from e


_SIOCGIFADDR = 0x8915  # Linux: an interface's address (netdevice(7))


def open_store(network: NetworkSettings | None, timeout_s: float,
               host: str | None = None) -> TCPStore:
    """Rank 0's store: on any free port, or on the first free one of ``port_range``; listening
    on ``host`` (the address the other ranks are told to connect to) where it is one of this
    machine's IP addresses, else on every interface (see ``_listen_addresses``)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    ports = [0] if network is None or network.port_range is None \
        else list(range(network.port_range[0], network.port_range[1] + 1))
    for address in _listen_addresses(host):
        for port in ports:
            try:
                return listening_store(address, port, timeout)
            except OSError as e:
                if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):  # not this host's
                    break  # address (or no IPv6 here): the next address
                continue  # the port is taken: the next one
    first, last = network.port_range if network and network.port_range else (0, 0)
    raise RuntimeError(f"no free port in port_range=({first}, {last}) for the rendezvous "
                       f"store: widen the range or free a port")


def _listen_addresses(host: str | None) -> list[str]:
    """Where the store may listen, best first: ``host`` itself where it is an IP address (the
    ranks connect to exactly that one), then every interface, IPv6 and IPv4 (``::``, as torch's
    own store listens), or IPv4's alone on a machine without IPv6. A host name is not looked
    up: the other machines may resolve it to another address than this one does (a Debian
    host's own name is 127.0.1.1 in its /etc/hosts)."""
    every = ["::", "0.0.0.0"]
    if host:
        literal = host.strip("[]")
        with contextlib.suppress(ValueError):
            ipaddress.ip_address(literal)
            return [literal, *every]
    return every


class _Announcement(TypedDict, total=False):
    """What a rank passes to the ``allGather`` (as JSON): its setup error or None, and from
    rank 0 where its store listens and the stage attempt's run id."""

    error: str | None
    port: int
    run_id: str
    host: str | None


@dataclass(frozen=True)
class Rendezvous:
    """Where rank 0's store listens, the stage attempt's run id, and the ranks' setup errors."""

    host: str
    port: int
    run_id: str
    errors: tuple[tuple[int, str], ...] = ()


def task_host(address: str) -> str:
    """The host part of a ``BarrierTaskInfo.address`` ("host:port" or "[v6]:port")."""
    if address.startswith("["):
        return address[1:address.index("]")]
    host, sep, _ = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"task address {address!r}; expected 'host:port'")
    return host


def local_rank(addresses: Sequence[str], rank: int) -> tuple[int, int]:
    """(this task's index among the tasks on its host, how many tasks share that host)."""
    hosts = [task_host(a) for a in addresses]
    mine = hosts[rank]
    return hosts[:rank].count(mine), hosts.count(mine)


def bounded_call(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run ``fn`` on a helper thread and give up after ``timeout_s`` with a TimeoutError."""
    values: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            values.append(fn())
        except BaseException as e:  # re-raised in the caller
            errors.append(e)

    thread = threading.Thread(target=target, name=f"paraloom-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout_s:g} s: a barrier task did "
                           f"not start or is stuck; check that the cluster has a free slot per "
                           f"worker, or raise rendezvous_timeout")
    if errors:
        raise errors[0]
    return values[0]


def meet(context: BarrierContext, setup_error: str | None, timeout_s: float,
         network: NetworkSettings | None = None) -> tuple[Rendezvous, TCPStore | None]:
    """The one ``allGather`` of a barrier task: returns the rendezvous and rank 0's store.

    Every rank calls it exactly once whatever happened before (a rank whose setup failed
    passes its error), so the barrier never waits for a rank that gave up early.
    """
    rank = context.partitionId()
    store = None
    message = _Announcement(error=setup_error)
    try:
        # The interface's own address, checked on every rank: gloo binds to it there.
        found = interface_address(network.interface) if network and network.interface else None
        if rank == 0:
            host = network.host if network and network.host else found
            store = open_store(network, timeout_s, host or task_host(
                context.getTaskInfos()[0].address))
            message.update(_Announcement(port=store.port, run_id=secrets.token_hex(8),
                                         host=host))
    except Exception as e:  # announced, so that no peer waits for a store never opened
        message["error"] = message["error"] or f"{type(e).__name__}: {e}"
    replies = bounded_call(lambda: context.allGather(json.dumps(message)), timeout_s,
                           f"the rendezvous allGather of rank {rank}")
    parsed: list[_Announcement] = [json.loads(r) for r in replies]
    first = parsed[0]
    host = first.get("host") or task_host(context.getTaskInfos()[0].address)
    errors = tuple((r, error) for r, m in enumerate(parsed) if (error := m.get("error")))
    return Rendezvous(host, int(first.get("port") or 0), str(first.get("run_id", "")),
                      errors), store


def connect(rdv: Rendezvous, timeout_s: float) -> TCPStore:
    """A client of rank 0's store (ranks other than 0)."""
    return TCPStore(rdv.host, rdv.port, is_master=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


MEMBERSHIP = Membership(loopback=False)
"""This Python worker's membership of its task's group: ``board.leave_group`` leaves it, and
the group's object is freed when the next task's group is left (freeing it as the task ends
could deadlock the worker, see ``paraloom.training.group``)."""


def init_group(rdv: Rendezvous, rank: int, world_size: int, backend: str, timeout_s: float,
               store: Store) -> dist.ProcessGroup | None:
    """Join the attempt's torch.distributed group; every collective then times out finitely."""
    prefixed = PrefixStore(f"paraloom/{rdv.run_id}/group", store)
    return MEMBERSHIP.join(prefixed, rank, world_size, backend, timeout_s,
                           store_port=rdv.port if rank == 0 else None)
