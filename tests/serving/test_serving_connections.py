"""Connections that do not play by the rules are bounded: a client pipelining requests without
reading the answers, one sending a request slowly, an HTTP/2 peer flooding PINGs unread."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import pytest
import torch
from serving_helpers import WAIT_S

from paraloom.models import LeNet
from paraloom.serving import ServerThread, create_app, http1

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    torch.manual_seed(0)
    app = create_app(LeNet(image_size=8).eval(), name="lenet", workers=1)
    zttp = pytest.importorskip("zttp", reason="uvicorn's HTTP/2 needs zttp (Python 3.11+)")
    assert zttp is not None
    with ServerThread(app, grpc_port=0, grpc_backend="uvicorn") as srv:
        yield srv


def _connections(server: ServerThread) -> set:
    return server._server.server_state.connections


def _flood(sock: socket.socket, chunk: bytes, seconds: float) -> int:
    """Send ``chunk`` until the server stops reading (a send blocks for 2 s) or ``seconds``
    pass; the chunks sent."""
    sock.settimeout(2.0)
    sent, started = 0, time.monotonic()
    try:
        while time.monotonic() - started < seconds:
            sock.sendall(chunk)
            sent += 1
    except (TimeoutError, OSError):
        pass
    return sent


def test_pipelined_requests_are_read_no_faster_than_they_are_answered(
        server: ServerThread) -> None:
    """After each answer uvicorn read on, a thousand small requests a read, for each one it
    answered: 0.8 GB per connection within a minute for a client that never reads."""
    request = f"GET /v2/health/live HTTP/1.1\r\nHost: {server.host}\r\n\r\n".encode()
    with socket.create_connection((server.host, server.port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sent = _flood(sock, request * 1000, seconds=8.0)
        queued = max((len(c.pipeline) for c in _connections(server) if hasattr(c, "pipeline")),
                     default=0)
    assert queued <= 5000, f"{queued} requests queued from one connection ({sent}k sent)"
    assert sent < 1000, f"the server read {sent}k pipelined requests in 8 s without answering"
    with socket.create_connection((server.host, server.port), timeout=WAIT_S) as other:
        other.sendall(request)
        assert other.recv(100).startswith(b"HTTP/1.1 200")  # the others are served


def test_a_request_that_takes_too_long_to_arrive_is_cut_off(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections stalled in a request's head or body were held forever: a thousand took every
    descriptor of a server under ulimit -n 1024, and every other client was refused."""
    monkeypatch.setattr(http1, "REQUEST_READ_S", 1.0)
    with socket.create_connection((server.host, server.port), timeout=WAIT_S) as slow, \
            socket.create_connection((server.host, server.port), timeout=WAIT_S) as silent:
        slow.sendall(b"POST /v2/models/lenet/infer HTTP/1.1\r\nHost: x\r\nContent-Le")
        started = time.monotonic()
        assert slow.recv(100) == b"" and silent.recv(100) == b""  # closed by the server
        assert time.monotonic() - started < 10
    with socket.create_connection((server.host, server.port), timeout=WAIT_S) as prompt:
        prompt.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert prompt.recv(100).startswith(b"HTTP/1.1 200")
        time.sleep(1.5)  # idle between requests: uvicorn's keep-alive (5 s) holds, not ours
        prompt.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert prompt.recv(100).startswith(b"HTTP/1.1 200")


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(
        ">I", stream) + payload


def test_an_http2_peer_that_floods_pings_unread_is_read_no_more(server: ServerThread) -> None:
    """Every PING was answered into a buffer the peer never read: 1.6 GB in 40 s."""
    port = int(server.grpc_url.rsplit(":", 1)[1])
    with socket.create_connection((server.host, port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0) + _frame(4, 1, 0))
        pings = b"".join(_frame(6, 0, 0, struct.pack(">Q", i)) for i in range(1000))
        sent = _flood(sock, pings, seconds=8.0)
    # Bounded: 490-590k alone here, 1,162k once under the whole suite's load on 2 cores;
    # unbounded, it read 20,600k.
    assert sent < 4000, f"the server read {sent}k PINGs in 8 s while its answers piled up"


async def _slow_or_echo(scope: dict, receive, send) -> None:
    """An ASGI app: /slow answers after a second, anything else echoes its body's length."""
    import asyncio

    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    if scope["path"] == "/slow":
        await asyncio.sleep(1.0)
    answer = f"{scope['path']} {size}".encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})


def test_a_pipelined_request_behind_a_slow_one_is_not_cut_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The server stops reading while a pipelined request waits for the one before it: that
    time counted against the request's deadline, and the connection was reset with both
    answers lost."""
    import threading

    import uvicorn

    monkeypatch.setattr(http1, "REQUEST_READ_S", 0.3)
    config = uvicorn.Config(_slow_or_echo, http=http1.GuardedHttpTools, lifespan="off",
                            log_level="warning")
    server = uvicorn.Server(config)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        body = b"x" * 300_000  # more than a read: the rest waits in the socket, unread
        with socket.create_connection(listener.getsockname(), timeout=WAIT_S) as sock:
            sock.sendall(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi"
                         b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                         % len(body) + body)
            answers = b""
            while b"/echo 300000" not in answers:
                chunk = sock.recv(65536)
                assert chunk, f"closed with {answers.count(b'HTTP/1.1 200')} answers of 2"
                answers += chunk
        assert b"/slow 2" in answers
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        listener.close()
