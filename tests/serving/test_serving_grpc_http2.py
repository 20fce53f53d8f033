"""gRPC on uvicorn's HTTP/2: the ASGI app's framing and refusals, and connections closed after
``STREAMS_PER_CONNECTION`` calls with nothing lost (real clients and the benchmark's caller)."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import unquote

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
from serving_helpers import WAIT_S

pytest.importorskip("zttp", reason="uvicorn's HTTP/2 needs zttp (Python 3.11+)")

from paraloom.models import LeNet  # noqa: E402
from paraloom.serving import ServerThread, create_app  # noqa: E402
from paraloom.serving.errors import NotFoundError  # noqa: E402
from paraloom.serving.grpc import http2  # noqa: E402
from paraloom.serving.grpc.asgi import GrpcAsgiApp, parse_timeout  # noqa: E402
from paraloom.serving.grpc.messages import SERVICE, message  # noqa: E402


class _Service:
    """Answers every method with an empty response; ModelInfer as told."""

    def __init__(self, sleep: float = 0.0, error: Exception | None = None) -> None:
        self.sleep, self.error = sleep, error

    def __getattr__(self, name: str) -> Any:
        async def call(request: Any, response: Any) -> Any:
            await asyncio.sleep(self.sleep)
            if self.error is not None:
                raise self.error
            return response()
        return call


def _frame(data: bytes, compressed: bool = False) -> bytes:
    return bytes([compressed]) + len(data).to_bytes(4, "big") + data


def _call(app: GrpcAsgiApp, body: bytes | list[bytes], *, method: str = "ModelInfer",
          headers: dict[bytes, bytes] | None = None, http_method: str = "POST"
          ) -> tuple[int, dict[bytes, bytes], bytes]:
    """Run one request through the app; its HTTP status, trailers and body."""
    chunks = body if isinstance(body, list) else [body]
    sent: list[dict[str, Any]] = []
    received = iter([{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                     for i, c in enumerate(chunks)])
    scope = {"type": "http", "method": http_method, "path": f"/{SERVICE}/{method}",
             "headers": [(b"content-type", b"application/grpc"), (b"te", b"trailers"),
                         *(headers or {}).items()]}

    async def receive() -> dict[str, Any]:
        return next(received)

    async def send(event: dict[str, Any]) -> None:
        sent.append(event)

    asyncio.run(app(scope, receive, send))
    trailers = dict(next((e["headers"] for e in sent if e["type"] == "http.response.trailers"),
                         []))
    return (sent[0]["status"], trailers,
            b"".join(e.get("body", b"") for e in sent if e["type"] == "http.response.body"))


def _status(trailers: dict[bytes, bytes]) -> tuple[int, str]:
    return int(trailers[b"grpc-status"]), unquote(trailers.get(b"grpc-message", b"").decode())


REQUEST = message("ModelInferRequest")(model_name="lenet").SerializeToString()


def test_a_call_gets_its_answer_framed_and_status_ok() -> None:
    status, trailers, body = _call(GrpcAsgiApp(_Service(), 1 << 20), _frame(REQUEST))
    assert status == 200 and _status(trailers) == (0, "")
    assert body[0] == 0 and int.from_bytes(body[1:5], "big") == len(body) - 5


@pytest.mark.parametrize(("body", "headers", "method", "code", "fragment"), [
    (_frame(REQUEST), {}, "Nope", 12, "unknown method"),
    (b"\x00\x00", {}, "ModelInfer", 3, "no message"),
    (_frame(REQUEST)[:-1], {}, "ModelInfer", 3, "announced"),
    (_frame(REQUEST) + b"\x00", {}, "ModelInfer", 3, "exactly one message"),
    (_frame(b"\xff\xff\xff"), {}, "ModelInfer", 3, "bad request"),
    (_frame(gzip.compress(REQUEST), True), {b"grpc-encoding": b"snappy"}, "ModelInfer", 12,
     "'snappy'"),
    (_frame(b"not gzip", True), {b"grpc-encoding": b"gzip"}, "ModelInfer", 3,
     "does not decompress"),
    (_frame(gzip.compress(bytes(2 << 20)), True), {b"grpc-encoding": b"gzip"}, "ModelInfer",
     8, "decompresses to over"),
    (_frame(gzip.compress(REQUEST, mtime=0)[:-8], True), {b"grpc-encoding": b"gzip"},
     "ModelInfer", 3, "cut short"),
    (_frame(REQUEST), {b"grpc-timeout": b"5 seconds"}, "ModelInfer", 3, "grpc-timeout"),
])
def test_bad_calls_get_a_client_error_status(body: bytes, headers: dict[bytes, bytes],
                                             method: str, code: int, fragment: str) -> None:
    status, trailers, answer = _call(GrpcAsgiApp(_Service(), 1 << 20), body, method=method,
                                     headers=headers)
    got, text = _status(trailers)
    assert (status, got, answer) == (200, code, b""), text
    assert fragment in text


def test_compressed_calls_are_answered() -> None:
    for encoding, data in ((b"gzip", gzip.compress(REQUEST)),
                           (b"deflate", __import__("zlib").compress(REQUEST))):
        _, trailers, body = _call(GrpcAsgiApp(_Service(), 1 << 20), _frame(data, True),
                                  headers={b"grpc-encoding": encoding})
        assert _status(trailers) == (0, "") and body


def test_a_body_over_the_limit_is_refused_before_it_is_all_read() -> None:
    reads: list[int] = []
    app = GrpcAsgiApp(_Service(), 1000)

    async def receive() -> dict[str, Any]:
        reads.append(1)
        return {"type": "http.request", "body": bytes(600), "more_body": True}  # endless

    sent: list[dict[str, Any]] = []

    async def send(event: dict[str, Any]) -> None:
        sent.append(event)

    scope = {"type": "http", "method": "POST", "path": f"/{SERVICE}/ModelInfer",
             "headers": [(b"content-type", b"application/grpc")]}
    asyncio.run(app(scope, receive, send))
    code, text = _status(dict(sent[-1]["headers"]))
    assert code == 8 and "over 1000 bytes" in text
    assert len(reads) == 2  # 1,200 bytes read: refused there, the rest never read


def test_the_deadline_of_grpc_timeout_ends_the_call() -> None:
    _, trailers, _ = _call(GrpcAsgiApp(_Service(sleep=5.0), 1 << 20), _frame(REQUEST),
                           headers={b"grpc-timeout": b"50m"})
    assert _status(trailers)[0] == 4  # DEADLINE_EXCEEDED, after 50 ms and not 5 s
    assert parse_timeout(b"2S") == 2.0 and parse_timeout(b"250m") == 0.25
    assert parse_timeout(b"1H") == 3600.0 and parse_timeout(b"7n") == pytest.approx(7e-9)
    for bad in (b"", b"5", b"S", b"123456789S", b"1.5S", b"5s"):
        with pytest.raises(ValueError, match="grpc-timeout"):
            parse_timeout(bad)


def test_serving_errors_keep_their_code_and_percent_encoded_message() -> None:
    service = _Service(error=NotFoundError("no model 'ü' (100%)"))
    _, trailers, _ = _call(GrpcAsgiApp(service, 1 << 20), _frame(REQUEST))
    assert trailers[b"grpc-message"].isascii()
    assert _status(trailers) == (5, "no model 'ü' (100%)")


def test_what_is_not_grpc_gets_415() -> None:
    status, _, body = _call(GrpcAsgiApp(_Service(), 1 << 20), b"", http_method="GET")
    assert status == 415 and b"gRPC" in body


@pytest.fixture
def small_connections(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Connections closed after 25 calls; yields the list of connections made."""
    made: list[int] = []
    original = http2._Protocol.connection_made

    def counted(self: Any, transport: Any) -> None:
        made.append(1)
        original(self, transport)

    monkeypatch.setattr(http2, "STREAMS_PER_CONNECTION", 25)
    monkeypatch.setattr(http2._Protocol, "connection_made", counted)
    yield made


