"""The v2 gRPC endpoint with the real clients: tritonclient.grpc and the raw protocol stub,
against the same server (and pool) that tritonclient.http talks to."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_helpers import WAIT_S, Gate, GatedLeNet
from torch import nn
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from paraloom.models import LeNet
from paraloom.serving import ServerThread, TensorSpec, create_app


def _expected(model: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


@pytest.fixture(scope="module")
def lenet_model() -> nn.Module:
    torch.manual_seed(0)
    return LeNet(image_size=8).eval()


@pytest.fixture(scope="module", params=["uvicorn", "grpcio"])
def backend(request: pytest.FixtureRequest) -> str:
    """Every test runs on both gRPC servers: uvicorn's HTTP/2 and grpcio's grpc.aio."""
    return str(request.param)


@pytest.fixture(scope="module")
def server(lenet_model: nn.Module, backend: str) -> Iterator[ServerThread]:
    app = create_app(lenet_model, name="lenet", workers=2, batch_limit=16, queue_limit=256,
                     max_body_bytes=1 << 20)
    with ServerThread(app, grpc_port=0, grpc_backend=backend) as s:
        yield s


@pytest.fixture(scope="module")
def grpc_client(server: ServerThread) -> Iterator[tg.InferenceServerClient]:
    client = tg.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    """The protocol's own stub (as KServe's clients use it): typed contents, odd requests."""
    channel = grpc.insecure_channel(server.grpc_url)
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def _input(x: np.ndarray, name: str = "input", datatype: str = "FP32") -> tg.InferInput:
    item = tg.InferInput(name, list(x.shape), datatype)
    item.set_data_from_numpy(x)
    return item


def test_health_and_metadata_match_http(server: ServerThread,
                                        grpc_client: tg.InferenceServerClient) -> None:
    http = th.InferenceServerClient(f"{server.host}:{server.port}")
    assert grpc_client.is_server_live() and grpc_client.is_server_ready()
    assert grpc_client.is_model_ready("lenet")
    meta = grpc_client.get_server_metadata(as_json=True)
    assert meta["name"] == "paraloom"
    assert meta["extensions"] == http.get_server_metadata()["extensions"]
    model = grpc_client.get_model_metadata("lenet", as_json=True)
    want = http.get_model_metadata("lenet")
    assert model["name"] == want["name"] == "lenet"
    assert model["versions"] == want["versions"] == ["1"]
    for key in ("inputs", "outputs"):  # protobuf's JSON writes int64 shapes as strings
        got = [{**t, "shape": [int(d) for d in t["shape"]]} for t in model[key]]
        assert got == want[key]
    assert want["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]


def test_tritons_trace_extension_is_not_served_and_says_so(
        server: ServerThread, grpc_client: tg.InferenceServerClient) -> None:
    http = th.InferenceServerClient(f"{server.host}:{server.port}")
    calls = [(http.get_trace_settings, "trace extension"),
             (grpc_client.get_trace_settings, "trace extension")]
    for call, hint in calls:
        with pytest.raises(InferenceServerException, match="is not served here") as refused:
            call()
        assert hint in str(refused.value)
        assert refused.value.status() in ("404", "StatusCode.UNIMPLEMENTED")
    assert grpc_client.is_server_ready()


def test_model_ready_of_an_unknown_model_or_version_is_false_not_an_error(
        grpc_client: tg.InferenceServerClient,
        stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    assert grpc_client.is_model_ready("lenet", "1")
    assert not grpc_client.is_model_ready("nope")  # tritonclient raised NOT_FOUND here
    assert not grpc_client.is_model_ready("lenet", "9")
    assert stub.ModelReady(pb.ModelReadyRequest(name="nope"), timeout=WAIT_S).ready is False


def test_infer_with_raw_contents_matches_the_model_and_http(
        server: ServerThread, grpc_client: tg.InferenceServerClient,
        lenet_model: nn.Module) -> None:
    x = np.random.default_rng(1).random((5, 1, 8, 8), dtype=np.float32)
    result = grpc_client.infer("lenet", [_input(x)], request_id="r-7")
    out = result.as_numpy("output")
    np.testing.assert_allclose(out, _expected(lenet_model, x), rtol=1e-5, atol=1e-6)
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == ("lenet", "1", "r-7")
    http = th.InferenceServerClient(f"{server.host}:{server.port}")
    item = th.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    np.testing.assert_array_equal(http.infer("lenet", [item]).as_numpy("output"), out)


def test_typed_inputs_get_typed_outputs_raw_inputs_raw_unless_asked(
        stub: service_pb2_grpc.GRPCInferenceServiceStub, lenet_model: nn.Module) -> None:
    x = np.random.default_rng(2).random((2, 1, 8, 8), dtype=np.float32)
    want = _expected(lenet_model, x)
    request = pb.ModelInferRequest(model_name="lenet", model_version="1")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    request.outputs.add(name="output")
    response = stub.ModelInfer(request, timeout=WAIT_S)
    (out,) = response.outputs
    assert (out.name, out.datatype, list(out.shape)) == ("output", "FP32", [2, 10])
    assert not response.raw_output_contents  # typed in, typed out
    got = np.array(out.contents.fp32_contents, dtype=np.float32).reshape(2, 10)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    request.parameters["binary_data_output"].bool_param = True  # typed in, raw asked for
    response = stub.ModelInfer(request, timeout=WAIT_S)
    assert not response.outputs[0].contents.fp32_contents
    got = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(2, 10)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    raw = _request(list(x.shape), raw=x.tobytes())  # what tritonclient.grpc sends: raw back
    assert len(stub.ModelInfer(raw, timeout=WAIT_S).raw_output_contents) == 1
    raw.parameters["binary_data_output"].bool_param = False
    response = stub.ModelInfer(raw, timeout=WAIT_S)
    assert not response.raw_output_contents
    np.testing.assert_allclose(np.reshape(response.outputs[0].contents.fp32_contents, (2, 10)),
                               want, rtol=1e-5, atol=1e-6)
    raw.parameters["binary_data_output"].string_param = "yes"
    with pytest.raises(grpc.RpcError) as error:
        stub.ModelInfer(raw, timeout=WAIT_S)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "binary_data_output" in str(error.value.details())


def _request(shape: list[int], datatype: str = "FP32", raw: bytes | None = None,
             model: str = "lenet", **kwargs: object) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, **kwargs)
    request.inputs.add(name="input", datatype=datatype, shape=shape)
    if raw is not None:
        request.raw_input_contents.append(raw)
    return request


def _fp32(*shape: int) -> bytes:
    return np.zeros(shape, dtype=np.float32).tobytes()


def _typed_ints() -> pb.ModelInferRequest:
    request = _request([1, 1, 8, 8])
    request.inputs[0].contents.int_contents.extend([1] * 64)
    return request


def _two_raw() -> pb.ModelInferRequest:
    request = _request([1, 1, 8, 8], raw=_fp32(1, 1, 8, 8))
    request.raw_input_contents.append(b"")
    return request


def _unknown_output() -> pb.ModelInferRequest:
    request = _request([1, 1, 8, 8], raw=_fp32(1, 1, 8, 8))
    request.outputs.add(name="logits")
    return request


def _both_ways() -> pb.ModelInferRequest:
    request = _request([1, 1, 8, 8], raw=_fp32(1, 1, 8, 8))
    request.inputs[0].contents.fp32_contents.extend([0.0] * 64)
    return request


BAD = [
    (lambda: _request([1, 1, 8, 9], raw=_fp32(1, 1, 8, 9)), "INVALID_ARGUMENT",
     "expects [-1, 1, 8, 8]"),
    (lambda: _request([1, 1, 8, 8], "FP64", raw=bytes(512)), "INVALID_ARGUMENT",
     "expects FP32"),
    (lambda: _request([1, 1, 8, 8], "FP33", raw=_fp32(1, 1, 8, 8)), "INVALID_ARGUMENT",
     "unknown datatype"),
    (lambda: _request([1], "BYTES", raw=b"\0\0\0\0"), "INVALID_ARGUMENT", "BYTES"),
    (lambda: _request([1, 1, 8, 8], raw=b"\0" * 10), "INVALID_ARGUMENT", "needs 256 bytes"),
    (lambda: _request([1, -1, 8, 8], raw=b""), "INVALID_ARGUMENT", "non-negative"),
    (lambda: _request([1, 1, 8, 8]), "INVALID_ARGUMENT", "has 0 data elements"),
    (_typed_ints, "INVALID_ARGUMENT", "int_contents"),
    (_two_raw, "INVALID_ARGUMENT", "2 raw_input_contents"),
    (_unknown_output, "INVALID_ARGUMENT", "outputs ['logits']"),
    (_both_ways, "INVALID_ARGUMENT", "send every input one way"),
    (lambda: _request([1, 1, 8, 8], "FP16", raw=None), "INVALID_ARGUMENT",
     "raw_input_contents"),
    (lambda: pb.ModelInferRequest(model_name="lenet"), "INVALID_ARGUMENT", "no inputs"),
    (lambda: _request([1, 1, 8, 8], raw=_fp32(1, 1, 8, 8), model="resnet"), "NOT_FOUND",
     "unknown model 'resnet'"),
    (lambda: _request([1, 1, 8, 8], raw=_fp32(1, 1, 8, 8), model_version="9"), "NOT_FOUND",
     "no version '9'"),
    (lambda: _request([1, 1, 1 << 20, 8], raw=None), "RESOURCE_EXHAUSTED", ""),
]


@pytest.mark.parametrize(("build", "code", "fragment"), BAD)
def test_bad_requests_get_a_client_error_code_never_internal(
        stub: service_pb2_grpc.GRPCInferenceServiceStub, build, code: str,
        fragment: str) -> None:
    request = build()
    if code == "RESOURCE_EXHAUSTED":  # over the 1 MiB limit: grpc refuses it before decoding
        request.inputs[0].contents.fp32_contents.extend([0.0] * (300 << 10))
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(request, timeout=WAIT_S)
    error = caught.value
    assert error.code().name == code, error.details()
    assert fragment in error.details()


def test_metrics_count_grpc_and_http_requests_together(
        server: ServerThread, grpc_client: tg.InferenceServerClient,
        stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    import urllib.request

    def scrape() -> str:
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=WAIT_S) as r:
            return r.read().decode()

    def value(text: str, line_start: str) -> float:
        lines = [ln for ln in text.splitlines() if ln.startswith(line_start)]
        return float(lines[0].split()[-1]) if lines else 0.0

    before = scrape()
    x = np.zeros((1, 1, 8, 8), dtype=np.float32)
    grpc_client.infer("lenet", [_input(x)])
    with pytest.raises(grpc.RpcError):
        stub.ModelInfer(_request([1, 1, 8, 9], raw=_fp32(1, 1, 8, 9)), timeout=WAIT_S)
    after = scrape()
    requests = 'paraloom_inference_requests_total{model="lenet"}'
    bad = 'paraloom_inference_failures_total{model="lenet",reason="bad_request"}'
    assert value(after, requests) - value(before, requests) == 2
    assert value(after, bad) - value(before, bad) == 1


def test_concurrent_grpc_and_http_requests_get_their_own_answers(
        server: ServerThread, lenet_model: nn.Module) -> None:
    rng = np.random.default_rng(3)
    xs = [rng.random((1 + i % 3, 1, 8, 8), dtype=np.float32) for i in range(96)]
    grpc_client = tg.InferenceServerClient(server.grpc_url)
    local = threading.local()

    def http() -> th.InferenceServerClient:
        if not hasattr(local, "client"):  # tritonclient.http clients are not thread-safe
            local.client = th.InferenceServerClient(f"{server.host}:{server.port}")
        return local.client

    def call(i: int) -> np.ndarray:
        x = xs[i]
        if i % 2:
            return grpc_client.infer("lenet", [_input(x)], request_id=str(i)).as_numpy("output")
        item = th.InferInput("input", list(x.shape), "FP32")
        item.set_data_from_numpy(x, binary_data=i % 4 == 0)
        return http().infer("lenet", [item]).as_numpy("output")

    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(call, range(len(xs))))
    grpc_client.close()
    for x, out in zip(xs, outs, strict=True):
        np.testing.assert_allclose(out, _expected(lenet_model, x), rtol=1e-5, atol=1e-6)


def test_a_full_queue_is_unavailable_over_grpc_and_503_over_http(backend: str) -> None:
    gate = Gate()
    app = create_app(GatedLeNet(gate), name="lenet", workers=1, batch_limit=1, queue_limit=1,
                     inputs=[TensorSpec("input", "FP32", (-1, 1, 8, 8))])
    x = np.zeros((1, 1, 8, 8), dtype=np.float32)
    with ServerThread(app, grpc_port=0, grpc_backend=backend) as server:
        client = tg.InferenceServerClient(server.grpc_url)
        http = th.InferenceServerClient(f"{server.host}:{server.port}")
        gate.close()
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(client.infer, "lenet", [_input(x)])
            assert gate.entered.wait(WAIT_S)  # one request holds the only worker
            queued = pool.submit(client.infer, "lenet", [_input(x)])
            waited = time.monotonic() + WAIT_S
            while app.state.served.pool.stats()["queued"] < 1:  # the second one is queued
                assert time.monotonic() < waited, "the second request never reached the queue"
                time.sleep(0.005)
            with pytest.raises(InferenceServerException) as caught:
                client.infer("lenet", [_input(x)])
            assert caught.value.status() == "StatusCode.UNAVAILABLE"
            assert "queue is full" in caught.value.message()
            item = th.InferInput("input", list(x.shape), "FP32")
            item.set_data_from_numpy(x)
            with pytest.raises(InferenceServerException) as by_http:
                http.infer("lenet", [item])
            assert by_http.value.status() == "503"
            gate.open()
            assert running.result(WAIT_S).as_numpy("output").shape == (1, 10)
            assert queued.result(WAIT_S).as_numpy("output").shape == (1, 10)
        client.close()


def test_grpc_is_off_unless_asked(lenet_model: nn.Module) -> None:
    with ServerThread(create_app(lenet_model, name="lenet", workers=1)) as server:
        with pytest.raises(RuntimeError, match="no gRPC endpoint"):
            _ = server.grpc_url


def test_the_messages_are_wire_compatible_with_tritonclient() -> None:
    from paraloom.serving.grpc.messages import SERVICE, message, method_types

    def fields(descriptor, prefix: str = "") -> dict[str, tuple[int, int, bool]]:
        out = {}
        for f in descriptor.fields:
            out[f"{prefix}{descriptor.name}.{f.name}"] = (f.number, f.type, f.is_repeated)
        for nested in descriptor.nested_types:
            out.update(fields(nested, f"{prefix}{descriptor.name}."))
        return out

    theirs = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert SERVICE == theirs.full_name
    for method in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata",
                   "ModelMetadata", "ModelInfer", "RepositoryIndex", "RepositoryModelLoad",
                   "RepositoryModelUnload", "ModelStreamInfer", "SystemSharedMemoryStatus",
                   "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
                   "CudaSharedMemoryStatus", "CudaSharedMemoryRegister",
                   "CudaSharedMemoryUnregister"):
        ours = method_types(method)
        for mine, other in zip(ours, (theirs.methods_by_name[method].input_type,
                                      theirs.methods_by_name[method].output_type), strict=True):
            assert mine.DESCRIPTOR.full_name == other.full_name
            assert fields(mine.DESCRIPTOR) == fields(other)
    for name in ("InferParameter", "InferTensorContents", "ModelRepositoryParameter"):
        assert fields(message(name).DESCRIPTOR) == fields(pb.DESCRIPTOR.message_types_by_name[name])


_DATATYPES = ["FP32", "FP64", "FP16", "BF16", "INT8", "INT32", "INT64", "UINT8", "UINT64",
              "BOOL", "BYTES", "fp32", ""]
_CONTENTS = ["bool_contents", "int_contents", "int64_contents", "uint_contents",
             "uint64_contents", "fp32_contents", "fp64_contents", "bytes_contents"]


def _fuzz_region(draw: st.DrawFn, parameters: object) -> None:
    """Shared memory parameters, right or wrong: the region is registered by ``stub``'s
    server only in the stream test; every other name is unknown."""
    for key in draw(st.lists(st.sampled_from(["shared_memory_region", "shared_memory_byte_size",
                                              "shared_memory_offset"]), max_size=3)):
        param = parameters[key]  # type: ignore[index]
        if key == "shared_memory_region":
            param.string_param = draw(st.sampled_from(["fuzz", "none", ""]))
        else:
            param.int64_param = draw(st.sampled_from([0, 4, 256, 1 << 40, -1]))


@st.composite
def _fuzzed_requests(draw: st.DrawFn) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=draw(st.sampled_from(["lenet", "lenet", "x", ""])),
                                   model_version=draw(st.sampled_from(["", "1", "2", "a"])))
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 2))):
        tensor = request.inputs.add(
            name=draw(st.sampled_from(["input", "input", "other", ""])),
            datatype=draw(st.sampled_from(_DATATYPES)),
            shape=draw(st.lists(st.sampled_from([-1, 0, 1, 2, 8, 1 << 40]), max_size=5)))
        if raw:
            request.raw_input_contents.append(draw(st.sampled_from(
                [b"", bytes(256), bytes(512), bytes(7)])))
        else:
            field = draw(st.sampled_from(_CONTENTS))
            values = {"bool_contents": [True, False], "bytes_contents": [b"ab"],
                      "fp32_contents": [0.5] * 64, "fp64_contents": [1e300] * 64}.get(
                field, [draw(st.sampled_from([0, 1, 127, 255, 70000]))] * 64)
            getattr(tensor.contents, field).extend(values)
        if draw(st.integers(0, 3)) == 0:
            _fuzz_region(draw, tensor.parameters)
    if draw(st.booleans()):
        output = request.outputs.add(name=draw(st.sampled_from(["output", "logits"])))
        if draw(st.booleans()):
            _fuzz_region(draw, output.parameters)
        if draw(st.integers(0, 3)) == 0:  # the classification extension, right or wrong
            classes = draw(st.sampled_from([-1, 0, 1, 3, 1 << 40, "3"]))
            param = output.parameters["classification"]
            if isinstance(classes, str):
                param.string_param = classes
            else:
                param.int64_param = classes
    if draw(st.booleans()) and request.raw_input_contents:
        request.raw_input_contents.append(b"\0")
    return request


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=_fuzzed_requests())
def test_fuzzed_requests_are_answered_or_refused_never_internal(
        stub: service_pb2_grpc.GRPCInferenceServiceStub, request: pb.ModelInferRequest) -> None:
    try:
        response = stub.ModelInfer(request, timeout=WAIT_S)
    except grpc.RpcError as error:
        assert error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                grpc.StatusCode.RESOURCE_EXHAUSTED), \
            (error.code(), error.details())
        assert error.details()
    else:
        assert response.model_name == "lenet" and len(response.outputs) == 1
        contents = response.outputs[0].contents
        typed = contents.fp32_contents or contents.bytes_contents  # bytes: classification
        assert len(response.raw_output_contents) + bool(typed) == 1  # raw or typed, not both


@pytest.fixture()
def fuzz_region(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> Iterator[None]:
    """A registered 512-byte region named "fuzz" (tritonclient's helpers make the segment)."""
    import tritonclient.utils.shared_memory as tshm

    key = f"/pl_fuzz_{id(stub)}"
    region = tshm.create_shared_memory_region("fuzz", key, 512)
    stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(
        name="fuzz", key=key, byte_size=512), timeout=WAIT_S)
    yield
    stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(), timeout=WAIT_S)
    tshm.destroy_shared_memory_region(region)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(_fuzzed_requests(), min_size=1, max_size=12))
