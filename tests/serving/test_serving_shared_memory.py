"""System shared memory: the registry's checks, and tritonclient's own HTTP and gRPC clients
and shared memory helpers, unchanged, against a real server."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from multiprocessing import shared_memory

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
import tritonclient.utils.shared_memory as tshm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_helpers import Client, closing, expected
from starlette.applications import Starlette
from tritonclient.utils import InferenceServerException

from paraloom.models import LeNet
from paraloom.serving import ServerThread, create_app
from paraloom.serving.cli import shared_memory_on
from paraloom.serving.errors import NotFoundError, ProtocolError
from paraloom.serving.shared_memory import RegionRef, SharedMemoryRegistry


@pytest.fixture()
def segment() -> Iterator[shared_memory.SharedMemory]:
    seg = shared_memory.SharedMemory(create=True, size=256)
    yield seg
    seg.close()
    seg.unlink()


def test_registry_reads_and_writes_inside_a_region(segment: shared_memory.SharedMemory
                                                   ) -> None:
    regions = SharedMemoryRegistry()
    regions.register("r", "/" + segment.name, offset=64, byte_size=128)
    segment.buf[64 + 8:64 + 12] = b"abcd"
    assert bytes(regions.read(RegionRef("r", 4, offset=8), "input")) == b"abcd"
    regions.write(RegionRef("r", 16, offset=100), b"xyz", "output")
    assert bytes(segment.buf[164:167]) == b"xyz"
    assert regions.status() == [{"name": "r", "key": "/" + segment.name, "offset": 64,
                                 "byte_size": 128}]
    assert regions.status("r")[0]["byte_size"] == 128
    regions.unregister("r")
    regions.unregister("never-registered")  # as Triton: no error
    assert regions.status() == []
    regions.close()


def test_regions_of_one_segment_share_a_file_and_reads_are_copies(
        segment: shared_memory.SharedMemory) -> None:
    import os

    before = len(os.listdir("/proc/self/fd"))
    regions = SharedMemoryRegistry()
    regions.register("a", "/" + segment.name, 0, 16)
    regions.register("b", "/" + segment.name, 16, 16)
    assert len(os.listdir("/proc/self/fd")) == before + 1
    segment.buf[16:20] = b"\x01\x02\x03\x04"
    data = regions.read(RegionRef("b", 4), "input")
    segment.buf[16] = 9  # the request's tensor owns its bytes: the client may write again
    assert list(data) == [1, 2, 3, 4]
    regions.unregister("a")
    assert len(os.listdir("/proc/self/fd")) == before + 1  # "b" still uses the file
    regions.unregister("b")
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_shrunk_segment_is_refused_not_a_crash(segment: shared_memory.SharedMemory) -> None:
    import os

    regions = SharedMemoryRegistry()
    regions.register("r", "/" + segment.name, 0, 256)
    fd = os.open("/dev/shm/" + segment.name, os.O_RDWR)
    try:
        os.ftruncate(fd, 64)  # the client made its segment smaller: a mapped read = SIGBUS
        with pytest.raises(ProtocolError, match="made smaller"):
            regions.read(RegionRef("r", 8, offset=200), "input 'x'")
        with pytest.raises(ProtocolError, match="made smaller"):
            regions.write(RegionRef("r", 8, offset=200), b"12345678", "output 'y'")
        assert len(regions.read(RegionRef("r", 8), "input 'x'")) == 8
    finally:
        os.ftruncate(fd, 256)
        os.close(fd)
        regions.close()


@pytest.mark.parametrize("call, message", [
    (lambda r, k: r.register("r", k, 0, 257), "has 256 bytes"),
    (lambda r, k: r.register("r", "/no-such-segment-pl", 0, 8), "no shared memory segment"),
    (lambda r, k: r.register("r", "/../etc/passwd", 0, 8), "not a segment name"),
    (lambda r, k: r.register("r", "/a/b", 0, 8), "not a segment name"),
    (lambda r, k: r.register("r/x", k, 0, 8), "region name"),
    (lambda r, k: r.register("r\n", k, 0, 8), "without '/' or control characters"),
    (lambda r, k: r.register("r" * 201, k, 0, 8), "region name"),
    (lambda r, k: r.register("r", k, 0, 0), "byte_size > 0"),
    (lambda r, k: r.read(RegionRef("ok", 8, offset=60), "input 'x'"), "bytes 60..68"),
    (lambda r, k: r.read(RegionRef("ok", 65), "input 'x'"), "which has 64 bytes"),
    (lambda r, k: r.read(RegionRef("missing", 4), "input 'x'"), "not registered"),
    (lambda r, k: r.write(RegionRef("ok", 4), b"12345", "output 'y'"), "at least 5"),
    # a byte_size past the region, whatever is written (only the written bytes were checked)
    (lambda r, k: r.write(RegionRef("ok", 999), b"12", "output 'y'"), "which has 64 bytes"),
    (lambda r, k: r.register("ok", k, 0, 8), "already registered"),
])
def test_registry_refuses_what_it_cannot_serve(segment: shared_memory.SharedMemory,
                                               call: object, message: str) -> None:
    regions = SharedMemoryRegistry()
    key = "/" + segment.name
    regions.register("ok", key, 0, 64)
    with pytest.raises(ProtocolError, match=message):
        call(regions, key)  # type: ignore[operator]
    regions.close()


def test_a_symlink_in_dev_shm_is_not_followed(segment: shared_memory.SharedMemory) -> None:
    import os

    link = f"/dev/shm/pl_link_{os.getpid()}"
    os.symlink("/dev/shm/" + segment.name, link)  # even to a real segment: no symlinks
    try:
        with pytest.raises(ProtocolError, match="cannot open"):
            SharedMemoryRegistry().register("r", "/" + os.path.basename(link), 0, 8)
    finally:
        os.unlink(link)


def test_registry_bounds_the_regions_it_holds(segment: shared_memory.SharedMemory) -> None:
    regions = SharedMemoryRegistry(max_regions=2)
    for name in ("a", "b"):
        regions.register(name, "/" + segment.name, 0, 8)
    with pytest.raises(ProtocolError, match="limit"):
        regions.register("c", "/" + segment.name, 0, 8)
    with pytest.raises(NotFoundError):
        regions.status("c")
    regions.close()


def test_a_read_past_the_bound_is_refused_before_any_allocation() -> None:
    """A sparse 2 GiB segment cost its client nothing, and one 300-byte request made the server
    allocate (and read) all of it: 262 MiB of peak memory became 2,310."""
    import resource

    key = f"/paraloom-sparse-{os.getpid()}"
    fd = os.open("/dev/shm" + key, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 3 << 30)  # sparse: no page is written
        regions = SharedMemoryRegistry()
        regions.register("big", key, 0, 3 << 30)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with pytest.raises(ProtocolError, match="reads at most 1,073,741,824 per input"):
            regions.read(RegionRef("big", 2 << 30), "input 'x'")
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB
        small = SharedMemoryRegistry(max_read_bytes=64)
        small.register("big", key, 0, 3 << 30)
        assert len(small.read(RegionRef("big", 64), "input 'x'")) == 64
        with pytest.raises(ProtocolError, match="at most 64 per input"):
            small.read(RegionRef("big", 65), "input 'x'")
        regions.close()
        small.close()
    finally:
        os.close(fd)
        os.unlink("/dev/shm" + key)


@pytest.fixture()
def lenet() -> torch.nn.Module:
    torch.manual_seed(0)
    return LeNet(image_size=8).eval()


class _Regions:
    """An input and an output region made with tritonclient's own helpers."""

    def __init__(self, tag: str, in_bytes: int, out_bytes: int) -> None:
        self.input = tshm.create_shared_memory_region(f"in{tag}", f"/pl_in{tag}", in_bytes)
        self.output = tshm.create_shared_memory_region(f"out{tag}", f"/pl_out{tag}", out_bytes)
        self.keys = {f"in{tag}": (f"/pl_in{tag}", in_bytes),
                     f"out{tag}": (f"/pl_out{tag}", out_bytes)}

    def close(self) -> None:
        tshm.destroy_shared_memory_region(self.input)
        tshm.destroy_shared_memory_region(self.output)


