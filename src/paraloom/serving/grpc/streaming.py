"""``ModelStreamInfer``: many requests over one bidirectional stream, answers as they are ready.

Each request on the stream runs as its own task through the same path as a unary ``ModelInfer``
(so it is batched with every other request the model's pool holds, from any transport), and its
answer goes back as soon as it is ready, carrying the request's id. A request that fails gets a
``ModelStreamInferResponse`` with ``error_message`` (prefixed with its id, since tritonclient
hands stream callbacks the error alone) and an ``infer_response`` that names the model and the
id; the stream goes on. A message that does not parse ends the stream (``INVALID_ARGUMENT``:
it has no id to answer under), once the requests read before it are answered. Every answer
carries ``triton_final_response: true``, as Triton's do for a model that answers each request
once. At most ``STREAM_IN_FLIGHT`` requests of one
stream (and at most half the smallest pool's ``queue_limit``, so that one stream never fills a
queue by itself) are running or answered but not yet sent; past that the stream is not read until an
answer has gone out (gRPC's flow control then holds the client). An answer is sent once the
transport took it: on the uvicorn back end, zttp buffers what the client's flow-control window
does not take yet. Requests beyond the model pool's ``queue_limit`` get its "queue is full"
error like unary calls do (several streams, or a stream beside other clients, can fill one).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from paraloom.serving.errors import ServingError
from paraloom.serving.grpc.messages import InferRequestMessage, Message, message

__all__ = ["FINAL", "STREAM_IN_FLIGHT", "answer_stream"]

FINAL = "triton_final_response"
"""The parameter of a stream answer that says it is its request's last."""
STREAM_IN_FLIGHT = 128
"""Requests of one stream running or waiting to be sent; more wait, unread, in the client's
stream."""
_StreamResponse = message("ModelStreamInferResponse")
_InferResponse = message("ModelInferResponse")

Infer = Callable[[InferRequestMessage], Awaitable[Message]]
"""Answers one request (``Service.ModelInfer`` bound to its response class)."""


def _error(request: InferRequestMessage, text: str) -> Message:
    prefix = f"request {request.id!r}: " if request.id else ""
    return _StreamResponse(error_message=prefix + text, infer_response=_final(_InferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id)))


def _final(response: Message) -> Message:
    """``response`` marked as its request's last, as Triton marks every stream answer
    (``triton_final_response``; a model here answers each request once): clients that wait
    for the mark (tritonclient's ``enable_empty_final_response=True``) then stop waiting."""
    response.parameters[FINAL].bool_param = True
    return response


async def _answer(infer: Infer, request: InferRequestMessage) -> Message:
    try:
        return _StreamResponse(infer_response=_final(await infer(request)))
    except ServingError as e:
        return _error(request, e.message)
    except (ValueError, TypeError) as e:  # a message field of the wrong shape
        return _error(request, f"bad request: {e}")
    except Exception as e:  # noqa: BLE001 - one request's failure must not end the stream
        return _error(request, f"{grpc.StatusCode.INTERNAL.name}: {type(e).__name__}: {e}")


async def answer_stream(infer: Infer, requests: AsyncIterator[InferRequestMessage],
                        in_flight: int = STREAM_IN_FLIGHT) -> AsyncIterator[Message]:
    """The answers to ``requests``, each as soon as it is ready; ends when the requests have
    ended and every one is answered. When reading the requests fails (a message that does not
    parse, the client gone), the requests read before are still answered, then the iteration
    raises that error. Cancelling the iteration cancels the requests running."""
    answers: asyncio.Queue[Message | BaseException | None] = asyncio.Queue()
    slots = asyncio.Semaphore(in_flight)
    running: set[asyncio.Task[None]] = set()

    async def run(request: InferRequestMessage) -> None:
        await answers.put(await _answer(infer, request))  # its slot is freed once it is sent

    async def read() -> None:
        broken: Exception | None = None
        try:
            async for request in requests:
                await slots.acquire()
                task = asyncio.create_task(run(request))
                running.add(task)
                task.add_done_callback(running.discard)
        except Exception as e:  # noqa: BLE001 - the stream broke: it ends with this error,
            broken = e          # after the answers to the requests read before it
        if running:
            await asyncio.gather(*running)
        await answers.put(broken)

    reader = asyncio.create_task(read())
    try:
        while True:
            answer = await answers.get()
            if answer is None:
                return
            if isinstance(answer, BaseException):
                raise answer
            yield answer
            slots.release()
    finally:
        for task in [reader, *running]:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(reader, *running, return_exceptions=True)
