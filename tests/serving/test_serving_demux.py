"""Requests merged into one batch get their own rows back, whatever brought them: a plain HTTP
request, a gRPC request, one on a gRPC stream, and one whose input and output are in shared
memory. Deterministic: the model is held at a gate until all four wait in the queue, so they
run as one forward pass of 1 + 2 + 3 + 4 rows, which the test checks."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
import tritonclient.utils.shared_memory as tshm
from serving_helpers import WAIT_S, Gate
from torch import nn

from paraloom.models import LeNet
from paraloom.serving import ServerThread, TensorSpec, create_app


class _Recorder(Gate):
    """A gate that also records the rows of every forward pass (shared by every replica)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []
        self.lock = threading.Lock()

    def record(self, rows: int) -> None:
        with self.lock:
            self.batches.append(rows)


class _RecordedLeNet(nn.Module):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = LeNet(image_size=8)
        self.recorder = recorder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.recorder.pass_through()
        self.recorder.record(x.shape[0])
        return self.net(x)


def _wait_until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.mark.parametrize("backend", ["grpcio", "uvicorn"])
def test_one_batch_of_four_transports_answers_each_its_own_rows(backend: str) -> None:
    if backend == "uvicorn":
        pytest.importorskip("zttp", reason="uvicorn's HTTP/2 needs zttp (Python 3.11+)")
    recorder = _Recorder()
    model = _RecordedLeNet(recorder)
    app = create_app(model, name="lenet", workers=1, batch_limit=64, max_wait_ms=0,
                     inputs=[TensorSpec("input", "FP32", (-1, 1, 8, 8))],
                     outputs=[TensorSpec("output", "FP32", (-1, 10))])
    # warmed on zeros of the declared shape, and on them twice over (outputs follow the rows)
    assert set(recorder.batches) == {1, 2}
    recorder.batches.clear()
    rng = np.random.default_rng(7)
    blocker = rng.random((1, 1, 8, 8), dtype=np.float32)
    rows = {name: rng.random((n, 1, 8, 8), dtype=np.float32)
            for name, n in [("http", 1), ("grpc", 2), ("stream", 3), ("shm", 4)]}
    with torch.no_grad():
        want = {k: model.net.eval()(torch.from_numpy(v)).numpy() for k, v in rows.items()}
    key = f"/pl_demux_{backend}"
    regions = [tshm.create_shared_memory_region("in", key + "_in", rows["shm"].nbytes),
               tshm.create_shared_memory_region("out", key + "_out", want["shm"].nbytes)]
    tshm.set_shared_memory_region(regions[0], [rows["shm"]])
    streamed: queue.Queue[tuple[Any, Any]] = queue.Queue()
    try:
        with ServerThread(app, grpc_port=0, grpc_backend=backend) as server, \
                ThreadPoolExecutor(4) as threads:
            url = server.url[len("http://"):]
            http = th.InferenceServerClient(url)
            grpc = tg.InferenceServerClient(server.grpc_url)
            http.register_system_shared_memory("in", key + "_in", rows["shm"].nbytes)
            http.register_system_shared_memory("out", key + "_out", want["shm"].nbytes)
            pool = app.state.served.pool
            recorder.close()
            first = threads.submit(_http_infer, url, blocker)
            assert recorder.entered.wait(WAIT_S)  # the one worker is held at the gate
            plain = threads.submit(_http_infer, url, rows["http"])
            unary = threads.submit(grpc.infer, "lenet", [_grpc_input(rows["grpc"])])
            grpc.start_stream(callback=lambda result, error: streamed.put((result, error)))
            grpc.async_stream_infer("lenet", [_grpc_input(rows["stream"])], request_id="s")
            in_memory = threads.submit(_shm_infer, url, rows["shm"].nbytes,
                                       want["shm"].nbytes)
            _wait_until(lambda: pool.stats()["queued"] == 4, "four queued requests")
            recorder.open()
            first.result(WAIT_S)
            np.testing.assert_allclose(plain.result(WAIT_S).as_numpy("output"), want["http"],
                                       rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(unary.result(WAIT_S).as_numpy("output"), want["grpc"],
                                       rtol=1e-5, atol=1e-6)
            result, error = streamed.get(timeout=WAIT_S)
            assert error is None and result.get_response().id == "s"
            np.testing.assert_allclose(result.as_numpy("output"), want["stream"], rtol=1e-5,
                                       atol=1e-6)
            in_memory.result(WAIT_S)
            got = tshm.get_contents_as_numpy(regions[1], np.float32, list(want["shm"].shape))
            np.testing.assert_allclose(got, want["shm"], rtol=1e-5, atol=1e-6)
            grpc.stop_stream()
            http.unregister_system_shared_memory()
            grpc.close()
            http.close()
    finally:
        for region in regions:
            tshm.destroy_shared_memory_region(region)
    assert recorder.batches == [1, 10]  # the blocker, then all four requests as one batch


def _http_infer(url: str, x: np.ndarray) -> Any:
    """One request on its own client: tritonclient.http's clients belong to one thread."""
    given = th.InferInput("input", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    with th.InferenceServerClient(url) as client:
        return client.infer("lenet", [given])


def _grpc_input(x: np.ndarray) -> tg.InferInput:
    given = tg.InferInput("input", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    return given


def _shm_infer(url: str, in_bytes: int, out_bytes: int) -> None:
    given = th.InferInput("input", [4, 1, 8, 8], "FP32")
    given.set_shared_memory("in", in_bytes)
    output = th.InferRequestedOutput("output")
    output.set_shared_memory("out", out_bytes)
    with th.InferenceServerClient(url) as client:
        client.infer("lenet", [given], outputs=[output])