@pytest.fixture()
def server(lenet: torch.nn.Module, request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    if request.param == "uvicorn":
        pytest.importorskip("zttp", reason="uvicorn's HTTP/2 needs zttp (Python 3.11+)")
    app = create_app(lenet, name="lenet", workers=2)
    with ServerThread(app, grpc_port=0, grpc_backend=request.param) as srv:
        yield srv


@pytest.mark.parametrize("server", ["grpcio", "uvicorn"], indirect=True)
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tritonclient_passes_inputs_and_outputs_in_shared_memory(
        server: ServerThread, lenet: torch.nn.Module, protocol: str) -> None:
    x = np.random.default_rng(1).random((5, 1, 8, 8), dtype=np.float32)
    want = expected(lenet, torch.from_numpy(x)).numpy()
    mod = th if protocol == "http" else tg
    client = (th.InferenceServerClient(server.url[len("http://"):]) if protocol == "http"
              else tg.InferenceServerClient(server.grpc_url))
    tag = protocol + server.grpc_url.rsplit(":", 1)[1]
    regions = _Regions(tag, x.nbytes, 1024)
    try:
        client.unregister_system_shared_memory()
        client.unregister_cuda_shared_memory()  # as Triton's examples do first
        tshm.set_shared_memory_region(regions.input, [x])
        for name, (key, size) in regions.keys.items():
            client.register_system_shared_memory(name, key, size)
        status = client.get_system_shared_memory_status()
        assert len(status if protocol == "http" else status.regions) == 2
        given = mod.InferInput("input", list(x.shape), "FP32")
        given.set_shared_memory(f"in{tag}", x.nbytes)
        out = mod.InferRequestedOutput("output")
        out.set_shared_memory(f"out{tag}", 1024)
        result = client.infer("lenet", [given], outputs=[out])
        meta = result.get_output("output")
        params = meta["parameters"] if protocol == "http" else {
            k: v.int64_param or v.string_param for k, v in meta.parameters.items()}
        assert params["shared_memory_region"] == f"out{tag}"
        assert params["shared_memory_byte_size"] == want.nbytes
        got = tshm.get_contents_as_numpy(regions.output, np.float32, list(want.shape))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        # An input from shared memory, the output in the response.
        given = mod.InferInput("input", list(x.shape), "FP32")
        given.set_shared_memory(f"in{tag}", x.nbytes)
        inline = client.infer("lenet", [given])
        np.testing.assert_allclose(inline.as_numpy("output"), want, rtol=1e-5, atol=1e-6)
        # A region too small for the output: that request fails, the server goes on.
        small = mod.InferRequestedOutput("output")
        small.set_shared_memory(f"out{tag}", 16)
        with pytest.raises(InferenceServerException, match="at least 200"):
            client.infer("lenet", [given], outputs=[small])
        past = mod.InferInput("input", list(x.shape), "FP32")
        past.set_shared_memory(f"in{tag}", x.nbytes, offset=64)
        with pytest.raises(InferenceServerException, match="which has 1280 bytes"):
            client.infer("lenet", [past])
        client.unregister_system_shared_memory(f"in{tag}")
        with pytest.raises(InferenceServerException, match="not registered"):
            client.infer("lenet", [given])
        # Any name, as in Triton (letters, digits and '_-.:' only, before).
        spaced = f"my régión {tag}"
        client.register_system_shared_memory(spaced, regions.keys[f"in{tag}"][0], x.nbytes)
        named = client.get_system_shared_memory_status(spaced)
        names = [r["name"] for r in named] if protocol == "http" else list(named.regions)
        assert names == [spaced]
        given.set_shared_memory(spaced, x.nbytes)
        np.testing.assert_allclose(client.infer("lenet", [given]).as_numpy("output"), want,
                                   rtol=1e-5, atol=1e-6)
        client.unregister_system_shared_memory(spaced)
        assert client.is_server_ready()
    finally:
        client.unregister_system_shared_memory()
        client.close()
        regions.close()


class _TwoInputs(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * 10 + b


@pytest.mark.parametrize("server_backend", ["grpcio", "uvicorn"])
def test_grpc_raw_contents_skip_the_inputs_in_shared_memory(server_backend: str) -> None:
    """tritonclient.grpc sends no raw entry for an input in shared memory: the raw entries
    belong to the other inputs, in order."""
    if server_backend == "uvicorn":
        pytest.importorskip("zttp")
    app = create_app(_TwoInputs(), name="two", sample=[torch.zeros(1, 3), torch.zeros(1, 3)])
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.full((2, 3), 0.5, dtype=np.float32)
    region = tshm.create_shared_memory_region("b", f"/pl_two_{server_backend}", b.nbytes)
    try:
        with ServerThread(app, grpc_port=0, grpc_backend=server_backend) as server:
            client = tg.InferenceServerClient(server.grpc_url)
            tshm.set_shared_memory_region(region, [b])
            client.register_system_shared_memory("b", f"/pl_two_{server_backend}", b.nbytes)
            first = tg.InferInput("input_0", [2, 3], "FP32")
            first.set_data_from_numpy(a)
            second = tg.InferInput("input_1", [2, 3], "FP32")
            second.set_shared_memory("b", b.nbytes)
            result = client.infer("two", [second, first])
            np.testing.assert_array_equal(result.as_numpy("output"), a * 10 + b)
            client.unregister_system_shared_memory()
            client.close()
    finally:
        tshm.destroy_shared_memory_region(region)


def test_shared_memory_off_refuses_registration_and_says_why(lenet: torch.nn.Module) -> None:
    app = create_app(lenet, name="lenet", workers=1, shared_memory=False)
    client = Client(app)
    try:
        assert "system_shared_memory" not in client.get("/v2").json()["extensions"]
        r = client.post("/v2/systemsharedmemory/region/r/register",
                        json={"key": "/x", "offset": 0, "byte_size": 8})
        assert r.status_code == 400 and "shared memory is off" in r.json()["error"]
        body = {"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32",
                            "parameters": {"shared_memory_region": "r",
                                           "shared_memory_byte_size": 256}}]}
        r = client.post("/v2/models/lenet/infer", json=body)
        assert r.status_code == 400 and "shared memory is off" in r.json()["error"]
    finally:
        client.close()
        closing(app)


