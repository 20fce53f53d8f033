"""ModelStreamInfer on both gRPC back ends with tritonclient's own stream, the stream's bound on
requests in flight, and errors that answer one request while the stream goes on."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
from serving_helpers import WAIT_S, expected

from paraloom.models import LeNet
from paraloom.serving import ServerThread, create_app
from paraloom.serving.errors import ProtocolError
from paraloom.serving.grpc.messages import message
from paraloom.serving.grpc.streaming import answer_stream

_Request = message("ModelInferRequest")
_Response = message("ModelInferResponse")


@pytest.fixture()
def lenet() -> torch.nn.Module:
    torch.manual_seed(0)
    return LeNet(image_size=8).eval()


@pytest.fixture(params=["grpcio", "uvicorn"])
def server(lenet: torch.nn.Module, request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    if request.param == "uvicorn":
        pytest.importorskip("zttp", reason="uvicorn's HTTP/2 needs zttp (Python 3.11+)")
    app = create_app(lenet, name="lenet", workers=2, batch_limit=64)
    with ServerThread(app, grpc_port=0, grpc_backend=request.param) as srv:
        yield srv


def _input(x: np.ndarray) -> tg.InferInput:
    given = tg.InferInput("input", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    return given


def test_a_stream_answers_every_request_with_its_own_rows_and_id(
        server: ServerThread, lenet: torch.nn.Module) -> None:
    xs = np.random.default_rng(2).random((300, 1, 1, 8, 8), dtype=np.float32)
    want = expected(lenet, torch.from_numpy(xs.reshape(300, 1, 8, 8))).numpy()
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = tg.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i in range(300):
            if i == 150:  # a request the model cannot take, mid-stream
                client.async_stream_infer("lenet", [_input(np.zeros((1, 2, 8, 8),
                                                                     np.float32))],
                                          request_id="bad")
            # As clients that wait for each request's last answer ask (Triton marks it).
            client.async_stream_infer("lenet", [_input(xs[i])], request_id=str(i),
                                      enable_empty_final_response=i % 2 == 0)
        got = [answers.get(timeout=WAIT_S) for _ in range(301)]
    finally:
        client.stop_stream()
        client.close()
    errors = [str(e) for r, e in got if e is not None]
    assert len(errors) == 1 and "request 'bad'" in errors[0] and "[-1, 1, 8, 8]" in errors[0]
    ids = sorted(int(r.get_response().id) for r, e in got if e is None)
    assert ids == list(range(300))
    assert all(r.get_response().parameters["triton_final_response"].bool_param
               for r, e in got if e is None)  # one answer per request: each is the last
    for result, _ in got:
        if result is not None:
            i = int(result.get_response().id)
            np.testing.assert_allclose(result.as_numpy("output"), want[i:i + 1], rtol=1e-5,
                                       atol=1e-6)


def _requests(count: int) -> list[Any]:
    return [_Request(model_name="m", id=str(i)) for i in range(count)]


async def _iterate(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item
        await asyncio.sleep(0)


def test_answer_stream_bounds_requests_in_flight_and_survives_failures() -> None:
    running, most = 0, 0

    async def infer(request: Any) -> Any:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.001 * (int(request.id) % 5))
        running -= 1
        if request.id == "7":
            raise ProtocolError("seven is refused")
        if request.id == "8":
            raise RuntimeError("eight broke")
        return _Response(id=request.id)

    async def collect() -> list[Any]:
        return [a async for a in answer_stream(infer, _iterate(_requests(40)), in_flight=4)]

    answers = asyncio.run(asyncio.wait_for(collect(), WAIT_S))
    assert most == 4
    assert sorted(int(a.infer_response.id) for a in answers) == list(range(40))
    errors = {a.infer_response.id: a.error_message for a in answers if a.error_message}
    assert errors == {"7": "request '7': seven is refused",
                      "8": "request '8': INTERNAL: RuntimeError: eight broke"}


def test_answer_stream_answers_what_came_before_a_broken_request_stream_then_raises() -> None:
    async def infer(request: Any) -> Any:
        await asyncio.sleep(0.01)  # still running when the stream breaks
        return _Response(id=request.id)

    async def broken() -> AsyncIterator[Any]:
        for request in _requests(3):
            yield request
        raise ConnectionError("the client went away")

    got: list[Any] = []

    async def collect() -> None:
        async for answer in answer_stream(infer, broken()):
            got.append(answer)

    with pytest.raises(ConnectionError, match="went away"):
        asyncio.run(asyncio.wait_for(collect(), WAIT_S))
    assert sorted(a.infer_response.id for a in got) == ["0", "1", "2"]


def test_a_stream_whose_answers_are_not_read_stops_reading_requests() -> None:
    """Answers wait to be sent in the slots: a client that never reads cannot grow them."""
    pulled = 0

    async def requests() -> AsyncIterator[Any]:
        nonlocal pulled
        for request in _requests(100):
            pulled += 1
            yield request

    async def infer(request: Any) -> Any:
        return _Response(id=request.id)

    async def take_one_then_stall() -> int:
        answers = answer_stream(infer, requests(), in_flight=4)
        await answers.__anext__()
        await asyncio.sleep(0.2)  # the client reads nothing more
        seen = pulled
        await answers.aclose()
        return seen

    assert asyncio.run(asyncio.wait_for(take_one_then_stall(), WAIT_S)) <= 4 + 1
