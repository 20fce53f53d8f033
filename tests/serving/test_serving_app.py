"""Every endpoint and every error, in process through httpx's ASGI transport, on a real pool."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import threading
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as th
from serving_helpers import (
    WAIT_S,
    Client,
    Gate,
    GatedLeNet,
    closing,
    expected,
    infer_json,
    outputs_of,
)
from starlette.applications import Starlette
from torch import nn
from tritonclient.http._utils import _get_inference_request

from paraloom.inference.parallel import ParallelInference
from paraloom.models import LeNet
from paraloom.serving import TensorSpec, create_app

URL = "/v2/models/lenet/infer"


def test_model_config_is_tritons_form(client: Client) -> None:
    config = client.get("/v2/models/lenet/config").json()
    assert config["max_batch_size"] == 32  # no max_batch_size: the pool's batch_limit
    assert config["input"] == [{"name": "input", "data_type": "TYPE_FP32", "dims": [1, 8, 8]}]
    assert config["output"][0]["dims"] == [10] and config["platform"] == "pytorch"
    assert client.get("/v2/models/lenet/versions/1/config").json() == config
    assert client.get("/v2/models/nope/config").status_code == 404


class _ClassAndScore(nn.Module):
    """One value per row for each output: the top class and its score."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        score, index = self.linear(x).max(dim=1)
        return {"index": index, "score": score}


def test_one_value_per_row_is_dims_1_reshaped_to_none_as_triton_writes_it() -> None:
    import tritonclient.grpc as tg

    from paraloom.serving import ServerThread

    torch.manual_seed(0)
    app = create_app(_ClassAndScore().eval(), name="top", workers=1)
    with ServerThread(app, grpc_port=0, grpc_backend="grpcio") as server:
        config = th.InferenceServerClient(server.url[len("http://"):]).get_model_config("top")
        assert config["input"] == [{"name": "input", "data_type": "TYPE_FP32", "dims": [4]}]
        assert config["output"] == [
            {"name": n, "data_type": t, "dims": [1], "reshape": {"shape": []}}
            for n, t in (("index", "TYPE_INT64"), ("score", "TYPE_FP32"))]
        grpc = tg.InferenceServerClient(server.grpc_url).get_model_config("top").config
        assert [(o.name, list(o.dims), list(o.reshape.shape), o.HasField("reshape"))
                for o in grpc.output] == [("index", [1], [], True), ("score", [1], [], True)]
        assert grpc.max_batch_size == 32 and not grpc.input[0].HasField("reshape")


def test_server_metadata_names_the_extensions(client: Client) -> None:
    body = client.get("/v2").json()
    assert body["name"] == "paraloom"
    assert body["extensions"] == ["binary_tensor_data", "classification", "logging",
                                  "model_configuration", "model_repository",
                                  "statistics", "system_shared_memory"]


def test_health_endpoints_are_200_while_serving(client: Client) -> None:
    for url in ("/v2/health/live", "/v2/health/ready", "/v2/models/lenet/ready",
                "/v2/models/lenet/versions/1/ready"):
        assert client.get(url).status_code == 200, url


def test_model_metadata_describes_inputs_and_outputs(client: Client) -> None:
    want = {"name": "lenet", "versions": ["1"], "platform": "pytorch",
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}],
            "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}]}
    assert client.get("/v2/models/lenet").json() == want
    assert client.get("/v2/models/lenet/versions/1").json() == want


def test_json_inference_equals_the_models_own_output(client: Client, lenet: nn.Module) -> None:
    x = torch.rand(3, 1, 8, 8)
    r = client.post(URL, json=infer_json(x, id="req-7"))
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert (body["model_name"], body["model_version"], body["id"]) == ("lenet", "1", "req-7")
    assert body["outputs"][0]["shape"] == [3, 10]
    torch.testing.assert_close(outputs_of(r), expected(lenet, x))


def test_an_empty_outputs_array_returns_every_output(client: Client, lenet: nn.Module) -> None:
    x = torch.rand(2, 1, 8, 8)
    r = client.post(URL, json=infer_json(x, outputs=[]))
    assert r.status_code == 200, r.text
    assert [o["name"] for o in r.json()["outputs"]] == ["output"]
    torch.testing.assert_close(outputs_of(r), expected(lenet, x))


def tritonclient_body(x: np.ndarray, outputs: list[th.InferRequestedOutput] | None = None
                      ) -> tuple[bytes, dict[str, str]]:
    item = th.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    body, header_length = _get_inference_request([item], "", outputs, 0, False, False, 0, None,
                                                 None)
    return body, {"Inference-Header-Content-Length": str(header_length)}