@pytest.mark.parametrize("body, status, message", [
    ({"key": "/x"}, 400, "byte_size"),
    ({"key": 3, "byte_size": 8}, 400, "byte_size"),
    ([1, 2], 400, "register request body"),
    ({"key": "/no-such-segment-pl", "byte_size": 8}, 400, "no shared memory segment"),
])
def test_register_endpoint_refuses_bad_bodies(client: Client, body: object, status: int,
                                              message: str) -> None:
    r = client.post("/v2/systemsharedmemory/region/r/register", json=body)
    assert r.status_code == status and message in r.json()["error"]
    assert client.get("/v2/systemsharedmemory/status").json() == []
    r = client.get("/v2/systemsharedmemory/region/r/status")
    assert r.status_code == 404


def test_cuda_shared_memory_is_empty_and_refused(client: Client) -> None:
    assert client.get("/v2/cudasharedmemory/status").json() == []
    assert client.post("/v2/cudasharedmemory/unregister").status_code == 200
    r = client.post("/v2/cudasharedmemory/region/g/register", json={"raw_handle": {"b64": ""}})
    assert r.status_code == 400 and "CUDA shared memory is not served" in r.json()["error"]


@pytest.mark.parametrize("host, processes, choice, on", [
    ("127.0.0.1", 1, "auto", True), ("::1", 1, "auto", True), ("localhost", 1, "auto", True),
    ("0.0.0.0", 1, "auto", False), ("127.0.0.1", 2, "auto", False),
    ("0.0.0.0", 1, "on", True), ("127.0.0.1", 1, "off", False),
])
def test_cli_turns_shared_memory_on_for_local_servers(host: str, processes: int, choice: str,
                                                      on: bool) -> None:
    args = argparse.Namespace(host=host, processes=processes, shared_memory=choice)
    assert shared_memory_on(args) is on


