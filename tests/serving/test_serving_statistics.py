"""Triton's statistics extension, read with tritonclient's own HTTP and gRPC clients
(``get_inference_statistics``, what perf_analyzer reads), on both gRPC back ends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import grpc
import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_helpers import WAIT_S, Client, closing, infer_json
from torch import nn
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

import paraloom
from paraloom.inference import ParallelInference
from paraloom.serving import ServerThread, TensorSpec, create_app, create_repository_app

_PHASES = ("queue", "compute_input", "compute_infer", "compute_output")


class _RefusesNegatives(nn.Module):
    """Linear(4, 2) that fails on a row whose first value is negative (a model error)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] < 0).any()):
            raise ValueError("a negative first value")
        out: torch.Tensor = self.linear(x)
        return out


@pytest.fixture(scope="module", params=["uvicorn", "grpcio"])
def server(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    app = create_app(_RefusesNegatives(), name="m", workers=1, batch_limit=16,
                     inputs=[TensorSpec("input", "FP32", (-1, 4))],
                     outputs=[TensorSpec("output", "FP32", (-1, 2))])
    with ServerThread(app, grpc_port=0, grpc_backend=str(request.param)) as s:
        yield s


def _clients(server: ServerThread) -> tuple[th.InferenceServerClient, tg.InferenceServerClient]:
    return (th.InferenceServerClient(server.url.removeprefix("http://")),
            tg.InferenceServerClient(server.grpc_url))


def _infer(http: th.InferenceServerClient, x: np.ndarray) -> None:
    item = th.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    http.infer("m", [item])


def _as_ints(stats: dict[str, Any]) -> dict[str, Any]:
    """gRPC's JSON (protobuf's mapping writes uint64 as strings, leaves zeros out) in HTTP's
    form: ints, and the zero durations back."""
    def fix(value: Any) -> Any:
        if isinstance(value, dict):
            fixed = {k: v if k == "version" else fix(v) for k, v in value.items()}
            if set(fixed) <= {"count", "ns"}:
                return {"count": fixed.get("count", 0), "ns": fixed.get("ns", 0)}
            return fixed
        if isinstance(value, list):
            return [fix(v) for v in value]
        return int(value) if isinstance(value, str) and value.isdigit() else value
    return fix(stats)  # type: ignore[no-any-return]


def test_statistics_count_every_request_and_both_transports_agree(server: ServerThread) -> None:
    http, grpc_client = _clients(server)
    before = http.get_inference_statistics("m")["model_stats"][0]
    rng = np.random.default_rng(0)
    for rows in (1, 2, 3):
        _infer(http, rng.random((rows, 4), dtype=np.float32))
    with pytest.raises(InferenceServerException, match="negative first value"):
        _infer(http, np.full((1, 4), -1.0, dtype=np.float32))
    with pytest.raises(InferenceServerException, match="shape"):
        _infer(http, np.ones((1, 5), dtype=np.float32))
    after = http.get_inference_statistics("m")["model_stats"][0]
    assert after == _as_ints(grpc_client.get_inference_statistics("m", as_json=True)
                             )["model_stats"][0] | {"memory_usage": [], "response_stats": {}}
    assert (after["name"], after["version"]) == ("m", "1")
    done = {k: after[k] - before[k] for k in ("inference_count", "execution_count")}
    assert done == {"inference_count": 6, "execution_count": 3}
    stats, was = after["inference_stats"], before["inference_stats"]
    assert stats["success"]["count"] - was["success"]["count"] == 3
    assert stats["fail"]["count"] - was["fail"]["count"] == 2  # the model's error, the shape
    assert stats["fail"]["ns"] > was["fail"]["ns"]
    for phase in _PHASES:  # the three answered requests (the failed batch is not counted)
        assert stats[phase]["count"] - was[phase]["count"] == 3
    # A request's time in the server holds its queue and compute time.
    assert stats["success"]["ns"] >= sum(stats[p]["ns"] for p in _PHASES) > 0
    assert stats["cache_hit"] == stats["cache_miss"] == {"count": 0, "ns": 0}
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
    assert sum(sizes.values()) == after["execution_count"]
    assert sum(n * c for n, c in sizes.items()) == after["inference_count"]


def test_statistics_of_every_model_of_a_version_and_unknown_ones(server: ServerThread) -> None:
    http, grpc_client = _clients(server)
    assert [s["name"] for s in http.get_inference_statistics()["model_stats"]] == ["m"]
    assert http.get_inference_statistics("m", "1")["model_stats"][0]["version"] == "1"
    assert "statistics" in http.get_server_metadata()["extensions"]
    for call in (lambda: http.get_inference_statistics("nope"),
                 lambda: http.get_inference_statistics("m", "7"),
                 lambda: grpc_client.get_inference_statistics("nope"),
                 lambda: grpc_client.get_inference_statistics("m", "7")):
        with pytest.raises(InferenceServerException) as refused:
            call()
        assert refused.value.status() in ("404", "StatusCode.NOT_FOUND")
        assert "nope" in str(refused.value) or "version '7'" in str(refused.value)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.one_of(st.just("m"), st.text(max_size=12)),
       version=st.one_of(st.just(""), st.just("1"), st.text(max_size=4)))
