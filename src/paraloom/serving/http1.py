"""uvicorn's HTTP/1.1 connection (httptools), with the bounds a server facing careless or
hostile clients needs and uvicorn leaves out.

- **Pipelining**: a client that pipelines requests without reading the answers made uvicorn
  read on after every answer, parsing a read's worth of requests (a thousand small ones in
  64 KB) for each one it answered: 0.8 GB per connection within a minute. Here a connection
  reads no more while requests it pipelined are still queued.
- **Slow requests**: a connection that sends a request's head or body slowly (or opens and
  sends nothing) was held open forever; a thousand of them took every file descriptor of a
  server under ``ulimit -n 1024``, and every other client was refused. Here a request must
  arrive whole within ``REQUEST_READ_S`` of its first byte (of the connection, for the first
  request), or the connection is closed; time while the server itself is not reading (a
  pipelined request behind a slow one) does not count. Between requests uvicorn's keep-alive
  timeout holds.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["REQUEST_READ_S", "GuardedHttpTools"]

REQUEST_READ_S = 60.0
"""Seconds a request's head and body may take to arrive (nginx's client_header_timeout and
client_body_timeout are 60 s each): a 16 MiB body then needs 280 KB/s."""


class GuardedHttpTools(HttpToolsProtocol):
    """``HttpToolsProtocol`` that bounds pipelined requests and the time a request takes to
    arrive (see the module's docstring)."""

    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:
            self._arm()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.pipeline:  # requests still queued: read no more of them until they are answered
            self.flow.pause_reading()

    def _arm(self) -> None:
        self._deadline = self.loop.call_later(REQUEST_READ_S, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.flow.read_paused and not self.flow.write_paused:
            # The server is not reading (a pipelined request waits for the ones before it, a
            # body for the app) while the client reads its answers: not the client's delay.
            self._arm()
            return
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose request took over %.0f s to arrive",
                             REQUEST_READ_S)
            self.transport.close()
