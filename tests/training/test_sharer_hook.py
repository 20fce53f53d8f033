"""The resource sharer's traceback for a worker killed while fetching a tensor's descriptor."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from multiprocessing import resource_sharer

import pytest

from paraloom.training.sharer_hook import quiet_departed_fetchers


def test_a_fetcher_that_leaves_mid_handshake_is_logged_not_printed(
        capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """Every SIGKILL recovery printed the sharer thread's ConnectionResetError traceback to
    stderr, though the fit went on unharmed."""
    quiet_departed_fetchers()
    read, write = os.pipe()
    held = resource_sharer.DupFd(read)  # starts this process's sharer and its listener
    try:
        sharer = resource_sharer._resource_sharer  # type: ignore[attr-defined]
        with caplog.at_level(logging.DEBUG, logger="paraloom"):
            with socket.socket(socket.AF_UNIX) as peer:
                peer.connect(sharer._address)
            deadline = time.monotonic() + 10  # the sharer's thread reads the closed peer
            while not caplog.records and time.monotonic() < deadline:
                time.sleep(0.02)
        assert any("left while it fetched" in r.getMessage() for r in caplog.records)
        sys.excepthook(ValueError, ValueError("another thread's error"), None)  # still told
        err = capfd.readouterr().err
        assert "another thread's error" in err
        assert "Traceback" not in err and "EOFError" not in err and "Reset" not in err
    finally:
        del held
        os.close(write)
