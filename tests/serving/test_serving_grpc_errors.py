"""gRPC status codes for what the client got wrong, on both back ends: a message that does not
parse (unary, and mid-stream after valid requests), a region registered twice, and clean-up
calls on a server with shared memory off."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
import tritonclient.utils.shared_memory as tshm
from serving_helpers import WAIT_S, expected
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from paraloom.models import LeNet
from paraloom.serving import ServerThread, create_app

_INFER = "/inference.GRPCInferenceService/ModelInfer"
_STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
_GARBAGE = b"\xff\xff\xff\xff"  # a field tag no varint ends: protobuf cannot parse it


@pytest.fixture(scope="module")
def lenet() -> torch.nn.Module:
    torch.manual_seed(0)
    return LeNet(image_size=8).eval()


@pytest.fixture(scope="module", params=["grpcio", "uvicorn"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "uvicorn":
        pytest.importorskip("zttp", reason="uvicorn's HTTP/2 needs zttp (Python 3.11+)")
    return str(request.param)


def _server(lenet: torch.nn.Module, backend: str, **options: object) -> ServerThread:
    app = create_app(lenet, name="lenet", workers=1, **options)  # type: ignore[arg-type]
    return ServerThread(app, grpc_port=0, grpc_backend=backend)


@pytest.fixture(scope="module")
def server(lenet: torch.nn.Module, backend: str) -> Iterator[ServerThread]:
    with _server(lenet, backend) as srv:
        yield srv


@pytest.fixture(scope="module")
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.grpc_url) as chan:
        yield chan


def _request(x: np.ndarray, request_id: str) -> bytes:
    request = pb.ModelInferRequest(model_name="lenet", id=request_id)
    given = request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    given.contents.fp32_contents.extend(x.ravel().tolist())
    return request.SerializeToString()


def test_a_unary_message_that_does_not_parse_is_invalid_argument(channel: grpc.Channel
                                                                 ) -> None:
    call = channel.unary_unary(_INFER)  # bytes in and out: no serializer to refuse it first
    with pytest.raises(grpc.RpcError) as caught:
        call(_GARBAGE, timeout=WAIT_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert "bad request" in caught.value.details()


def test_a_stream_answers_the_requests_before_a_corrupt_message_then_ends_invalid(
        channel: grpc.Channel, lenet: torch.nn.Module) -> None:
    xs = np.random.default_rng(3).random((20, 1, 1, 8, 8), dtype=np.float32)
    sent = [_request(x, str(i)) for i, x in enumerate(xs)] + [_GARBAGE]
    call = channel.stream_stream(_STREAM, response_deserializer=pb.ModelStreamInferResponse
                                 .FromString)
    answers = call(iter(sent), timeout=WAIT_S)
    got = []
    with pytest.raises(grpc.RpcError) as caught:
        for answer in answers:
            got.append(answer)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert sorted(int(a.infer_response.id) for a in got) == list(range(20))
    want = expected(lenet, torch.from_numpy(xs.reshape(20, 1, 8, 8))).numpy()
    for answer in got:
        assert not answer.error_message, answer.error_message
        i = int(answer.infer_response.id)
        out = np.array(answer.infer_response.outputs[0].contents.fp32_contents, np.float32)
        np.testing.assert_allclose(out, want[i], rtol=1e-5, atol=1e-6)


def test_a_region_registered_twice_is_already_exists(server: ServerThread) -> None:
    key = f"/pl_twice_{server.grpc_url.rsplit(':', 1)[1]}"
    region = tshm.create_shared_memory_region("twice", key, 64)
    client = tg.InferenceServerClient(server.grpc_url)
    try:
        client.register_system_shared_memory("twice", key, 64)
        with pytest.raises(InferenceServerException) as caught:
            client.register_system_shared_memory("twice", key, 64)
        assert caught.value.status() == "StatusCode.ALREADY_EXISTS"
        assert "already registered" in caught.value.message()
        assert [r.name for r in client.get_system_shared_memory_status().regions.values()] \
            == ["twice"]  # the first registration stands
    finally:
        client.unregister_system_shared_memory()
        client.close()
        tshm.destroy_shared_memory_region(region)


def test_unregistering_with_shared_memory_off_is_a_no_op_that_refuses_nothing(
        lenet: torch.nn.Module, backend: str) -> None:
    with _server(lenet, backend, shared_memory=False) as srv:
        grpc_client = tg.InferenceServerClient(srv.grpc_url)
        http_client = th.InferenceServerClient(srv.url.removeprefix("http://"))
        try:
            grpc_client.unregister_system_shared_memory()
            grpc_client.unregister_system_shared_memory("never")
            http_client.unregister_system_shared_memory()
            http_client.unregister_system_shared_memory("never")
            with pytest.raises(InferenceServerException, match="shared memory is off"):
                grpc_client.get_system_shared_memory_status()  # still refused, with why
            with pytest.raises(InferenceServerException, match="shared memory is off"):
                http_client.get_system_shared_memory_status()
        finally:
            grpc_client.close()
            http_client.close()


def test_a_huge_unknown_model_name_is_not_found_not_a_header_overflow(
        server: ServerThread) -> None:
    """The error echoed a 100,000-character name whole: the answer's header passed the client's
    8 KB limit, which raised RESOURCE_EXHAUSTED instead of NOT_FOUND."""
    client = tg.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.get_model_metadata("x" * 100_000)
        assert info.value.status() == "StatusCode.NOT_FOUND", info.value.message()
        assert "unknown model 'xxxx" in info.value.message()
        assert len(info.value.message()) < 500
    finally:
        client.close()


def test_a_servers_own_bug_is_internal_in_the_protocols_form_and_the_server_goes_on(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception no handler expected was HTTP's plain-text 500 (tritonclient could not parse
    it) and, on the uvicorn back end, an HTTP/2 500 that no gRPC client reads as a status."""
    repository = server.app.state.repository

    async def broken() -> list[object]:
        raise KeyError("BYTES")

    monkeypatch.setattr(repository, "index_off_loop", broken)
    http = th.InferenceServerClient(server.url.removeprefix("http://"))
    with pytest.raises(InferenceServerException, match="internal error: KeyError: 'BYTES'") as e:
        http.get_model_repository_index()
    assert e.value.status() == "500"
    client = tg.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="internal error: KeyError: 'BYTES'") as e:
        client.get_model_repository_index()
    assert e.value.status() == "StatusCode.INTERNAL"
    monkeypatch.undo()
    assert [r["name"] for r in http.get_model_repository_index()] == ["lenet"]
    assert client.is_server_ready()
