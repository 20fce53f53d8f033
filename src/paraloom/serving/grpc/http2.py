"""The gRPC endpoint on uvicorn's HTTP/2 (zttp), on the HTTP server's event loop.

grpc.aio costs about 0.12 ms of the loop's CPU per call where uvicorn costs 0.03 ms per HTTP/1.1
request, and hands the loop one call per wake-up, so the pool ran batches of 3-4 rows against
7.5-18 for HTTP: gRPC served half of HTTP JSON's requests/s (LeNet, 2 cores). uvicorn's HTTP/2
parses frames and HPACK in compiled code and runs a batch of streams per read, like HTTP/1.1.

zttp 0.0.35 answers the 4,097th stream of a connection with GOAWAY ENHANCE_YOUR_CALM ("flood
detected"), whatever their pace, and drops the calls in flight. So each connection takes
``STREAMS_PER_CONNECTION`` calls, then says GOAWAY with NO_ERROR: the calls it took finish,
later ones are refused with REFUSED_STREAM (never processed; gRPC clients retry them on a new
connection by themselves), and the connection closes once idle, as nginx does after
``keepalive_requests``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.protocols.http.zttp_h2_impl import ZttpH2Protocol

from paraloom.serving.grpc.asgi import GrpcAsgiApp
from paraloom.serving.grpc.service import GrpcEndpoint, Service
from paraloom.serving.sockets import bind_socket

if TYPE_CHECKING:
    import zttp

__all__ = ["Http2GrpcServer", "STREAMS_PER_CONNECTION"]

_log = logging.getLogger("paraloom.serving")
STREAMS_PER_CONNECTION = 3500
"""Calls one connection takes before GOAWAY: zttp's limit is 4,096, and the margin covers the
calls a client sends before the GOAWAY reaches it (at most 128 in flight, zttp's setting)."""
_REFUSED_STREAM = 0x7
_IDLE_S = 120
"""Seconds an idle connection stays open (uvicorn's default, 5 s, suits browsers; gRPC
channels keep their connection between calls, and grpcio's server never closes one)."""


class _Corked:
    """A connection's transport whose writes within one loop turn leave in one ``write``.

    uvicorn writes a response's HEADERS, DATA and trailers as three writes (three segments,
    three wake-ups of the client); gRPC always sends all three at once. Every write of the
    connection goes through here, so the bytes keep zttp's order.
    """

    __slots__ = ("transport", "chunks", "loop")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self.loop = loop
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self.chunks:
            self.loop.call_soon(self.flush)
        self.chunks.append(data)

    def flush(self) -> None:
        if self.chunks:
            data = b"".join(self.chunks)
            self.chunks.clear()
            if not self.transport.is_closing():
                self.transport.write(data)

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def close(self) -> None:
        self.flush()
        self.transport.close()


class _Protocol(ZttpH2Protocol):
    """uvicorn's HTTP/2 connection, its writes corked per loop turn, closed gracefully after
    ``STREAMS_PER_CONNECTION`` calls, reading nothing while its peer reads nothing."""

    streams = 0  # calls this connection took

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self.transport = _Corked(self.transport, self.loop)  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.flow.write_paused:
            # The peer is not reading what this connection writes (a PING or SETTINGS flood
            # answered frame by frame grew the buffer by 1.6 GB in 40 s): read no more of it
            # until it does.
            self.flow.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        self.flow.resume_reading()

    def handle_request(self, event: zttp.Request) -> None:
        self.streams += 1
        if self.shutdown_requested:  # uvicorn would answer HTTP 503: refuse, to be retried
            self.conn.stream(event.stream_id).reset(_REFUSED_STREAM)
            return
        super().handle_request(event)
        if self.streams >= STREAMS_PER_CONNECTION:
            self.conn.close(0, event.stream_id)  # GOAWAY NO_ERROR: calls up to this one run
            self.shutdown_requested = True  # uvicorn closes the connection once it is idle


class Http2GrpcServer(GrpcEndpoint):
    """``GRPCInferenceService`` over uvicorn's HTTP/2; start and stop it on a running loop."""

    _server: uvicorn.Server | None = None  # while serving
    _sock: socket.socket | None = None

    async def start(self) -> int:
        """Bind and start serving; returns the port (the OS's pick when asked for 0)."""
        try:
            sock = bind_socket(self.host, self.requested_port, reuse_port=self.reuse_port)
        except OSError as e:
            raise self.listen_error(e.__cause__ or e) from e
        app = GrpcAsgiApp(Service(self.repository, self.metrics, self.regions),
                          self.max_message_bytes)
        config = uvicorn.Config(app, http="zttp", http2=True, lifespan="off", log_config=None,
                                log_level=None, access_log=False,  # logging as HTTP set it
                                timeout_keep_alive=_IDLE_S)
        config.load()
        config.http_protocol_class = _Protocol  # h2c with prior knowledge, as gRPC clients speak
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        try:
            await server.startup(sockets=[sock])
        except BaseException:
            sock.close()
            raise
        self._server, self._sock = server, sock
        self.port = sock.getsockname()[1]
        _log.info("paraloom serving gRPC on %s:%d (HTTP/2)", self.host, self.port)
        return self.port

    async def stop(self, grace: float | None) -> None:
        """Refuse new calls; let calls in flight finish within ``grace`` seconds."""
        server, self._server = self._server, None
        if server is None:
            return
        server.config.timeout_graceful_shutdown = None if grace is None else max(0, int(grace))
        server.force_exit = grace is not None and grace <= 0
        await server.shutdown(sockets=[self._sock] if self._sock is not None else None)
        self._sock = None