def test_concurrent_calls_go_on_over_new_connections_with_nothing_lost(
        small_connections: list[int]) -> None:
    torch.manual_seed(0)
    model = LeNet(image_size=8).eval()
    app = create_app(model, name="lenet", workers=2, batch_limit=8)
    rng = np.random.default_rng(1)
    xs = [rng.random((1, 1, 8, 8), dtype=np.float32) for _ in range(400)]
    with ServerThread(app, grpc_port=0, grpc_backend="uvicorn") as server:
        client = tg.InferenceServerClient(server.grpc_url)

        def call(x: np.ndarray) -> np.ndarray:
            item = tg.InferInput("input", list(x.shape), "FP32")
            item.set_data_from_numpy(x)
            return client.infer("lenet", [item], client_timeout=WAIT_S).as_numpy("output")

        with ThreadPoolExecutor(16) as pool:
            outs = list(pool.map(call, xs))
        client.close()
    with torch.no_grad():
        expected = [model(torch.from_numpy(x)).numpy() for x in xs]
    for out, want in zip(outs, expected, strict=True):
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert len(small_connections) >= 400 // 25  # the GOAWAYs really closed connections


@pytest.mark.timeout(120)
def test_the_benchmark_caller_goes_on_over_new_connections(small_connections: list[int]) -> None:
    from paraloom.bench.load import Target, run_load
    from paraloom.bench.serving_requests import GRPC_INFER, grpc_request

    app = create_app(LeNet(image_size=28).eval(), name="lenet", workers=1)
    with ServerThread(app, grpc_port=0, grpc_backend="uvicorn") as server:
        port = int(server.grpc_url.rsplit(":", 1)[1])
        result = run_load(Target("127.0.0.1", port, grpc_request(torch.rand(1, 1, 28, 28)),
                                 method=GRPC_INFER), concurrency=2, duration=1.0,
                          warmup=0.2, processes=1)
    assert result["errors"] == 0, result["error_kinds"]
    assert result["requests"] > 3 * 25
    assert len(small_connections) >= result["requests"] // 25


