"""A rendezvous ``TCPStore`` that listens on one address only.

torch's store server binds every interface whatever host name it is given (a store opened as
``TCPStore("127.0.0.1", 0, is_master=True)`` listens on ``*:port``), so any host that can
reach the machine could read and write the keys a training group meets by. Here the socket is
bound first, to the address asked for, and handed to the store.
"""

from __future__ import annotations

import datetime
import os
import socket

from torch._C._distributed_c10d import TCPStore

__all__ = ["listening_store"]


def listening_store(address: str, port: int, timeout: datetime.timedelta) -> TCPStore:
    """A master store listening on ``address`` (an IP address or a host name) and ``port`` (0:
    one the OS picks); ``OSError`` where that address is not this host's or the port is
    taken."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and address == "::":  # every interface, IPv4 too
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
        bound = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store owns it from here
    try:
        return TCPStore(address, bound, is_master=True, wait_for_workers=False,
                        timeout=timeout, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
