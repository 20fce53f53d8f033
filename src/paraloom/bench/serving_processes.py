"""The server processes of ``paraloom bench serving``: started in their own process group, polled
until ready, stopped with the whole group (workers included) when the measurement ends."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

__all__ = ["free_port", "run_server"]


def free_port() -> int:
    """A port free now (the server binds it right after)."""
    with socket.socket() as s:  # the OS picks a free port; the server binds it right after
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status(url: str, timeout: float = 2.0) -> int:
    """The HTTP status of GET ``url``; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except (urllib.error.URLError, OSError):
        return 0


@contextlib.contextmanager
def run_server(cmd: list[str], ready_url: str, startup_s: float = 180.0,
               env: dict[str, str] | None = None) -> Iterator[int]:
    """Run a server process group until the block ends; yields its process group id."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)
    try:
        deadline = time.monotonic() + startup_s
        while _status(ready_url) != 200:  # a server in another process: polling is all we have
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-3000:]
                raise RuntimeError(f"server {cmd[:4]} did not become ready:\n{tail}")
            time.sleep(0.2)
        yield proc.pid
    finally:
        _stop(proc)
        log.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    with contextlib.suppress(ProcessLookupError):  # workers left behind in the group
        os.killpg(proc.pid, signal.SIGKILL)