def test_binary_inference_as_tritonclient_sends_it(client: Client, lenet: nn.Module) -> None:
    x = np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32)
    body, headers = tritonclient_body(x)
    r = client.post(URL, content=body, headers=headers)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/octet-stream"
    result = th.InferResult.from_response_body(
        r.content, header_length=int(r.headers["Inference-Header-Content-Length"]))
    np.testing.assert_allclose(result.as_numpy("output"),
                               expected(lenet, torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-6)


def test_requested_output_as_json_overrides_binary_default(client: Client) -> None:
    x = np.zeros((1, 1, 8, 8), np.float32)
    body, headers = tritonclient_body(x, [th.InferRequestedOutput("output", binary_data=False)])
    r = client.post(URL, content=body, headers=headers)
    assert r.status_code == 200 and "Inference-Header-Content-Length" not in r.headers
    assert len(r.json()["outputs"][0]["data"]) == 10


def assert_error(r, status: int, *fragments: str) -> None:
    assert r.status_code == status, r.text
    message = r.json()["error"]
    assert isinstance(message, str)
    for fragment in fragments:
        assert fragment in message, message


def lenet_input(**fields: object) -> dict:
    item = {"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0.5] * 64}
    item.update(fields)
    return {"inputs": [item]}


@pytest.mark.parametrize(("body", "status", "fragment"), [
    (b"{oops", 400, "not valid JSON"),
    (b"", 400, "not valid JSON"),
    (json.dumps(lenet_input(datatype="FP64")).encode(), 400, "datatype FP64 but the model "
     "expects FP32"),
    (json.dumps(lenet_input(shape=[1, 64], data=[0.5] * 64)).encode(), 400,
     "shape [1, 64] but the model expects [-1, 1, 8, 8]"),
    (json.dumps(lenet_input(data=[0.5] * 63)).encode(), 400, "63 data elements but shape"),
    (json.dumps(lenet_input(name="image")).encode(), 400, "unknown: ['image']"),
    (json.dumps(lenet_input(datatype="BYTES")).encode(), 400, "BYTES"),
    (json.dumps({**lenet_input(), "outputs": [{"name": "probs"}]}).encode(), 400,
     "outputs ['probs'] that the model does not have"),
])
def test_bad_requests_get_400_with_a_clear_message(client: Client, body: bytes, status: int,
                                                   fragment: str) -> None:
    assert_error(client.post(URL, content=body), status, fragment)


def test_bad_header_length_is_400(client: Client) -> None:
    r = client.post(URL, content=b"{}", headers={"Inference-Header-Content-Length": "ten"})
    assert_error(r, 400, "Inference-Header-Content-Length is 'ten'")


@pytest.mark.parametrize(("method", "url", "status", "fragment"), [
    ("GET", "/v2/models/resnet", 404, "unknown model 'resnet'; this server serves ['lenet']"),
    ("GET", "/v2/models/lenet/versions/9", 404, "has no version '9'; it serves version '1'"),
    ("GET", "/v2/models/lenet/versions/9/ready", 404, "no version '9'"),
    ("POST", "/v2/models/resnet/infer", 404, "unknown model 'resnet'"),
    ("POST", "/v2/models/lenet/versions/2/infer", 404, "no version '2'"),
    ("GET", "/v3/anything", 404, "no endpoint GET /v3/anything"),
    ("GET", URL, 405, "GET is not allowed"),
    ("POST", "/v2/repository/models/resnet/load", 404, "unknown model 'resnet'"),
])
def test_unknown_models_versions_and_routes(client: Client, method: str, url: str, status: int,
                                            fragment: str) -> None:
    assert_error(client.request(method, url, content=json.dumps(lenet_input())), status,
                 fragment)


@pytest.mark.parametrize("url", ["/v2/models/resnet/infer", "/v2/models/lenet/versions/2/infer"])
def test_an_unknown_model_is_404_before_its_body_is_read(client: Client, url: str) -> None:
    # As Triton: the model is looked up first, so a body that is no request does not hide it
    assert_error(client.post(url, content=b"{}"), 404, "resnet" if "resnet" in url else "'2'")
    metrics = client.get("/metrics").text
    assert 'reason="not_found"' in metrics and 'reason="bad_request"' not in metrics


def test_a_request_the_model_fails_on_alone_is_400(lenet: nn.Module) -> None:
    model = nn.Linear(5, 2)
    app = create_app(model, name="m", inputs=[TensorSpec("x", "FP32", (-1, -1))],
                     outputs=[TensorSpec("y", "FP32", (-1, 2))], workers=1)
    client = Client(app)
    try:
        ok = client.post("/v2/models/m/infer", json=infer_json(torch.ones(1, 5), name="x"))
        assert ok.status_code == 200
        bad = client.post("/v2/models/m/infer", json=infer_json(torch.ones(1, 6), name="x"))
        assert_error(bad, 400, "failed on this request alone", "Tensor(N, 6) float32",
                     "Tensor(N, 5) float32")
    finally:
        client.close()
        closing(app)


class Broken(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            raise MemoryError("simulated out of memory")
        return super().forward(x)


def test_a_model_failing_on_its_own_is_500_and_names_the_cause() -> None:
    torch.manual_seed(0)
    app = create_app(Broken(4, 2), name="m", workers=1)
    client = Client(app)
    try:
        r = client.post("/v2/models/m/infer", json=infer_json(torch.ones(2, 4)))
        assert_error(r, 500, "the model failed", "simulated out of memory")
        metrics = client.get("/metrics").text
        assert 'paraloom_inference_failures_total{model="m",reason="model_error"} 1.0' in metrics
    finally:
        client.close()
        closing(app)


def test_body_over_the_limit_is_413_by_content_length_and_by_stream(lenet: nn.Module) -> None:
    app = create_app(lenet, name="lenet", workers=1, max_body_bytes=1000)
    client = Client(app)
    try:
        big = json.dumps(lenet_input(data=[0.12345678901] * 64)).encode()
        assert len(big) > 1000
        assert_error(client.post(URL, content=big), 413, "over this server's limit of 1000")

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the server counts
            for i in range(0, len(big), 100):
                yield big[i:i + 100]

        assert_error(client.post(URL, content=chunks()), 413, "limit of 1000")
        bomb = gzip.compress(b" " * 500_000)  # ~500 bytes that inflate 1000-fold
        assert len(bomb) < 1000
        r = client.post(URL, content=bomb, headers={"Content-Encoding": "gzip"})
        assert_error(r, 413, "decompressed gzip body")
        metrics = client.get("/metrics").text
        assert 'reason="body_too_large"} 3.0' in metrics
    finally:
        client.close()
        closing(app)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_bodies_are_read(client: Client, lenet: nn.Module, encoding: str) -> None:
    x = torch.rand(1, 1, 8, 8)
    raw = json.dumps(infer_json(x)).encode()
    body = gzip.compress(raw) if encoding == "gzip" else zlib.compress(raw)
    r = client.post(URL, content=body, headers={"Content-Encoding": encoding})
    assert r.status_code == 200
    torch.testing.assert_close(outputs_of(r), expected(lenet, x))


@pytest.mark.parametrize(("headers", "fragment"), [
    ({"Content-Encoding": "br"}, "'br' is not supported"),
    ({"Content-Encoding": "gzip"}, "not valid gzip data"),
])
def test_bad_encodings_are_400(client: Client, headers: dict, fragment: str) -> None:
    assert_error(client.post(URL, content=b"plain", headers=headers), 400, fragment)


_WHOLE = json.dumps(infer_json(torch.rand(1, 1, 8, 8))).encode()


@pytest.mark.parametrize(("encoding", "body", "fragment"), [
    ("gzip", gzip.compress(_WHOLE)[:-8], "cut short"),  # no CRC and length: zlib says nothing
    ("gzip", gzip.compress(_WHOLE)[: len(_WHOLE) // 4], "cut short"),
    ("deflate", zlib.compress(_WHOLE)[:-4], "cut short"),  # no Adler-32
    ("gzip", gzip.compress(_WHOLE) + b"junk", "4 bytes follow"),
])
def test_a_cut_or_padded_compressed_body_is_400(client: Client, encoding: str, body: bytes,
                                                fragment: str) -> None:
    r = client.post(URL, content=body, headers={"Content-Encoding": encoding})
    assert_error(r, 400, f"not valid {encoding} data")
    assert fragment in r.json()["error"]


def test_concurrent_clients_share_one_batch(lenet: nn.Module) -> None:
    # A huge max_wait lets only size close the batch: 16 clients must land in one forward pass.
    app = create_app(lenet, name="lenet", workers=1, batch_limit=16, max_wait_ms=60_000)
    client = Client(app)
    try:
        xs = [torch.rand(1, 1, 8, 8) for _ in range(16)]
        responses = client.gather(*(("POST", URL, {"json": infer_json(x)}) for x in xs))
        for x, r in zip(xs, responses, strict=True):
            assert r.status_code == 200
            torch.testing.assert_close(outputs_of(r), expected(lenet, x))
        stats = app.state.served.pool.stats()
        assert stats["batch_size_histogram"] == {16: 1}
        metrics = client.get("/metrics").text
        assert 'paraloom_batch_size_bucket{le="16.0",model="lenet"} 1.0' in metrics
        assert 'paraloom_batch_size_bucket{le="8.0",model="lenet"} 0.0' in metrics
        assert 'paraloom_inference_requests_total{model="lenet"} 16.0' in metrics
    finally:
        client.close()
        closing(app)


def test_a_client_gone_before_its_body_ended_is_counted_as_gone_not_as_a_model_failure(
        app: Starlette, client: Client, caplog: pytest.LogCaptureFixture) -> None:
    body = json.dumps(lenet_input()).encode()
    messages = [{"type": "http.request", "body": body[:20], "more_body": True},
                {"type": "http.disconnect"}]
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        return messages.pop(0)

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": URL, "raw_path": URL.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 2),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), WAIT_S))
    assert sent[0]["status"] == 499  # sent into the void: uvicorn drops it
    text = client.get("/metrics").text
    assert ('paraloom_inference_failures_total{model="lenet",reason="client_disconnected"} 1.0'
            in text)
    assert "model_error" not in text and "inference failed" not in caplog.text


def test_metrics_count_requests_and_failures_by_reason(client: Client) -> None:
    client.post(URL, json=lenet_input())
    client.post(URL, content=b"{")
    client.post("/v2/models/nope/infer", json=lenet_input())
    text = client.get("/metrics").text
    assert 'paraloom_inference_requests_total{model="lenet"} 2.0' in text
    assert 'paraloom_inference_failures_total{model="lenet",reason="bad_request"} 1.0' in text
    # Names the server does not have share one label: a client cannot grow the label set.
    assert 'paraloom_inference_requests_total{model="unknown"} 1.0' in text
    assert 'paraloom_inference_failures_total{model="unknown",reason="not_found"} 1.0' in text
    assert 'model="nope"' not in text
    assert 'paraloom_request_duration_seconds_count{model="lenet"} 1.0' in text
    assert 'paraloom_pool_rows_total{model="lenet"} 1.0' in text  # recorded before delivery
    assert 'paraloom_model_version{model="lenet"} 1.0' in text
    for name in ("paraloom_queue_time_seconds", "paraloom_forward_time_seconds"):
        assert f'{name}{{model="lenet",quantile="0.99"}}' in text


def test_repository_index_lists_the_model(client: Client) -> None:
    assert client.post("/v2/repository/index").json() == [
        {"name": "lenet", "version": "1", "state": "READY", "reason": ""}]


def test_unload_then_load_serves_the_model_again_in_a_new_pool(app: Starlette,
                                                               client: Client) -> None:
    x = torch.rand(2, 1, 8, 8)
    before = outputs_of(client.post(URL, json=infer_json(x)))
    old_pool = app.state.repository.get("lenet").pool
    assert client.post("/v2/repository/models/lenet/unload").status_code == 200
    assert old_pool.closed  # unload drained and closed the pool the server built
    assert_error(client.post(URL, json=infer_json(x)), 404, "not loaded", "/load")
    assert client.get("/v2/models/lenet/ready").status_code == 400  # known, not ready
    assert client.get("/v2/models/nope/ready").status_code == 404
    assert client.post("/v2/repository/index").json() == [
        {"name": "lenet", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}]
    assert client.post("/v2/repository/models/lenet/load").json() == {"name": "lenet",
                                                                      "version": "2"}
    served = app.state.repository.get("lenet")
    assert served.pool is not old_pool and not served.pool.closed
    torch.testing.assert_close(outputs_of(client.post(URL, json=infer_json(x))), before)


def test_pool_counters_keep_counting_across_an_unload_and_a_load(client: Client) -> None:
    """They followed the latest pool: a load served a new one and every counter fell to 0."""
    def counts() -> dict[str, float]:
        text = client.get("/metrics").text
        wanted = ("paraloom_pool_rows_total", "paraloom_pool_requests_total",
                  "paraloom_batch_size_count")
        return {key: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                for key in wanted if line.startswith(key + '{model="lenet"}')}

    assert client.post(URL, json=infer_json(torch.rand(3, 1, 8, 8))).status_code == 200
    first = {"paraloom_pool_rows_total": 3.0, "paraloom_pool_requests_total": 1.0,
             "paraloom_batch_size_count": 1.0}
    assert counts() == first
    assert client.post("/v2/repository/models/lenet/unload").status_code == 200
    assert counts() == first  # unloaded: its pool is closed, its counts kept
    assert client.post("/v2/repository/models/lenet/load").status_code == 200
    assert client.post(URL, json=infer_json(torch.rand(2, 1, 8, 8))).status_code == 200
    assert counts() == {"paraloom_pool_rows_total": 5.0, "paraloom_pool_requests_total": 2.0,
                        "paraloom_batch_size_count": 2.0}  # the new pool's counts on top


def test_the_model_version_metric_is_the_version_served(client: Client) -> None:
    assert 'paraloom_model_version{model="lenet"} 1.0' in client.get("/metrics").text
    assert client.post("/v2/repository/models/lenet/unload").status_code == 200
    assert client.post("/v2/repository/models/lenet/load").json()["version"] == "2"
    text = client.get("/metrics").text  # the new pool counts from 1; the server serves 2
    assert 'paraloom_model_version{model="lenet"} 2.0' in text, text


def test_unload_of_an_unknown_model_is_404(client: Client) -> None:
    assert_error(client.post("/v2/repository/models/nope/unload"), 404, "unknown model 'nope'")


def test_load_is_forbidden_without_a_file_or_directory(client: Client) -> None:
    assert_error(client.post("/v2/repository/models/lenet/load"), 403, "loading is disabled")


class TwoInTwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.fc(a) * b
        return {"y": y, "best": y.argmax(dim=1)}


def test_multi_input_model_with_named_outputs() -> None:
    torch.manual_seed(0)
    model = TwoInTwoOut().eval()
    app = create_app(model, name="two", sample=(torch.zeros(1, 3), torch.zeros(1, 2)), workers=1)
    client = Client(app)
    try:
        a, b = torch.rand(4, 3), torch.rand(4, 2)
        body = {"inputs": [infer_json(b, name="input_1")["inputs"][0],
                           infer_json(a, name="input_0")["inputs"][0]],
                "outputs": [{"name": "best"}]}
        r = client.post("/v2/models/two/infer", json=body)
        assert r.status_code == 200
        (out,) = r.json()["outputs"]
        assert (out["name"], out["datatype"], out["shape"]) == ("best", "INT64", [4])
        with torch.no_grad():
            assert out["data"] == model(a, b)["best"].tolist()
    finally:
        client.close()
        closing(app)


def test_an_existing_pool_is_served_and_left_open(lenet: nn.Module) -> None:
    with ParallelInference(lenet, workers=1) as pool:
        with pytest.raises(TypeError, match="needs model="):
            create_app(pool, name="lenet")
        app = create_app(pool, name="lenet", model=lenet)
        client = Client(app)
        try:
            x = torch.rand(2, 1, 8, 8)
            torch.testing.assert_close(outputs_of(client.post(URL, json=infer_json(x))),
                                       expected(lenet, x))
        finally:
            client.close()
        assert not pool.closed


def test_create_app_checks_its_arguments(lenet: nn.Module) -> None:
    with pytest.raises(ValueError, match="max_body_bytes=0"):
        create_app(lenet, max_body_bytes=0)
    with pytest.raises(TypeError, match="takes an nn.Module or a ParallelInference"):
        create_app(object())


def test_after_close_ready_is_false_and_inference_is_503(app: Starlette, client: Client) -> None:
    client.run(app.state.served.close())  # what the lifespan shutdown does
    assert client.get("/v2/health/ready").status_code == 400
    assert client.get("/v2/models/lenet/ready").status_code == 400
    assert client.get("/v2/health/live").status_code == 200
    r = client.post(URL, json=lenet_input())
    assert_error(r, 503, "shutting down")
    assert r.headers["Retry-After"] == "1"


def test_full_queue_is_503_with_retry_after(
        gated_app: tuple[Starlette, Gate, ParallelInference]) -> None:
    app, gate, pool = gated_app
    client = Client(app)
    held = []
    try:
        gate.close()
        held.append(pool.submit(torch.zeros(1, 1, 8, 8)))  # the only worker takes it and waits
        assert gate.entered.wait(30)
        held += [pool.submit(torch.zeros(1, 1, 8, 8)) for _ in range(2)]  # queue_limit=2: full
        r = client.post(URL, json=lenet_input())
        assert_error(r, 503, "queue is full", "retry after 1 s")
        assert r.headers["Retry-After"] == "1"
        assert 'reason="queue_full"} 1.0' in client.get("/metrics").text
    finally:
        gate.open()
        client.close()
    for fut in held:
        assert fut.result(30).shape == (1, 10)


@pytest.fixture()
def gated_app() -> Iterator[tuple[Starlette, Gate, ParallelInference]]:
    gate = Gate()
    app = create_app(GatedLeNet(gate), name="lenet", workers=1, queue_limit=2, batch_limit=2,
                     inputs=[TensorSpec("input", "FP32", (-1, 1, 8, 8))])
    yield app, gate, app.state.served.pool
    gate.open()
    closing(app)


def test_lenet_28_metadata() -> None:
    app = create_app(LeNet(), name="mnist", workers=1)
    client = Client(app)
    try:
        meta = client.get("/v2/models/mnist").json()
        assert meta["inputs"][0]["shape"] == [-1, 1, 28, 28]
    finally:
        client.close()
        closing(app)


@pytest.mark.parametrize("mode", ["batched", "sequential", "inplace"])
def test_every_inference_mode_serves(lenet: nn.Module, mode: str) -> None:
    app = create_app(lenet, name="lenet", inference_mode=mode, workers=2)
    client = Client(app)
    try:
        xs = [torch.rand(2, 1, 8, 8) for _ in range(6)]
        responses = client.gather(*(("POST", URL, {"json": infer_json(x)}) for x in xs))
        for x, r in zip(xs, responses, strict=True):
            assert r.status_code == 200, r.text
            torch.testing.assert_close(outputs_of(r), expected(lenet, x))
    finally:
        client.close()
        closing(app)


def test_a_request_past_its_pool_timeout_is_504() -> None:
    gate = Gate()
    app = create_app(GatedLeNet(gate), name="lenet", workers=1, batch_limit=2, timeout=1e-6,
                     inputs=[TensorSpec("input", "FP32", (-1, 1, 8, 8))])
    pool = app.state.served.pool
    client = Client(app)
    queued = threading.Event()
    real_submit = pool.submit

    def submit(*args: object, **kwargs: object) -> object:  # tells the test it is queued
        future = real_submit(*args, **kwargs)
        queued.set()
        return future

    async def scenario() -> httpx.Response:
        gate.close()
        held = pool.submit(torch.zeros(1, 1, 8, 8), timeout=None)  # holds the only worker
        assert await asyncio.to_thread(gate.entered.wait, 30)
        pool.submit = submit
        request = asyncio.create_task(client.http.post(URL, json=lenet_input()))
        assert await asyncio.to_thread(queued.wait, 30)
        gate.open()  # the worker finishes, then finds our request long past its 1 us timeout
        assert (await asyncio.wrap_future(held)).shape == (1, 10)
        return await request

    try:
        r = client.run(scenario())
        assert_error(r, 504, "timeout")
        assert 'reason="timeout"} 1.0' in client.get("/metrics").text
    finally:
        gate.open()
        client.close()
        closing(app)


def _binary_body(shape: list[int]) -> tuple[bytes, dict[str, str]]:
    head = json.dumps({"inputs": [{"name": "input", "shape": shape, "datatype": "FP32",
                                   "parameters": {"binary_data_size": 0}}]}).encode()
    return head, {"Inference-Header-Content-Length": str(len(head))}


@pytest.mark.parametrize(("item", "fragment"), [
    ({"shape": [1] * 70, "data": [0.5]}, "shape of 70 dimensions; expected at most 32"),
    ({"shape": [0, 2**62, 2**62], "data": []}, "multiply to more than"),
    ({"shape": [0, 2**20, 2**20, 2**20], "data": []}, "multiply to more than"),
])
def test_absurd_shapes_are_400_not_500(client: Client, item: dict, fragment: str) -> None:
    assert_error(client.post(URL, json=lenet_input(**item)), 400, fragment)


def test_an_absurd_binary_shape_is_400_not_500(client: Client) -> None:
    body, headers = _binary_body([0, 2**62, 2**62])
    assert_error(client.post(URL, content=body, headers=headers), 400, "multiply to more than")


def test_a_tensor_that_cannot_be_built_is_400(client: Client, monkeypatch) -> None:
    from paraloom.serving import protocol

    def refuse(*args: object) -> torch.Tensor:
        raise ValueError("array is too big; `arr.size * arr.dtype.itemsize` is larger than ...")

    monkeypatch.setattr(protocol, "tensor_from_json", refuse)
    assert_error(client.post(URL, json=lenet_input()), 400, "cannot be built as a tensor of "
                 "shape [1, 1, 8, 8]", "array is too big")


@pytest.mark.parametrize("value", ["\u00b2", "\u0663", "1\u00b9"])
def test_a_header_length_of_non_ascii_digits_is_400(client: Client, value: str) -> None:
    r = client.post(URL, content=b"{}",
                    headers=[(b"Inference-Header-Content-Length", value.encode())])
    assert_error(r, 400, "Inference-Header-Content-Length is", "as ASCII digits")


class FailsAlways(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the model is broken")


@pytest.mark.parametrize("mode", ["batched", "sequential", "inplace"])
def test_a_model_failing_on_every_input_is_500_not_the_callers_fault(mode: str) -> None:
    app = create_app(FailsAlways(4, 2), name="m", inference_mode=mode, workers=1,
                     inputs=[TensorSpec("input", "FP32", (-1, 4))],
                     outputs=[TensorSpec("output", "FP32", (-1, 2))])
    client = Client(app)
    try:
        r = client.post("/v2/models/m/infer", json=infer_json(torch.ones(1, 4)))
        assert_error(r, 500, "the model is broken", "has not run any input successfully")
    finally:
        client.close()
        closing(app)


@pytest.mark.parametrize("mode", ["batched", "sequential", "inplace"])
def test_a_bad_first_request_is_still_400_thanks_to_the_signature_probe(mode: str) -> None:
    app = create_app(nn.Linear(5, 2), name="m", inference_mode=mode, workers=1,
                     sample=torch.ones(1, 5), inputs=[TensorSpec("x", "FP32", (-1, -1))])
    client = Client(app)
    try:
        bad = client.post("/v2/models/m/infer", json=infer_json(torch.ones(1, 6), name="x"))
        assert_error(bad, 400, "failed on this request alone", "Tensor(N, 6) float32",
                     "Tensor(N, 5) float32")
    finally:
        client.close()
        closing(app)


def test_inplace_answers_503_past_workers_plus_queue_limit() -> None:
    gate = Gate()
    app = create_app(GatedLeNet(gate), name="lenet", inference_mode="inplace", workers=1,
                     queue_limit=1, inputs=[TensorSpec("input", "FP32", (-1, 1, 8, 8))])
    client = Client(app)
    x = torch.rand(1, 1, 8, 8)

    async def refused_then_rest() -> tuple[list[httpx.Response], list[httpx.Response]]:
        gate.close()
        tasks = [asyncio.create_task(client.http.post(URL, json=infer_json(x)))
                 for _ in range(8)]
        pending = asyncio.as_completed(tasks, timeout=WAIT_S)
        refused = [await next(pending) for _ in range(6)]
        gate.open()
        return refused, [await t for t in pending]

    try:
        refused, served = client.run(refused_then_rest())
        for r in refused:
            assert_error(r, 503, "queue is full", "workers + queue_limit = 2")
            assert r.headers["Retry-After"] == "1"
        assert [r.status_code for r in served] == [200, 200]
        assert 'reason="queue_full"} 6.0' in client.get("/metrics").text
        assert client.post(URL, json=infer_json(x)).status_code == 200  # the count went down
    finally:
        gate.open()
        client.close()
        closing(app)


@contextlib.contextmanager
def gated_lenet(**pool_options: Any) -> Iterator[tuple[Gate, Starlette, Client]]:
    """A LeNet app whose forward passes wait at the gate (opened, and all closed, at the end)."""
    gate = Gate()
    app = create_app(GatedLeNet(gate), name="lenet", workers=1,
                     inputs=[TensorSpec("input", "FP32", (-1, 1, 8, 8))], **pool_options)
    client = Client(app)
    try:
        yield gate, app, client
    finally:
        gate.open()
        client.close()
        closing(app)


async def _admitted(served: Any, count: int) -> None:
    while served._admitted + served._inplace_now < count:
        await asyncio.sleep(0.01)


def test_inplace_unload_lets_the_requests_waiting_for_a_replica_finish() -> None:
    x = torch.rand(1, 1, 8, 8)
    with gated_lenet(inference_mode="inplace") as (gate, app, client):
        served = app.state.served

        async def unload_under_load() -> tuple[list[httpx.Response], httpx.Response]:
            gate.close()
            tasks = [asyncio.create_task(client.http.post(URL, json=infer_json(x)))
                     for _ in range(3)]  # one runs on the only replica, two wait for it
            assert await asyncio.to_thread(gate.entered.wait, WAIT_S)
            while served._inplace_now < 3:
                await asyncio.sleep(0.01)
            unload = asyncio.create_task(client.http.post("/v2/repository/models/lenet/unload"))
            await asyncio.sleep(0.2)
            assert not unload.done()  # draining: the unload waits for the requests in flight
            gate.open()
            return list(await asyncio.gather(*tasks)), await unload

        answered, unloaded = client.run(unload_under_load())
        assert unloaded.status_code == 200, unloaded.text
        for r in answered:
            assert r.status_code == 200, r.text
            torch.testing.assert_close(outputs_of(r), expected(GatedLeNet(Gate()).net, x))
        assert served.pool.closed


def test_an_unload_answers_what_was_queued_though_the_graceful_timeout_is_short() -> None:
    """The graceful timeout bounds the server's stop; an unload (or a reload) of a model
    cut its queue off at it: with --graceful-timeout 0.05, queued requests were 503 'close
    (timeout=0.0) ran out of time'."""
    from paraloom.serving.server import _config

    x = torch.rand(1, 1, 8, 8)
    with gated_lenet(batch_limit=1) as (gate, app, client):
        _config(app, log_level="warning", access_log=False, graceful_timeout=0.05)
        served = app.state.served

        async def unload_under_load() -> tuple[list[httpx.Response], httpx.Response]:
            gate.close()
            tasks = [asyncio.create_task(client.http.post(URL, json=infer_json(x)))
                     for _ in range(4)]  # one in the model, three queued
            assert await asyncio.to_thread(gate.entered.wait, WAIT_S)
            await _admitted(served, 4)
            unload = asyncio.create_task(client.http.post("/v2/repository/models/lenet/unload"))
            await asyncio.sleep(0.3)  # six graceful timeouts
            gate.open()
            return list(await asyncio.gather(*tasks)), await unload

        answered, unloaded = client.run(unload_under_load())
        assert unloaded.status_code == 200, unloaded.text
        assert [r.status_code for r in answered] == [200] * 4, [r.text for r in answered]
        for r in answered:
            torch.testing.assert_close(outputs_of(r), expected(GatedLeNet(Gate()).net, x))
        assert served.pool.closed


@pytest.mark.filterwarnings("ignore:close\\(\\).*still running a batch")
def test_the_servers_stop_cuts_a_draining_unload_to_its_deadline() -> None:
    import time

    with gated_lenet(batch_limit=1) as (gate, app, client):
        served, repository = app.state.served, app.state.repository

        async def stop_while_unloading() -> tuple[list[int], httpx.Response]:
            gate.close()
            tasks = [asyncio.create_task(client.http.post(URL, json=infer_json(
                torch.rand(1, 1, 8, 8)))) for _ in range(3)]
            assert await asyncio.to_thread(gate.entered.wait, WAIT_S)
            await _admitted(served, 3)
            unload = asyncio.create_task(client.http.post("/v2/repository/models/lenet/unload"))
            while not served.draining:
                await asyncio.sleep(0.01)
            repository.close_deadline = time.monotonic() + 0.1
            await repository.close()  # the server's stop: it returns though the model hangs
            gate.open()
            return [r.status_code for r in await asyncio.gather(*tasks)], await unload

        codes, unloaded = client.run(stop_while_unloading())
        assert sorted(codes) == [200, 503, 503] and unloaded.status_code == 200
        assert served.pool.closed


def test_one_models_drain_holds_no_other_models_unload_up() -> None:
    other = create_app(nn.Linear(4, 2), name="quick", workers=1)
    with gated_lenet() as (gate, app, client):
        repository = app.state.repository
        repository.add(other.state.served)

        async def unload_both() -> tuple[bool, httpx.Response, httpx.Response]:
            gate.close()
            held = asyncio.create_task(client.http.post(
                "/v2/models/lenet/infer", json=infer_json(torch.rand(1, 1, 8, 8))))
            assert await asyncio.to_thread(gate.entered.wait, WAIT_S)
            slow = asyncio.create_task(client.http.post("/v2/repository/models/lenet/unload"))
            while "lenet" in repository.models():
                await asyncio.sleep(0.01)
            quick = asyncio.create_task(client.http.post("/v2/repository/models/quick/unload"))
            done, _ = await asyncio.wait({quick}, timeout=5.0)  # it waited for the gate: 30 s
            slow_was_draining = not slow.done()
            gate.open()
            assert (await held).status_code == 200
            return slow_was_draining and quick in done, await slow, await quick

        try:
            quick_went_first, slow, quick = client.run(unload_both())
        finally:
            closing(other)
        assert quick_went_first, "the quick model's unload waited for the slow one's drain"
        assert (slow.status_code, quick.status_code) == (200, 200), (slow.text, quick.text)
        assert other.state.served.pool.closed and app.state.served.pool.closed


@pytest.mark.filterwarnings("ignore:close\\(\\).*still running a batch")
def test_shutdown_drains_the_pool_only_for_the_graceful_timeout() -> None:
    from paraloom.inference import InferenceClosedError
    from paraloom.serving.server import _config

    with gated_lenet(batch_limit=1) as (gate, app, client):
        served, pool = app.state.served, app.state.served.pool
        _config(app, log_level="warning", access_log=False, graceful_timeout=0.05)
        assert served.close_timeout == 0.05
        gate.close()
        held = pool.submit(torch.zeros(1, 1, 8, 8))
        assert gate.entered.wait(WAIT_S)                    # the only worker is held
        queued = pool.submit(torch.zeros(1, 1, 8, 8))
        client.run(served.close())                          # returns although the model hangs
        with pytest.raises(InferenceClosedError, match="ran out of time"):
            queued.result(WAIT_S)
        gate.open()
        assert held.result(WAIT_S).shape == (1, 10)


class ExitsOnNegative(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() < 0:
            raise SystemExit("the model ended its thread")
        return super().forward(x)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_ready_is_400_once_the_pools_last_worker_died() -> None:
    app = create_app(ExitsOnNegative(4, 2), name="m", workers=1)
    client = Client(app)
    try:
        assert client.get("/v2/health/ready").status_code == 200
        assert client.post("/v2/models/m/infer",
                           json=infer_json(-torch.ones(1, 4))).status_code == 500
        assert not app.state.served.pool._workers.join(WAIT_S)  # the only worker is gone
        assert client.get("/v2/health/ready").status_code == 400
        assert client.get("/v2/models/m/ready").status_code == 400
        assert client.post("/v2/repository/index").json()[0]["state"] == "UNAVAILABLE"
    finally:
        client.close()
        closing(app)


class _Difference(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x - y


def test_declared_inputs_named_after_forwards_parameters_go_by_name() -> None:
    app = create_app(_Difference(), name="diff", workers=1,
                     inputs=[TensorSpec("y", "FP32", (-1, 2)), TensorSpec("x", "FP32", (-1, 2))])
    client = Client(app)
    try:
        body = {"inputs": [
            {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [10, 20]},
            {"name": "y", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
        answer = client.post("/v2/models/diff/infer", json=body)
        assert answer.status_code == 200, answer.text
        assert outputs_of(answer).tolist() == [[9.0, 18.0]]  # x - y, not y - x
    finally:
        client.close()
        closing(app)