def test_cli_refuses_shared_memory_across_processes() -> None:
    args = argparse.Namespace(host="127.0.0.1", processes=2, shared_memory="on")
    with pytest.raises(ValueError, match="--processes 1"):
        shared_memory_on(args)


_JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2, 1 << 41),
                         st.sampled_from(["ok", "", "/../x", "/pl_none", "r" * 300]),
                         st.lists(st.integers(0, 3), max_size=3))


@st.composite
def _fuzzed_bodies(draw: st.DrawFn) -> tuple[str, object]:
    """A register body or an inference request naming regions, right or wrong."""
    region = draw(st.sampled_from(["ok", "ok", "missing", "", "a/b"]))
    if draw(st.booleans()):
        body = draw(st.dictionaries(st.sampled_from(["key", "offset", "byte_size", "x"]),
                                    _JSON_VALUES, max_size=4))
        return f"/v2/systemsharedmemory/region/{region}/register", body
    params = draw(st.dictionaries(st.sampled_from(["shared_memory_region",
                                                   "shared_memory_byte_size",
                                                   "shared_memory_offset", "binary_data_size"]),
                                  _JSON_VALUES, max_size=4))
    entry = {"name": "input", "datatype": draw(st.sampled_from(["FP32", "BYTES", "INT8"])),
             "shape": draw(st.lists(st.sampled_from([1, 8, 0, 1 << 40]), min_size=4,
                                    max_size=4)), "parameters": params}
    if draw(st.booleans()):
        entry["data"] = draw(st.sampled_from([[0.5] * 64, ["text"], []]))
    outputs = [{"name": "output", "parameters": draw(st.dictionaries(
        st.sampled_from(["shared_memory_region", "shared_memory_byte_size"]), _JSON_VALUES,
        max_size=2))}]
    return "/v2/models/lenet/infer", {"inputs": [entry], "outputs": outputs}


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(call=_fuzzed_bodies())
def test_fuzzed_shared_memory_requests_are_answered_or_refused_never_internal(
        app: Starlette, client: Client, segment: shared_memory.SharedMemory,
        call: tuple[str, object]) -> None:
    url, body = call
    regions: SharedMemoryRegistry = app.state.regions
    regions.unregister()
    regions.register("ok", "/" + segment.name, 0, 256)
    r = client.post(url, json=body)
    assert r.status_code in (200, 400, 404, 413), (r.status_code, r.text)
    assert r.status_code == 200 or r.json()["error"]
    assert [s["name"] for s in regions.status()] in (["ok"], ["ok", region_of(url)])


