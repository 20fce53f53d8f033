"""The v2 gRPC service as an ASGI app: gRPC's HTTP/2 mapping over the same handlers as grpc.aio.

A unary gRPC call is an HTTP/2 POST to ``/inference.GRPCInferenceService/<Method>`` with
``content-type: application/grpc``, a body of one length-prefixed message (a flag byte: 1 when
compressed, then the length as 4 big-endian bytes), and an answer of the same framing followed
by the ``grpc-status`` and ``grpc-message`` trailers. uvicorn's HTTP/2 (zttp) does the framing,
flow control and HPACK in compiled code, so a call costs about what an HTTP/1.1 request does
(see ``paraloom.serving.grpc.http2``). The calls go to ``service._Service``, as grpc.aio's do:
the same lookups, validation, errors, limits and metrics. ``ModelStreamInfer`` reads the
request body as it arrives, one message at a time, and sends each answer as a DATA frame as soon
as it is ready (``paraloom.serving.grpc.streaming``), then the trailers when the stream ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from urllib.parse import quote

import grpc
from google.protobuf.message import DecodeError
from starlette.types import Receive, Scope, Send

from paraloom.serving.body import BodyTooLarge, inflate
from paraloom.serving.errors import ServingError, cut_off_by_shutdown
from paraloom.serving.grpc.messages import SERVICE, Message, method_types
from paraloom.serving.grpc.service import (
    METHODS,
    STREAMING,
    Handler,
    Service,
    status_code,
    unknown_method,
)

__all__ = ["GrpcAsgiApp", "parse_timeout"]

_log = logging.getLogger("paraloom.serving")

_HEADERS = [(b"content-type", b"application/grpc"),
            (b"grpc-accept-encoding", b"identity,gzip,deflate")]
_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
# grpc-message is percent-encoded: everything printable but "%" stays as it is.
_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if c != 0x25)


class _CallError(Exception):
    """A call refused before it reached the service, with its gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def parse_timeout(value: bytes) -> float:
    """Seconds of a ``grpc-timeout`` header (``"250m"``: 0.25 s); ValueError if malformed."""
    text = value.decode("ascii")
    if not 2 <= len(text) <= 9 or text[-1] not in _UNITS or not text[:-1].isdigit():
        raise ValueError(f"grpc-timeout {text!r}; expected up to 8 digits and one of H M S m u n")
    return int(text[:-1]) * _UNITS[text[-1]]


def _decompress(data: bytes, encoding: bytes, limit: int) -> bytes:
    """The message of a compressed frame, refused once it would pass ``limit`` bytes."""
    if encoding not in (b"gzip", b"deflate"):
        raise _CallError(grpc.StatusCode.UNIMPLEMENTED,
                         f"message compressed with {encoding.decode('latin-1')!r}; this server "
                         "takes identity, gzip or deflate")
    try:
        return inflate(data, encoding.decode(), limit)
    except ValueError as e:
        # The gRPC spec says INTERNAL; it is the client's bad input, never the server's fault.
        raise _CallError(grpc.StatusCode.INVALID_ARGUMENT, f"the {encoding.decode()} message "
                         f"does not decompress: {e}") from e
    except BodyTooLarge:
        raise _CallError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the message decompresses to over "
                         f"{limit} bytes, the server's limit") from None


