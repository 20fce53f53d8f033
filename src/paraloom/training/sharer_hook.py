"""A worker killed while it fetches a tensor's file descriptor from this process (SIGKILL in
the middle of a round) drops its connection to ``multiprocessing``'s resource sharer, whose
thread then hands the ``ConnectionResetError`` (or ``EOFError``) to ``sys.excepthook``, which
printed a traceback to stderr after every such failure, the fit going on unharmed (the
worker's failure is told, and survived, by the pool). ``quiet_departed_fetchers`` installs a
hook that logs exactly those at debug level and hands everything else to the hook before it."""

from __future__ import annotations

import logging
import sys
import threading
from multiprocessing import resource_sharer
from types import TracebackType

__all__ = ["quiet_departed_fetchers"]

log = logging.getLogger("paraloom")

_PEER_GONE = (ConnectionError, EOFError)
_installed = threading.Lock()  # held once installed


def _in_sharer_thread() -> bool:
    thread = getattr(getattr(resource_sharer, "_resource_sharer", None), "_thread", None)
    return thread is not None and threading.current_thread() is thread


def quiet_departed_fetchers() -> None:
    """Install the hook (once per process; later calls do nothing)."""
    if not _installed.acquire(blocking=False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException,
             traceback: TracebackType | None) -> None:
        if issubclass(kind, _PEER_GONE) and _in_sharer_thread():
            log.debug("a worker left while it fetched a shared tensor: %s", value)
            return
        previous(kind, value, traceback)

    sys.excepthook = hook
