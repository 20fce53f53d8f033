"""The kinds of failure the fault benchmarks inject, and how a worker fails as one."""

from __future__ import annotations

import os
import signal

__all__ = ["KINDS", "inject_failure"]

KINDS = ("raise", "exit", "kill", "stop")
"""An exception in the model, an exit with code 0, SIGKILL, SIGSTOP (a hung worker)."""


def inject_failure(kind: str) -> None:
    """Fail this process as ``kind`` says: raise, exit with code 0, SIGKILL or SIGSTOP itself."""
    if kind == "raise":
        raise RuntimeError("injected failure")
    if kind == "exit":
        os._exit(0)
    os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