class GrpcAsgiApp:
    """ASGI app serving ``inference.GRPCInferenceService``'s unary methods over HTTP/2.

    ``max_message_bytes`` bounds a request message, compressed or not (RESOURCE_EXHAUSTED past
    it), as grpc.aio's ``grpc.max_receive_message_length`` does. A ``grpc-timeout`` header is a
    deadline: a call still running then is cancelled and answered DEADLINE_EXCEEDED.
    """

    def __init__(self, service: Service, max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        self._service = service
        self._stream_path = f"/{SERVICE}/{STREAMING}"
        self._methods: dict[str, tuple[Handler, type[Message], type[Message]]] = {}
        for name in METHODS:
            request_type, response_type = method_types(name)
            self._methods[f"/{SERVICE}/{name}"] = (getattr(service, name), request_type,
                                                   response_type)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = dict(scope["headers"])
        if scope["method"] != "POST" or \
                not headers.get(b"content-type", b"").startswith(b"application/grpc"):
            await _plain(send, 415, b"this port serves gRPC: POST application/grpc over HTTP/2")
            return
        if scope["path"] == self._stream_path:
            await self._stream(headers, receive, send)
            return
        code, text, answer = grpc.StatusCode.OK, "", b""
        try:
            body = await self._read(receive)
            answer = await self._call(scope["path"], headers, body)
        except _CallError as e:
            code, text = e.code, e.message
        except ServingError as e:
            code, text = status_code(e), e.message
        except (DecodeError, ValueError, TypeError) as e:  # a message of the wrong shape
            code, text = grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {e}"
        except asyncio.TimeoutError:
            code, text = grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed"
        except asyncio.CancelledError:
            if not self._service.repository.draining:
                raise  # the client went away
            cut_off = cut_off_by_shutdown()  # the graceful timeout ran out with it running
            code, text = status_code(cut_off), cut_off.message
        except Exception as e:  # a bug of the server's: INTERNAL, not HTTP/2's 500
            _log.exception("gRPC call %s failed", scope["path"])
            code, text = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS,
                    "trailers": True})
        await send({"type": "http.response.body", "body": answer})
        await _trailers(send, code, text)

    async def _stream(self, headers: dict[bytes, bytes], receive: Receive, send: Send) -> None:
        """A ``ModelStreamInfer`` call: answers sent as they are ready, then the status."""
        request_type, response_type = method_types(STREAMING)
        requests = self._messages(receive, headers.get(b"grpc-encoding", b"identity"),
                                  request_type)
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS,
                    "trailers": True})
        code, text = grpc.StatusCode.OK, ""
        timeout = headers.get(b"grpc-timeout")
        answering = self._send_answers(requests, response_type, send)
        try:
            if timeout is None:
                await answering
            else:
                await asyncio.wait_for(answering, parse_timeout(timeout))
        except _CallError as e:
            code, text = e.code, e.message
        except (DecodeError, ValueError, TypeError) as e:
            code, text = grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {e}"
        except asyncio.TimeoutError:
            code, text = grpc.StatusCode.DEADLINE_EXCEEDED, "the stream's deadline passed"
        await send({"type": "http.response.body", "body": b""})
        await _trailers(send, code, text)

    async def _send_answers(self, requests: AsyncIterator[Message],
                            response_type: type[Message], send: Send) -> None:
        async for answer in self._service.ModelStreamInfer(requests,
                                                           response_type):
            out = answer.SerializeToString()
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"\x00" + len(out).to_bytes(4, "big") + out})

    async def _messages(self, receive: Receive, encoding: bytes, request_type: type[Message]
                        ) -> AsyncIterator[Message]:
        """The request messages of a stream, each as soon as its bytes arrived."""
        buffer = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _CallError(grpc.StatusCode.CANCELLED, "the client went away")
            buffer += message.get("body", b"")
            while len(buffer) >= 5:
                length = int.from_bytes(buffer[1:5], "big")
                if length > self.max_message_bytes:
                    raise _CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"request message of {length} bytes is over "
                                     f"{self.max_message_bytes}, the server's limit")
                if len(buffer) < 5 + length:
                    break
                compressed, data = buffer[0], bytes(buffer[5:5 + length])
                del buffer[:5 + length]
                if compressed:
                    data = _decompress(data, encoding, self.max_message_bytes)
                yield request_type.FromString(data)
            if not message.get("more_body", False):
                if buffer:
                    raise _CallError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"the stream ended inside a message ({len(buffer)} bytes "
                                     "left over)")
                return

    async def _read(self, receive: Receive) -> bytes:
        """The request body, refused as soon as it is longer than one message may be."""
        limit = self.max_message_bytes + 5
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _CallError(grpc.StatusCode.CANCELLED, "the client went away")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"request message over {self.max_message_bytes} bytes, the "
                                 "server's limit")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _call(self, path: str, headers: dict[bytes, bytes], body: bytes) -> bytes:
        found = self._methods.get(path)
        if found is None:
            raise _CallError(grpc.StatusCode.UNIMPLEMENTED, unknown_method(path))
        call, request_type, response_type = found
        if len(body) < 5:
            raise _CallError(grpc.StatusCode.INVALID_ARGUMENT, "the request carries no message")
        length = int.from_bytes(body[1:5], "big")
        if len(body) != 5 + length:
            raise _CallError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"the request body holds {len(body) - 5} bytes after the message "
                             f"prefix, which announced {length}; expected exactly one message")
        data = body[5:]
        if body[0]:
            data = _decompress(data, headers.get(b"grpc-encoding", b"identity"),
                               self.max_message_bytes)
        request = request_type.FromString(data)
        timeout = headers.get(b"grpc-timeout")
        if timeout is None:
            response = await call(request, response_type)
        else:
            seconds = parse_timeout(timeout)
            response = await asyncio.wait_for(call(request, response_type), seconds)
        out: bytes = response.SerializeToString()
        return b"\x00" + len(out).to_bytes(4, "big") + out


async def _trailers(send: Send, code: grpc.StatusCode, text: str) -> None:
    trailers = [(b"grpc-status", b"%d" % code.value[0])]
    if text:
        trailers.append((b"grpc-message", quote(text, safe=_SAFE).encode("ascii")))
    await send({"type": "http.response.trailers", "headers": trailers})


async def _plain(send: Send, status: int, text: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": text})