def test_fuzzed_streams_answer_every_request_and_end_ok(
        stub: service_pb2_grpc.GRPCInferenceServiceStub, fuzz_region: None,
        requests: list[pb.ModelInferRequest]) -> None:
    for i, request in enumerate(requests):
        request.id = str(i)
    answers = list(stub.ModelStreamInfer(iter(requests), timeout=WAIT_S))
    assert sorted(int(a.infer_response.id) for a in answers) == list(range(len(requests)))
    for answer in answers:
        if answer.error_message:
            assert answer.error_message.startswith(f"request '{answer.infer_response.id}': ")
            assert "INTERNAL" not in answer.error_message, answer.error_message
        else:
            assert len(answer.infer_response.outputs) == 1


def test_unload_lets_the_request_in_flight_finish_on_the_model(backend: str) -> None:
    gate = Gate()
    model = GatedLeNet(gate)
    app = create_app(model, name="lenet", workers=1, batch_limit=4,
                     inputs=[TensorSpec("input", "FP32", (-1, 1, 8, 8))])
    x = np.random.default_rng(5).random((2, 1, 8, 8), dtype=np.float32)
    with ServerThread(app, grpc_port=0, grpc_backend=backend) as server:
        client = tg.InferenceServerClient(server.grpc_url)
        pool = app.state.served.pool
        gate.close()
        with ThreadPoolExecutor(2) as workers:
            running = workers.submit(client.infer, "lenet", [_input(x)])
            assert gate.entered.wait(WAIT_S)  # the request is in the model now
            unloading = workers.submit(client.unload_model, "lenet")
            waited = time.monotonic() + WAIT_S
            while server.app.state.repository.models():  # out of the lookup table at once
                assert time.monotonic() < waited
                time.sleep(0.005)
            with pytest.raises(InferenceServerException) as later:
                client.infer("lenet", [_input(x)])
            assert later.value.status() == "StatusCode.NOT_FOUND"
            assert not unloading.done()  # draining: the unload waits for the request in flight
            gate.open()
            out = running.result(WAIT_S).as_numpy("output")
            unloading.result(WAIT_S)
        np.testing.assert_allclose(out, _expected(model.net.eval(), x), rtol=1e-5, atol=1e-6)
        assert pool.closed
        client.close()
