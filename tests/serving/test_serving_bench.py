"""The serving benchmark's parts (the benchmark itself is not part of the test suite)."""

from __future__ import annotations

import math
import os
import time

import torch

from paraloom.bench.load import Target, cpu_seconds, percentile, run_load
from paraloom.bench.serving_report import summarize
from paraloom.bench.serving_requests import grpc_request, v2_binary, v2_json
from paraloom.models import LeNet
from paraloom.serving import ServerThread, create_app
from paraloom.serving.grpc.messages import message

_INFER = "/inference.GRPCInferenceService/ModelInfer"


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == \
        (50.0, 99.0, 100.0)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_summary_takes_medians_over_rounds() -> None:
    def run(rps: float, p99: float) -> dict:
        return {"requests_per_s": rps, "p50_ms": 1.0, "p99_ms": p99, "server_cpu_per_s": 1.0,
                "client_cpu_per_s": 0.1, "errors": 1}
    rounds = [{"a @1": run(100, 9)}, {"a @1": run(400, 3)}, {"a @1": run(200, 5)}]
    assert summarize(rounds)["a @1"] == {
        "requests_per_s": 200, "p50_ms": 1.0, "p99_ms": 5, "server_cpu_per_s": 1.0,
        "server_cpu_ms_per_request": 5.0, "client_cpu_ms_per_request": 0.5,
        "range_requests_per_s": [100, 400], "errors": 3}


def test_cpu_seconds_of_this_process_group_grow_with_work() -> None:
    group = os.getpgid(0)
    before = cpu_seconds(group)
    start = time.process_time()
    while time.process_time() - start < 0.3:  # 0.3 s of this process's CPU, however busy
        pass
    assert cpu_seconds(group) - before >= 0.25


def test_the_load_generator_gets_answers_over_http_and_grpc() -> None:
    torch.manual_seed(0)
    model = LeNet(image_size=8).eval()
    x = torch.rand(1, 1, 8, 8)
    with ServerThread(create_app(model, name="lenet", workers=1), grpc_port=0) as server:
        port = int(server.grpc_url.rsplit(":", 1)[1])
        binary, header = v2_binary(x)
        for target in (Target(server.host, server.port, v2_json(x),
                              path="/v2/models/lenet/infer"),
                       Target(server.host, server.port, binary, path="/v2/models/lenet/infer",
                              headers=(("Content-Type", "application/octet-stream"),
                                       ("Inference-Header-Content-Length", str(header)))),
                       Target(server.host, port, grpc_request(x), method=_INFER),
                       Target(server.host, port, grpc_request(x), method=_INFER, grpcio=True)):
            result = run_load(target, concurrency=3, duration=0.5, warmup=0.1, processes=2)
            assert result["errors"] == 0 and result["requests"] > 0
            assert 0 < result["p50_ms"] <= result["p99_ms"]
        bad = Target(server.host, server.port, b"{", path="/v2/models/lenet/infer")
        result = run_load(bad, concurrency=1, duration=0.3, warmup=0.0, processes=1)
        assert result["requests"] == 0 and result["errors"] > 0
        assert result["error_kinds"] == ["HTTP 400"]



def test_the_h2c_caller_counts_grpc_errors_and_large_messages() -> None:
    torch.manual_seed(0)
    with ServerThread(create_app(LeNet(image_size=8).eval(), name="lenet", workers=1),
                      grpc_port=0) as server:
        port = int(server.grpc_url.rsplit(":", 1)[1])
        unknown = message("ModelInferRequest")(model_name="nope")
        unknown.inputs.add(name="input", datatype="FP32", shape=[1, 1, 8, 8])
        unknown.raw_input_contents.append(bytes(256))
        result = run_load(Target(server.host, port, unknown.SerializeToString(), method=_INFER),
                          concurrency=2, duration=0.3, warmup=0.0, processes=1)
        assert result["requests"] == 0 and result["error_kinds"] == ["gRPC error status"]
        # 25.6 KB: two DATA frames per call, and the server's 64 KB window is spent every
        # third call, so calls go on only if its WINDOW_UPDATEs are read
        big = grpc_request(torch.rand(100, 1, 8, 8))
        result = run_load(Target(server.host, port, big, method=_INFER), concurrency=2,
                          duration=0.5, warmup=0.0, processes=1)
        assert result["errors"] == 0 and result["requests"] > 0


def test_the_feature_rows_check_every_answer_and_compare_like_with_like() -> None:
    import asyncio

    from paraloom.bench.serving_features import _check, _ratios, _stream, _unary

    torch.manual_seed(0)
    model = LeNet(image_size=8).eval()
    xs = torch.rand(8, 1, 1, 8, 8)
    with torch.no_grad():
        expected = torch.stack([model(x)[0] for x in xs])
    bodies = [grpc_request(xs[i % 8], request_id=str(i)) for i in range(60)]
    app = create_app(model, name="lenet", workers=2)
    with ServerThread(app, grpc_port=0, grpc_backend="grpcio") as server:
        port = int(server.grpc_url.rsplit(":", 1)[1])
        _, streamed = asyncio.run(_stream(port, bodies))
        _, unary = asyncio.run(_unary(port, bodies, concurrency=8))
    assert len(streamed) == len(unary) == 60
    assert _check(streamed, 60, expected, streamed=True)
    assert _check(unary, 60, expected, streamed=False)
    assert not _check(streamed[:-1], 60, expected, streamed=True)  # an answer never came
    assert not _check(unary, 60, expected.flip(0), streamed=False)  # rows of other requests
    shm = {"http inline (binary) @1": 100.0, "http shared memory @1": 250.0,
           "grpc inline (raw) @1": 50.0, "grpc shared memory @1": 200.0}
    assert _ratios(shm, {"grpc unary": 100.0, "grpc stream": 95.0}, [1]) == {
        "http shared memory / inline @1": 2.5, "grpc shared memory / inline @1": 4.0,
        "grpc stream / unary": 0.95}
