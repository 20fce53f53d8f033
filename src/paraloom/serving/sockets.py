"""The listening sockets of ``paraloom serve``: bound here, so a port 0 resolves once."""

from __future__ import annotations

import socket

__all__ = ["bind_socket"]


def bind_socket(host: str = "127.0.0.1", port: int = 0, *, reuse_port: bool = False
                ) -> socket.socket:
    """A listening-ready TCP socket; port 0 lets the OS pick a free port (read it back).

    ``reuse_port``: share the port with other sockets that set it (``--processes N``).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e}; pick another --port or stop the "
                      "process using it") from e
    sock.set_inheritable(True)
    return sock