def region_of(url: str) -> str:
    return url.split("/region/")[1].split("/")[0] if "/region/" in url else ""


def test_left_to_auto_shared_memory_is_off_where_other_hosts_reach_the_server(
        lenet: torch.nn.Module) -> None:
    from paraloom.serving.app import settle_shared_memory

    for host, processes, choice, on in [
            ("127.0.0.1", 1, None, True), ("0.0.0.0", 1, None, False),
            ("192.0.2.7", 1, None, False), ("127.0.0.1", 2, None, False),
            ("0.0.0.0", 1, True, True), ("127.0.0.1", 1, False, False)]:
        app = create_app(lenet, name="lenet", workers=1, shared_memory=choice)
        assert (app.state.regions is not None) is (choice is True)  # auto: off until served
        settle_shared_memory(app, host, processes)
        assert (app.state.regions is not None) is on, (host, processes, choice)
        closing(app)


def test_a_segment_created_again_under_its_key_is_another_file() -> None:
    first = shared_memory.SharedMemory(create=True, size=64)
    name = first.name
    first.buf[:4] = b"AAAA"
    regions = SharedMemoryRegistry()
    regions.register("a", "/" + name, 0, 64)
    first.close()
    first.unlink()
    second = shared_memory.SharedMemory(name=name, create=True, size=64)
    try:
        second.buf[:4] = b"BBBB"
        regions.register("b", "/" + name, 0, 64)
        assert bytes(regions.read(RegionRef("a", 4), "input")) == b"AAAA"  # the old file
        assert bytes(regions.read(RegionRef("b", 4), "input")) == b"BBBB"
    finally:
        regions.close()
        second.close()
        second.unlink()


