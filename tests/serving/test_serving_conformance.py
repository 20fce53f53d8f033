"""What a stock Triton client meets at the edges: a shutdown with calls in flight, outputs named
many times, the config's shape for one value per row, cancelled calls in the metrics, and a
stream on a small queue."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
from serving_helpers import WAIT_S, Gate, GatedLeNet
from torch import nn

from paraloom.serving import ServerThread, TensorSpec, create_app

_ROW = {"name": "input", "datatype": "FP32", "shape": [1, 1, 8, 8], "data": [0.0] * 64}


def _grpc_input() -> tg.InferInput:
    given = tg.InferInput("input", [1, 1, 8, 8], "FP32")
    given.set_data_from_numpy(np.zeros((1, 1, 8, 8), np.float32))
    return given


def _wait_for(check, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_shutdown_is_not_ready_and_refuses_new_work_on_http_while_grpc_calls_drain() -> None:
    """Ready said 200, and HTTP took new requests, until every gRPC call had finished; and
    the gRPC, HTTP and pool drains each took the whole graceful timeout, one after another."""
    gate = Gate()
    app = create_app(GatedLeNet(gate), name="lenet", workers=1,
                     inputs=[TensorSpec("input", "FP32", (-1, 1, 8, 8))])
    server = ServerThread(app, grpc_port=0, graceful_timeout=3.0).start()
    answered: list[object] = []
    try:
        gate.close()
        client = tg.InferenceServerClient(server.grpc_url)
        call = threading.Thread(target=lambda: answered.append(
            client.infer("lenet", [_grpc_input()]).as_numpy("output").shape))
        call.start()
        assert gate.entered.wait(WAIT_S)  # the call is in the model
        stopping = threading.Thread(target=server.stop)
        began = time.monotonic()
        stopping.start()
        _wait_for(server.stopping.is_set, "shutdown never began")
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as http:
            assert http.get("/v2/health/ready").status_code == 400
            refused = http.post("/v2/models/lenet/infer", json={"inputs": [_ROW]})
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]
        gate.open()
        call.join(WAIT_S)
        stopping.join(WAIT_S)
        assert answered == [(1, 10)]  # the call in flight was answered
        assert time.monotonic() - began < 3.0 + 2.0
    finally:
        gate.open()
        server.stop()


def test_a_request_naming_an_output_many_times_is_refused_at_once() -> None:
    """The duplicate check was quadratic: 30,000 names held the event loop for 7 s."""
    app = create_app(nn.Linear(4, 2), name="m", workers=1)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=WAIT_S) as http:
        body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4],
                            "data": [0.0] * 4}],
                "outputs": [{"name": "output"}] * 200_000}
        answer = http.post("/v2/models/m/infer", json=body)
        assert answer.status_code == 400
        assert "['output'] more than once" in answer.json()["error"]
        assert http.get("/v2/health/live").status_code == 200


def test_one_value_per_row_is_taken_in_the_shape_the_config_gives() -> None:
    """The config says dims [1] with reshape [] (Triton's form for a [-1] input): a client that
    sends [rows] + dims was refused."""

    class Double(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    app = create_app(Double(), name="m", inputs=[TensorSpec("x", "FP32", (-1,))],
                     outputs=[TensorSpec("y", "FP32", (-1,))], workers=1)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=WAIT_S) as http:
        config = http.get("/v2/models/m/config").json()
        assert config["input"][0]["dims"] == [1]
        for shape in ([3], [3, 1]):
            answer = http.post("/v2/models/m/infer", json={"inputs": [
                {"name": "x", "datatype": "FP32", "shape": shape, "data": [1.0, 2.0, 3.0]}]})
            assert answer.status_code == 200, answer.text
            assert answer.json()["outputs"][0]["data"] == [2.0, 4.0, 6.0]
        zero = http.post("/v2/models/m/infer", json={"inputs": [
            {"name": "x", "datatype": "FP32", "shape": [0, 1], "data": []}]})
        assert zero.status_code == 400


class _Slow(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(float(x[0, 0]))
        return super().forward(x)


def test_a_call_past_its_deadline_is_counted_as_a_failure() -> None:
    app = create_app(_Slow(4, 2), name="slow", workers=1, inference_mode="sequential")
    with ServerThread(app, grpc_port=0) as server:
        client = tg.InferenceServerClient(server.grpc_url)
        given = tg.InferInput("input", [1, 4], "FP32")
        given.set_data_from_numpy(np.array([[0.5, 0, 0, 0]], np.float32))
        with pytest.raises(Exception, match="DEADLINE_EXCEEDED"):
            client.infer("slow", [given], client_timeout=0.1)
        text = ""
        deadline = time.monotonic() + WAIT_S
        while 'reason="cancelled"} 1.0' not in text and time.monotonic() < deadline:
            time.sleep(0.05)
            text = httpx.get(server.url + "/metrics").text
        assert 'paraloom_inference_failures_total{model="slow",reason="cancelled"} 1.0' in text


def test_one_stream_never_fills_a_small_queue_by_itself() -> None:
    """128 requests in flight on a stream; create_app's queue holds 64."""
    app = create_app(nn.Linear(4, 2), name="m", workers=1)
    answers: list[object] = []
    with ServerThread(app, grpc_port=0) as server:
        client = tg.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: answers.append(error or result))
        given = tg.InferInput("input", [1, 4], "FP32")
        given.set_data_from_numpy(np.ones((1, 4), np.float32))
        for i in range(600):
            client.async_stream_infer("m", [given], request_id=str(i))
        client.stop_stream()
    assert len(answers) == 600
    failed = [a for a in answers if not isinstance(a, tg.InferResult)]
    assert failed == []


