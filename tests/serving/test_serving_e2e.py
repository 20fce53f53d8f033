"""End to end: a real uvicorn server on 127.0.0.1 (port 0) and tritonclient.http as the client."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import tritonclient.http as th
from serving_helpers import WAIT_S, Gate, GatedLeNet
from torch import nn
from tritonclient.utils import InferenceServerException

from paraloom.serving import ServerThread, TensorSpec, create_app


def triton(server: ServerThread) -> th.InferenceServerClient:
    return th.InferenceServerClient(url=f"{server.host}:{server.port}",
                                    connection_timeout=WAIT_S, network_timeout=WAIT_S)


def infer(client: th.InferenceServerClient, x: np.ndarray, *, binary: bool = True,
          binary_out: bool | None = None) -> th.InferResult:
    item = th.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x, binary_data=binary)
    outputs = None if binary_out is None else [th.InferRequestedOutput("output",
                                                                       binary_data=binary_out)]
    return client.infer("lenet", [item], outputs=outputs)


def expected(model: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


@pytest.fixture()
def server(lenet: nn.Module) -> Iterator[ServerThread]:
    app = create_app(lenet, name="lenet", workers=2, batch_limit=32, queue_limit=256)
    with ServerThread(app) as running:
        yield running
    assert app.state.served.pool.closed  # the lifespan shutdown closed the pool it built


def test_binds_localhost_on_a_port_the_os_picked(server: ServerThread) -> None:
    assert server.host == "127.0.0.1" and server.port > 0
    assert server.url == f"http://127.0.0.1:{server.port}"


def test_tritonclient_health_metadata_and_inference(server: ServerThread,
                                                    lenet: nn.Module) -> None:
    client = triton(server)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("lenet") and not client.is_model_ready("resnet")
        meta = client.get_model_metadata("lenet")
        assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
        assert client.get_server_metadata()["extensions"] == [
            "binary_tensor_data", "classification", "logging", "model_configuration",
            "model_repository", "statistics",
            "system_shared_memory"]
        x = np.random.default_rng(0).random((3, 1, 8, 8), dtype=np.float32)
        want = expected(lenet, x)
        for binary, binary_out in [(True, None), (False, False), (True, False), (False, True)]:
            result = infer(client, x, binary=binary, binary_out=binary_out)
            np.testing.assert_allclose(result.as_numpy("output"), want, rtol=1e-5, atol=1e-6)
            assert result.get_response()["model_version"] == "1"
    finally:
        client.close()


def test_tritonclient_sees_protocol_errors(server: ServerThread) -> None:
    client = triton(server)
    try:
        with pytest.raises(InferenceServerException) as info:
            infer(client, np.zeros((1, 1, 8, 9), np.float32))
        assert info.value.status() == "400"
        assert "shape [1, 1, 8, 9] but the model expects [-1, 1, 8, 8]" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            client.get_model_metadata("resnet")
        assert info.value.status() == "404"
    finally:
        client.close()


def test_many_client_threads_get_their_own_answers(server: ServerThread,
                                                   lenet: nn.Module) -> None:
    rng = np.random.default_rng(1)
    inputs = [rng.random((1, 1, 8, 8), dtype=np.float32) for _ in range(96)]

    def one_thread(chunk: list[np.ndarray]) -> list[np.ndarray]:
        client = triton(server)  # geventhttpclient clients are not shared across threads
        try:
            return [infer(client, x).as_numpy("output") for x in chunk]
        finally:
            client.close()

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one_thread, [inputs[i::12] for i in range(12)]))
    for i in range(12):
        for x, got in zip(inputs[i::12], results[i], strict=True):
            np.testing.assert_allclose(got, expected(lenet, x), rtol=1e-5, atol=1e-6)
    assert server.app.state.served.pool.stats()["rows"] == 96  # recorded before delivery


def test_requests_from_separate_http_clients_are_batched_together(lenet: nn.Module) -> None:
    # One worker and a huge max_wait: only 8 rows close the batch, so the 8 threads' requests
    # must all be in one forward pass.
    app = create_app(lenet, name="lenet", workers=1, batch_limit=8, max_wait_ms=60_000)
    with ServerThread(app) as server, ThreadPoolExecutor(8) as pool:
        xs = [np.full((1, 1, 8, 8), i / 8, np.float32) for i in range(8)]

        def send(x: np.ndarray) -> np.ndarray:
            client = triton(server)
            try:
                return infer(client, x).as_numpy("output")
            finally:
                client.close()

        for x, got in zip(xs, pool.map(send, xs), strict=True):
            np.testing.assert_allclose(got, expected(lenet, x), rtol=1e-5, atol=1e-6)
        assert app.state.served.pool.stats()["batch_size_histogram"] == {8: 1}


@pytest.fixture()
def gated() -> Iterator[tuple[ServerThread, Gate]]:
    gate = Gate()
    app = create_app(GatedLeNet(gate), name="lenet", workers=1, queue_limit=2, batch_limit=2,
                     inputs=[TensorSpec("input", "FP32", (-1, 1, 8, 8))])
    server = ServerThread(app).start()
    try:
        yield server, gate
    finally:
        gate.open()
        server.stop()


def test_a_full_queue_answers_503_with_retry_after(gated: tuple[ServerThread, Gate]) -> None:
    server, gate = gated
    pool = server.app.state.served.pool
    gate.close()
    held = [pool.submit(torch.zeros(1, 1, 8, 8))]
    assert gate.entered.wait(WAIT_S)  # the only worker is busy with it
    held += [pool.submit(torch.zeros(1, 1, 8, 8)) for _ in range(2)]  # and the queue is full
    client = triton(server)
    try:
        with pytest.raises(InferenceServerException) as info:
            infer(client, np.zeros((1, 1, 8, 8), np.float32))
        assert info.value.status() == "503" and "queue is full" in info.value.message()
    finally:
        client.close()
    request = urllib.request.Request(f"{server.url}/v2/models/lenet/infer", method="POST",
                                     data=b'{"inputs": [{"name": "input", "shape": [1, 1, 8, 8], '
                                          b'"datatype": "FP32", "data": [' + b"0," * 63 + b"0]}]}")
    with pytest.raises(urllib.error.HTTPError) as http_error:
        urllib.request.urlopen(request, timeout=WAIT_S)
    assert http_error.value.code == 503 and http_error.value.headers["Retry-After"] == "1"
    gate.open()
    assert all(f.result(WAIT_S).shape == (1, 10) for f in held)


def test_shutdown_drains_in_flight_requests(gated: tuple[ServerThread, Gate]) -> None:
    server, gate = gated
    gate.close()
    with ThreadPoolExecutor(2) as pool:
        def send() -> np.ndarray:
            client = triton(server)
            try:
                return infer(client, np.ones((1, 1, 8, 8), np.float32)).as_numpy("output")
            finally:
                client.close()

        in_flight = pool.submit(send)
        assert gate.entered.wait(WAIT_S)  # the request is inside the model
        stopping = pool.submit(server.stop)
        assert server.stopping.wait(WAIT_S)  # shutdown began while it runs
        gate.open()
        assert in_flight.result(WAIT_S).shape == (1, 10)  # it finished, it was not dropped
        stopping.result(WAIT_S)
    assert server.app.state.served.pool.closed
    assert not any(t.name == f"uvicorn:{server.port}" for t in threading.enumerate())


def test_a_server_that_owns_its_process_freezes_the_startup_heap_and_still_serves() -> None:
    import gc

    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2)).eval()
    x = np.ones((1, 4), dtype=np.float32)
    assert gc.get_freeze_count() == 0
    with ServerThread(create_app(model, name="lenet", workers=1)) as server:
        assert gc.get_freeze_count() == 0  # a server in the caller's process leaves it alone
        assert np.allclose(infer(triton(server), x).as_numpy("output"), expected(model, x))
    try:
        with ServerThread(create_app(model, name="lenet", workers=1), freeze_gc=True) as server:
            assert gc.get_freeze_count() > 1000  # torch's modules and the app, at least
            assert np.allclose(infer(triton(server), x).as_numpy("output"), expected(model, x))
    finally:
        gc.unfreeze()