def test_a_grpc_region_parameter_without_a_value_is_invalid_argument(
        lenet: torch.nn.Module) -> None:
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    app = create_app(lenet, name="lenet", workers=1)
    with ServerThread(app, grpc_port=0, grpc_backend="grpcio") as server, \
            grpc.insecure_channel(server.grpc_url) as channel:
        request = pb.ModelInferRequest(model_name="lenet")
        tensor = request.inputs.add(name="input", datatype="FP32", shape=[1, 1, 8, 8])
        tensor.parameters["shared_memory_region"]  # present, with no value set
        request.raw_input_contents.append(bytes(256))
        with pytest.raises(grpc.RpcError) as error:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "shared memory" in error.value.details()


def test_an_input_in_shared_memory_that_also_carries_data_is_refused(
        lenet: torch.nn.Module) -> None:
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    region = {"shared_memory_region": "r", "shared_memory_byte_size": 256}
    app = create_app(lenet, name="lenet", workers=1, shared_memory=True)
    with ServerThread(app, grpc_port=0, grpc_backend="grpcio") as server, \
            grpc.insecure_channel(server.grpc_url) as channel:
        for extra in ({"data": [0.0] * 64}, {"parameters": {**region, "binary_data_size": 256}}):
            given = {"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32",
                     "parameters": region, **extra}
            r = httpx.post(f"{server.url}/v2/models/lenet/infer", json={"inputs": [given]},
                           timeout=30)
            assert r.status_code == 400 and "send it one way" in r.json()["error"]
        request = pb.ModelInferRequest(model_name="lenet")
        tensor = request.inputs.add(name="input", datatype="FP32", shape=[1, 1, 8, 8])
        tensor.parameters["shared_memory_region"].string_param = "r"
        tensor.parameters["shared_memory_byte_size"].int64_param = 256
        tensor.contents.fp32_contents.extend([0.0] * 64)
        with pytest.raises(grpc.RpcError) as error:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "send it one way" in error.value.details()


def test_the_read_bound_counts_every_input_of_a_request(
        segment: shared_memory.SharedMemory) -> None:
    """The bound was per input: three inputs naming 1 GiB each made the server allocate 3 GiB
    for one 435-byte request."""
    import json

    from paraloom.serving.protocol import parse_infer_request

    regions = SharedMemoryRegistry(max_read_bytes=200)
    regions.register("r", "/" + segment.name, 0, 256)

    def body(count: int) -> bytes:
        return json.dumps({"inputs": [
            {"name": f"x{i}", "shape": [20], "datatype": "FP32",
             "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 80}}
            for i in range(count)]}).encode()

    assert len(parse_infer_request(body(2), regions=regions).inputs) == 2  # 160 of 200
    with pytest.raises(ProtocolError, match=r"input 'x2' names 80 bytes.*\(40 of 200 per"):
        parse_infer_request(body(3), regions=regions)
    regions.close()
