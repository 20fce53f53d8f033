"""A worker's place in the process group: joining it, and leaving it without a deadlock.

Leaving after a failure takes two steps, because freeing a gloo group can deadlock. Freeing
it joins its worker threads while the freeing thread holds the GIL; a worker thread still
finishing one of the collectives that failed frees the collective's thread-local state, which
holds a Python object (torch keeps the caller's ``contextvars`` context there for every
backward pass: every DDP all-reduce has one), so it waits for the GIL. A survivor then hung
in the teardown until the regroup gave up (20 s), in about one recovery in eight.

The same holds after a fit that went well: the last all-reduce of a backward pass may still
be freed by gloo's thread as DDP's reducer, the group's last holder, is freed.

So ``leave`` shuts the group's connections down at once (a peer waiting on this worker in a
collective gets its error now, not at its timeout; this worker's own collectives fail too)
and keeps the group's object, which the next group's ``leave`` (or the process's exit)
frees, by when its threads are long idle. The connections are the TCP sockets that ``join``
saw the group open (read from ``/proc/self/fd``); where there is no ``/proc``, the group is
freed at once, as before.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

__all__ = ["Membership"]

_FDS = "/proc/self/fd"


class Membership:
    """This process's membership of a group (one at a time). ``loopback``: every member is on
    this machine, so gloo's pairs meet on the loopback interface (a pool's workers); False for
    groups across machines (a Spark stage's tasks), which use gloo's own choice."""

    def __init__(self, *, loopback: bool = True) -> None:
        self.loopback = loopback
        self._connections: dict[int, str] = {}
        """The group's connected sockets: file descriptor -> what ``/proc`` names it (a
        descriptor reused by something else after the group closed it is left alone)."""
        self._retired: dist.ProcessGroup | None = None
        """The group left last, freed when the next group is left."""

    def join(self, store: TCPStore | PrefixStore, rank: int, world_size: int, backend: str,
             timeout_s: float, generation: int = 0,
             store_port: int | None = None) -> dist.ProcessGroup:
        """Join group ``generation`` (rendezvous keys of its own for each after the first).
        ``store_port``: the port of a store this process serves, whose connections (peers may
        connect to it as the group forms) are not the group's and stay open at ``leave``."""
        keys = store if generation == 0 else PrefixStore(f"regroup-{generation}/", store)
        if self.loopback and backend == "gloo" and \
                "lo" in {name for _, name in socket.if_nameindex()}:
            # One machine: gloo's pairs meet on loopback, not on whatever address the host
            # name resolves to (a LAN address would let other hosts reach the workers).
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        before = _sockets()
        dist.init_process_group(backend, store=keys, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        after = _sockets()
        self._connections = {fd: name for fd, name in after.items()
                             if before.get(fd) != name and _connected_tcp(fd, store_port)}
        assert dist.group.WORLD is not None
        return dist.group.WORLD

    def leave(self) -> None:
        """Leave the group, if in one: its peers see this worker's connections close at once;
        the group's object is freed when the next group is left (a second ``leave`` with no
        group in between keeps it: its threads may still be finishing)."""
        group = dist.group.WORLD if dist.is_initialized() else None
        if group is None:
            return
        connections, self._connections = self._connections, {}
        for fd, name in connections.items():
            if _sockets_named(fd) == name:
                _shut_down(fd)
        dist.destroy_process_group()
        # Kept only where its connections were found (and closed), or it had none: otherwise
        # a peer waiting on this worker would wait for its timeout.
        self._retired = group if os.path.isdir(_FDS) else None


def _sockets() -> dict[int, str]:
    """This process's open sockets: descriptor -> ``socket:[inode]``."""
    out: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir(_FDS):
            name = _sockets_named(int(entry))
            if name is not None:
                out[int(entry)] = name
    return out


def _sockets_named(fd: int) -> str | None:
    try:
        target = os.readlink(f"{_FDS}/{fd}")
    except OSError:
        return None
    return target if target.startswith("socket:") else None


def _connected_tcp(fd: int, store_port: int | None = None) -> bool:
    """A TCP socket that is not listening (shutting down gloo's listener aborts the process),
    nor a connection accepted by the store serving ``store_port`` here."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    with s:
        try:
            return (s.family in (socket.AF_INET, socket.AF_INET6)
                    and s.type == socket.SOCK_STREAM
                    and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                    and (store_port is None or s.getsockname()[1] != store_port))
        except OSError:
            return False


def _shut_down(fd: int) -> None:
    """End the connection both ways, leaving the descriptor to its owner (a duplicate is
    shut down: the connection is the same)."""
    with contextlib.suppress(OSError):
        with socket.socket(fileno=os.dup(fd)) as s:
            s.shutdown(socket.SHUT_RDWR)
