"""``POST /v2/models/{name}[/versions/{version}]/infer`` as a plain ASGI endpoint.

The inference route is the one whose cost per request sets a small request's pace (a request
that names its input in shared memory is answered in well under a millisecond), so it is
called as ASGI and writes the answer itself, without Starlette's endpoint wrapper and
``Response`` objects (a ``Request`` reads the body and headers, as in every route).
Starlette still routes to it: a wrong method gets the routes' 405, and every error reaches
the app's handlers, which answer it in the protocol's form.
"""

from __future__ import annotations

import asyncio

import anyio
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from paraloom.serving.body import read_body
from paraloom.serving.errors import ProtocolError, cut_off_by_shutdown
from paraloom.serving.handling import InferAnswer, handle_infer
from paraloom.serving.protocol import InferRequest, encode_infer_response, parse_infer_request
from paraloom.serving.shared_memory_routes import regions_of

__all__ = ["HEADER_LENGTH", "InferEndpoint", "header_length"]

HEADER_LENGTH = "Inference-Header-Content-Length"
"""The binary extension's header: the JSON part's length in bytes."""
_HEADER_KEY = HEADER_LENGTH.lower()
_PARSE_IN_THREAD = 1 << 20  # decode bodies this large off the event loop


def header_length(raw: str | None) -> int | None:
    """The binary extension's JSON length from its header's value; None without the header."""
    if raw is None:
        return None
    digits = raw.strip()
    if not (digits.isascii() and digits.isdigit()):
        raise ProtocolError(f"{HEADER_LENGTH} is {raw!r}; expected the JSON part's length in "
                            "bytes, as ASCII digits")
    return int(digits)


def _response_start(body: bytes, media_type: str, extra: list[tuple[bytes, bytes]]
                    ) -> dict[str, object]:
    headers = [(b"content-length", str(len(body)).encode()),
               (b"content-type", media_type.encode()), *extra]
    return {"type": "http.response.start", "status": 200, "headers": headers}


async def _send_answer(answer: InferAnswer, send: Send) -> None:
    body, json_length = encode_infer_response(
        model_name=answer.model_name, model_version=answer.model_version,
        request_id=answer.request_id, outputs=answer.outputs)
    if json_length is None:
        start = _response_start(body, "application/json", [])
    else:
        start = _response_start(body, "application/octet-stream",
                                [(_HEADER_KEY.encode(), str(json_length).encode())])
    await send(start)
    await send({"type": "http.response.body", "body": body})


class InferEndpoint:
    """The ASGI app of the two infer routes: decode (the binary extension, JSON, shared memory
    regions), ``handle_infer``, encode. Reads the app's state at each request (``repository``,
    ``metrics``, ``regions``, ``max_body_bytes``); a ``ServingError`` is raised to the app's
    handler (``routes.EXCEPTION_HANDLERS``)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        state = request.app.state
        regions = regions_of(request)
        params = request.path_params

        async def decode() -> InferRequest:
            body = await read_body(request, state.max_body_bytes)
            length = header_length(request.headers.get(HEADER_LENGTH))
            if len(body) > _PARSE_IN_THREAD:
                return await anyio.to_thread.run_sync(parse_infer_request, body, length,
                                                      regions)
            return parse_infer_request(body, length, regions)

        # A ServingError goes on to the app's handler, which answers it in the protocol's form.
        try:
            answer = await handle_infer(state.repository, state.metrics, params["name"],
                                        params.get("version"), decode, regions)
        except asyncio.CancelledError:
            if not state.repository.draining:
                raise  # the client went away: there is no one to answer
            # The graceful timeout ran out with it running, and uvicorn cancelled it.
            raise cut_off_by_shutdown() from None
        await _send_answer(answer, send)
