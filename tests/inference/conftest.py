"""Fixtures for ParallelInference tests: event gates that hold a forward pass, a leak check."""

from __future__ import annotations

import threading

import pytest
from inference_helpers import WAIT, Gate


@pytest.fixture()
def gate() -> Gate:
    g = Gate()
    yield g
    g.open()  # never leave a worker held, whatever the test did


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Every test must close its pools: no paraloom-inference thread may outlive it."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate()
              if t not in before and t.name.startswith("paraloom-inference")]
    for t in leaked:
        t.join(WAIT)  # leave nothing behind for the next test, then fail this one
    assert not leaked, f"threads still alive after the test: {[t.name for t in leaked]}"
