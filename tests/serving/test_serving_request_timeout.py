"""Triton's ``timeout`` request parameter (microseconds; tritonclient's ``infer(timeout=...)``):
a request still waiting when it passes is answered 504 / DEADLINE_EXCEEDED, never run; it
can shorten the pool's own limit, never lengthen it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from serving_helpers import WAIT_S, Gate, GatedLeNet
from tritonclient.utils import InferenceServerException

from paraloom.serving import ServerThread, TensorSpec, create_app
from paraloom.serving.errors import ProtocolError
from paraloom.serving.handling import request_timeout

_X = np.zeros((1, 1, 8, 8), dtype=np.float32)
_BOUND_S = 10.0


@pytest.fixture()
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.open()


def _server(gate: Gate, **options: Any) -> ServerThread:
    app = create_app(GatedLeNet(gate), name="lenet", workers=1, batch_limit=1,
                     inputs=[TensorSpec("input", "FP32", (-1, 1, 8, 8))], **options)
    return ServerThread(app, grpc_port=0)


def _call(module: Any, url: str, **options: Any) -> Callable[[], Any]:
    def call() -> Any:
        item = module.InferInput("input", list(_X.shape), "FP32")
        item.set_data_from_numpy(_X)
        if module is th:  # a client-side bound: a request never answered fails in seconds
            return th.InferenceServerClient(url, network_timeout=_BOUND_S).infer(
                "lenet", [item], **options)
        return tg.InferenceServerClient(url).infer("lenet", [item], client_timeout=_BOUND_S,
                                                   **options)
    return call


def _held(gate: Gate, first: Callable[[], Any], second: Callable[[], Any]
          ) -> tuple[Any, BaseException | None]:
    """``first`` holds the only worker; ``second`` waits behind it, then the gate opens."""
    gate.close()
    answers: list[Any] = []

    def hold() -> None:
        try:
            answers.append(first())
        except InferenceServerException as e:  # past the pool's own limit, while held
            answers.append(e)

    holder = threading.Thread(target=hold)
    holder.start()
    assert gate.entered.wait(WAIT_S)
    try:
        second()
        failure: BaseException | None = None
    except InferenceServerException as e:
        failure = e
    gate.open()
    holder.join(WAIT_S)
    return answers[0], failure


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_request_past_its_timeout_in_the_queue_is_answered_and_the_next_runs(
        gate: Gate, transport: str) -> None:
    with _server(gate) as server:
        module: Any = th if transport == "http" else tg
        url = server.url.removeprefix("http://") if transport == "http" else server.grpc_url
        first, failure = _held(gate, _call(module, url), _call(module, url, timeout=50_000))
        assert first.as_numpy("output").shape == (1, 10)
        assert failure is not None and "timeout" in str(failure)
        assert failure.status() in ("504", "StatusCode.DEADLINE_EXCEEDED")
        # A limit that does not pass changes nothing.
        assert _call(module, url, timeout=30_000_000)().as_numpy("output").shape == (1, 10)


def test_a_request_cannot_lengthen_the_pools_limit(gate: Gate) -> None:
    with _server(gate, timeout=0.05) as server:
        url = server.url.removeprefix("http://")
        _, failure = _held(gate, _call(th, url, timeout=60_000_000),
                           _call(th, url, timeout=60_000_000))
        assert failure is not None and failure.status() == "504"


@pytest.mark.parametrize(("value", "seconds"), [(None, None), (0, None), (250_000, 0.25)])
def test_the_timeout_parameter_is_microseconds(value: object, seconds: float | None) -> None:
    assert request_timeout({} if value is None else {"timeout": value}) == seconds


@pytest.mark.parametrize("value", [-1, 1.5, "soon", True])
def test_a_timeout_that_is_not_whole_microseconds_is_refused(value: object) -> None:
    with pytest.raises(ProtocolError, match="timeout=.*whole number of microseconds"):
        request_timeout({"timeout": value})
