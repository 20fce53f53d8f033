"""The bookkeeping every closed-loop caller of the load generator shares, whatever its protocol."""

from __future__ import annotations

import asyncio
import time
from typing import cast

__all__ = ["ClosedLoopCaller"]


class ClosedLoopCaller(asyncio.Protocol):
    """One connection sending a request, waiting for its answer, and sending again until
    ``stop_at``; latencies of calls started after ``measure_from`` and ended by ``stop_at`` go
    to ``out``, failures to ``errors``. Subclasses write a request (``_request``) and parse
    answers, calling ``_ended`` for each; ``_connected`` may write a preface first."""

    transport: asyncio.Transport
    """The connection's TCP transport (asyncio's or uvloop's), from ``connection_made`` on."""

    def __init__(self, stop_at: float, measure_from: float, out: list[float],
                 errors: list[str], done: asyncio.Future[None]) -> None:
        self.stop_at, self.measure_from = stop_at, measure_from
        self.out, self.errors, self.done = out, errors, done
        self.buffer = bytearray()
        self.started = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The loop's create_connection hands a stream protocol a (writable) Transport.
        self.transport = cast(asyncio.Transport, transport)
        self._connected()
        self._send()

    def _connected(self) -> None:
        """Write what the connection needs before the first request (nothing by default)."""

    def _send(self) -> None:
        """Start the next call, or finish once ``stop_at`` has passed."""
        self.started = time.perf_counter()
        if self.started >= self.stop_at:
            self._finish()
            return
        self._request()

    def _request(self) -> None:
        raise NotImplementedError

    def _ended(self, error: str | None) -> None:
        """The call in flight ended (``error``: why it failed); start the next."""
        ended = time.perf_counter()
        if error is not None:
            self.errors.append(error)
        elif self.started >= self.measure_from and ended <= self.stop_at:
            self.out.append(ended - self.started)
        self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.errors.append(type(exc).__name__ if exc else "ConnectionClosed")
            self.done.set_result(None)

    def _finish(self) -> None:
        self.transport.close()
        if not self.done.done():
            self.done.set_result(None)