def test_fuzzed_statistics_requests_are_answered_or_not_found(
        server: ServerThread, name: str, version: str) -> None:
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            answer = stub.ModelStatistics(pb.ModelStatisticsRequest(name=name, version=version),
                                          timeout=WAIT_S)
            assert [s.name for s in answer.model_stats] == ["m"]
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.NOT_FOUND, error.details()
    path = "/v2/models" + (f"/{quote(name, safe='')}" if name else "") + (
        f"/versions/{quote(version, safe='')}" if name and version else "") + "/stats"
    response = httpx.get(server.url + path, timeout=WAIT_S)
    assert response.status_code in (200, 404), response.text
    assert response.status_code == 404 or response.json()["model_stats"][0]["name"] == "m"


def test_a_new_version_of_a_single_model_counts_from_zero() -> None:
    model = nn.Linear(4, 2)
    pool = ParallelInference(model, workers=1)
    app = create_app(pool, model=model, name="m")
    client = Client(app)
    try:
        for _ in range(2):
            assert client.post("/v2/models/m/infer",
                               json=infer_json(torch.ones(3, 4))).status_code == 200
        one = client.get("/v2/models/m/stats").json()["model_stats"]
        assert [(s["version"], s["inference_count"]) for s in one] == [("1", 6)]
        pool.update_model(nn.Linear(4, 2))
        assert client.post("/v2/models/m/infer",
                           json=infer_json(torch.ones(1, 4))).status_code == 200
        two = client.get("/v2/models/m/stats").json()["model_stats"][0]
        assert (two["version"], two["inference_count"], two["execution_count"]) == ("2", 1, 1)
        assert two["inference_stats"]["success"]["count"] == 1
        gone = client.get("/v2/models/m/versions/1/stats")
        assert gone.status_code == 404 and "version '1'" in gone.json()["error"]
    finally:
        client.close()
        pool.close()


def test_every_served_version_of_a_repository_has_its_own_statistics(tmp_path: Path) -> None:
    for version in (1, 2):
        (tmp_path / "m" / str(version)).mkdir(parents=True)
        paraloom.save(nn.Linear(4, 2), tmp_path / "m" / str(version) / "model.safetensors",
                      kwargs={"in_features": 4, "out_features": 2})
    (tmp_path / "m" / "config.json").write_text('{"version_policy": {"all": {}}}')
    app = create_repository_app(tmp_path)
    client = Client(app)
    try:
        for version, rows in (("1", 2), ("2", 5), ("2", 1)):
            answer = client.post(f"/v2/models/m/versions/{version}/infer",
                                 json=infer_json(torch.ones(rows, 4)))
            assert answer.status_code == 200, answer.text
        every = client.get("/v2/models/m/stats").json()["model_stats"]
        assert [(s["version"], s["inference_count"], s["inference_stats"]["success"]["count"])
                for s in every] == [("1", 2, 1), ("2", 6, 2)]
        assert client.get("/v2/models/stats").json()["model_stats"] == every
    finally:
        client.close()
        closing(app)


def test_a_model_called_stats_keeps_its_metadata() -> None:
    app = create_app(nn.Linear(4, 2), name="stats", workers=1)
    client = Client(app)
    try:
        assert client.get("/v2/models/stats").json()["name"] == "stats"  # its metadata
        mine = client.get("/v2/models/stats/stats").json()["model_stats"]
        assert [s["name"] for s in mine] == ["stats"]
    finally:
        client.close()
        closing(app)