@pytest.mark.parametrize(("policy", "over_http", "over_grpc"), [
    (None, {"latest": {"num_versions": 1}}, {"latest": {"num_versions": 1}}),
    ({"all": {}}, {"all": {}}, {"all": {}}),
    # protobuf's JSON mapping writes int64 as strings
    ({"specific": {"versions": [1]}}, {"specific": {"versions": [1]}},
     {"specific": {"versions": ["1"]}}),
])
def test_the_config_gives_the_version_policy(tmp_path, policy, over_http, over_grpc) -> None:
    """Triton's config holds version_policy (tritonclient's get_model_config); ours had none."""
    import json

    import tritonclient.http as th

    import paraloom
    from paraloom.serving import create_repository_app

    for version in (1, 2):
        (tmp_path / "m" / str(version)).mkdir(parents=True)
        paraloom.save(nn.Linear(4, 2), tmp_path / "m" / str(version) / "model.safetensors",
                      kwargs={"in_features": 4, "out_features": 2})
    if policy is not None:
        (tmp_path / "m" / "config.json").write_text(json.dumps({"version_policy": policy}))
    with ServerThread(create_repository_app(tmp_path), grpc_port=0) as server:
        http = th.InferenceServerClient(server.url.removeprefix("http://"))
        assert tg.InferenceServerClient(server.grpc_url).get_model_config(
            "m", as_json=True)["config"]["version_policy"] == over_grpc
        assert http.get_model_config("m")["version_policy"] == over_http


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:close\\(\\).*still running a batch")
def test_requests_cut_off_by_the_graceful_timeout_get_the_protocols_unavailable() -> None:
    """uvicorn answered them a bare 500 text/plain, and gRPC UNKNOWN."""
    gate = Gate()
    app = create_app(GatedLeNet(gate), name="lenet", workers=1, batch_limit=1,
                     inputs=[TensorSpec("input", "FP32", (-1, 1, 8, 8))])
    server = ServerThread(app, grpc_port=0, graceful_timeout=1.0).start()
    seen: dict[str, object] = {}

    def over_http() -> None:
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as http:
            answer = http.post("/v2/models/lenet/infer", json={"inputs": [_ROW]})
            seen["http"] = (answer.status_code, answer.json()["error"])

    def over_grpc() -> None:
        try:
            tg.InferenceServerClient(server.grpc_url).infer("lenet", [_grpc_input()])
        except Exception as e:  # noqa: BLE001 - what the client raises is the answer
            seen["grpc"] = (e.status(), e.message())  # type: ignore[attr-defined]

    try:
        gate.close()
        calls = [threading.Thread(target=over_http), threading.Thread(target=over_grpc)]
        for call in calls:
            call.start()
        assert gate.entered.wait(WAIT_S)
        time.sleep(0.3)  # the second request is queued behind the one in the model
        server.stop()
        for call in calls:
            call.join(WAIT_S)
    finally:
        gate.open()
        server.stop()
    assert seen["http"][0] == 503 and "graceful timeout ran out" in seen["http"][1]
    assert seen["grpc"][0] == "StatusCode.UNAVAILABLE"