def _infer_once(app: Any, name: str, x: np.ndarray) -> np.ndarray:
    """One tritonclient.grpc call to ``app`` served on uvicorn's HTTP/2; the output."""
    with ServerThread(app, grpc_port=0, grpc_backend="uvicorn") as server:
        client = tg.InferenceServerClient(server.grpc_url)
        item = tg.InferInput("input", list(x.shape), "FP32")
        item.set_data_from_numpy(x)
        out = client.infer(name, [item], client_timeout=WAIT_S).as_numpy("output")
        client.close()
    return np.asarray(out)


def test_a_message_many_flow_control_windows_long_is_answered() -> None:
    torch.manual_seed(0)
    model = LeNet(image_size=28).eval()
    app = create_app(model, name="lenet", workers=1, max_body_bytes=8 << 20)
    x = np.random.default_rng(2).random((1024, 1, 28, 28), dtype=np.float32)  # 3.2 MB
    out = _infer_once(app, "lenet", x)
    with torch.no_grad():
        np.testing.assert_allclose(out, model(torch.from_numpy(x)).numpy(), rtol=1e-4,
                                   atol=1e-5)


def test_an_answer_many_flow_control_windows_long_is_received() -> None:
    from torch import nn

    from paraloom.serving import TensorSpec

    app = create_app(nn.Flatten(), name="flat", workers=1, max_body_bytes=8 << 20,
                     inputs=[TensorSpec("input", "FP32", (-1, 1, 512, 512))])
    x = np.random.default_rng(3).random((2, 1, 512, 512), dtype=np.float32)  # 2 MB each way
    np.testing.assert_array_equal(_infer_once(app, "flat", x), x.reshape(2, -1))


def test_the_backend_is_resolved_or_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from paraloom.serving.server import resolve_grpc_backend

    assert resolve_grpc_backend("auto") == "uvicorn"  # zttp is installed here
    assert resolve_grpc_backend("grpcio") == "grpcio"
    with pytest.raises(ValueError, match="expected one of"):
        resolve_grpc_backend("h2")
    real_import = builtins.__import__

    def no_zttp(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "zttp":
            raise ImportError("No module named 'zttp'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_zttp)
    assert resolve_grpc_backend("auto") == "grpcio"
    with pytest.raises(ValueError, match="grpc_backend='grpcio'"):
        resolve_grpc_backend("uvicorn")
