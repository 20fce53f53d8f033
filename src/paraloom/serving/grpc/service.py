"""``inference.GRPCInferenceService``'s handlers (``Service``, which both gRPC servers call) and
the grpc.aio server, over the same model repository and metrics as HTTP.

The gRPC server runs on the HTTP server's event loop (it is started and stopped with it), so
both transports share the models, their pools, the batching and the metrics. Errors map to
gRPC status codes by their HTTP status: 400 INVALID_ARGUMENT (ALREADY_EXISTS for a name
taken), 403 PERMISSION_DENIED, 404 NOT_FOUND, 413 RESOURCE_EXHAUSTED, 503 UNAVAILABLE,
504 DEADLINE_EXCEEDED, and only a model that failed by itself 500 INTERNAL.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from grpc import aio

from paraloom.serving.errors import (
    AlreadyExistsError,
    NotFoundError,
    ProtocolError,
    ServingError,
)
from paraloom.serving.grpc.codec import (
    decode_infer_request,
    encode_infer_response,
    parameter_values,
)
from paraloom.serving.grpc.messages import (
    SERVICE,
    InferRequestMessage,
    LoadRequest,
    Message,
    ModelRef,
    NamedModel,
    ReadyFilter,
    RegionRequest,
    SettingsRequest,
    method_types,
)
from paraloom.serving.grpc.streaming import STREAM_IN_FLIGHT, answer_stream
from paraloom.serving.handling import describe_server, handle_infer
from paraloom.serving.log_settings import SERVER_LOG
from paraloom.serving.metrics import ServingMetrics
from paraloom.serving.model_config import model_config
from paraloom.serving.protocol import InferRequest
from paraloom.serving.repository.models import ModelRepository
from paraloom.serving.shared_memory import SharedMemoryRegistry, registry_or_refuse
from paraloom.serving.shared_memory_routes import CUDA_REFUSAL
from paraloom.serving.statistics import statistics
from paraloom.serving.unserved import UNSERVED_METHODS

__all__ = ["METHODS", "STREAMING", "GrpcEndpoint", "GrpcServer", "Handler", "Service",
           "status_code", "unknown_method"]

Handler = Callable[[Message, type[Message]], Awaitable[Message]]
"""One RPC of ``Service``: (the request message, the response class) -> the response."""

_log = logging.getLogger("paraloom.serving")
_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 403: grpc.StatusCode.PERMISSION_DENIED,
          404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
          503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


def status_code(error: ServingError) -> grpc.StatusCode:
    """The gRPC status code of a serving error (by its HTTP status; ALREADY_EXISTS for a
    name already taken, which HTTP answers 400 as Triton does)."""
    if isinstance(error, AlreadyExistsError):
        return grpc.StatusCode.ALREADY_EXISTS
    return _CODES.get(error.status, grpc.StatusCode.INTERNAL)


class Service:
    """The RPC handlers; each takes the decoded request message and returns the response."""

    def __init__(self, repository: ModelRepository, metrics: ServingMetrics,
                 regions: SharedMemoryRegistry | None = None) -> None:
        self.repository = repository
        self.metrics = metrics
        self.regions = regions

    async def ServerLive(self, request: Message, response: type[Message]  # noqa: N802
                         ) -> Message:
        return response(live=True)

    async def ServerReady(self, request: Message, response: type[Message]  # noqa: N802
                          ) -> Message:
        return response(ready=self.repository.ready)

    async def ModelReady(self, request: ModelRef, response: type[Message]  # noqa: N802
                         ) -> Message:
        try:
            ready = self.repository.is_ready(request.name, request.version or None)
        except NotFoundError:  # as Triton: a model or version it does not serve is not ready
            ready = False
        return response(ready=ready)

    async def ServerMetadata(self, request: Message, response: type[Message]  # noqa: N802
                             ) -> Message:
        return response(**describe_server(self.regions is not None))

    async def ModelMetadata(self, request: ModelRef, response: type[Message]  # noqa: N802
                            ) -> Message:
        meta = self.repository.get(request.name, request.version or None).metadata()
        return response(name=meta["name"], versions=meta["versions"],
                        platform=meta["platform"], inputs=meta["inputs"],
                        outputs=meta["outputs"])

    async def ModelConfig(self, request: ModelRef, response: type[Message]  # noqa: N802
                          ) -> Message:
        served = self.repository.get(request.name, request.version or None)
        return response(config=model_config(served))

    async def ModelStatistics(self, request: ModelRef, response: type[Message]  # noqa: N802
                              ) -> Message:
        found = statistics(self.repository, request.name or None, request.version or None)
        return json_format.ParseDict(found, response())

    async def ModelInfer(self, request: InferRequestMessage,  # noqa: N802
                         response: type[Message]) -> Message:
        async def decode() -> InferRequest:
            return decode_infer_request(request, self.regions)

        answer = await handle_infer(self.repository, self.metrics, request.model_name,
                                    request.model_version or None, decode, self.regions)
        return encode_infer_response(answer)

    def ModelStreamInfer(self, requests: AsyncIterator[InferRequestMessage],  # noqa: N802
                         response: type[Message]) -> AsyncIterator[Message]:
        """The answers to a stream of requests, as they are ready (``grpc.streaming``)."""
        unary = method_types("ModelInfer")[1]
        # Half the smallest pool queue at most: a lone stream never fills a queue by itself.
        queues = [pool.queue_limit for pool in self.repository.pools().values()]
        in_flight = min([STREAM_IN_FLIGHT, *(max(1, q // 2) for q in queues)])
        return answer_stream(lambda r: self.ModelInfer(r, unary), requests, in_flight)

    def _regions(self) -> SharedMemoryRegistry:
        return registry_or_refuse(self.regions)

    async def SystemSharedMemoryStatus(self, request: RegionRequest,  # noqa: N802
                                       response: type[Message]) -> Message:
        answer = response()
        for row in self._regions().status(request.name or None):
            answer.regions[row["name"]].CopyFrom(type(answer.regions[row["name"]])(**row))
        return answer

    async def SystemSharedMemoryRegister(self, request: RegionRequest,  # noqa: N802
                                         response: type[Message]) -> Message:
        self._regions().register(request.name, request.key, request.offset,
                                 request.byte_size)
        return response()

    async def SystemSharedMemoryUnregister(self, request: RegionRequest,  # noqa: N802
                                           response: type[Message]) -> Message:
        if self.regions is not None:  # with shared memory off there is nothing to forget
            self.regions.unregister(request.name or None)
        return response()

    async def CudaSharedMemoryStatus(self, request: RegionRequest,  # noqa: N802
                                     response: type[Message]) -> Message:
        if request.name:
            raise NotFoundError(f"no CUDA shared memory region {request.name!r}: "
                                f"{CUDA_REFUSAL}")
        return response()

    async def CudaSharedMemoryRegister(self, request: RegionRequest,  # noqa: N802
                                       response: type[Message]) -> Message:
        raise ProtocolError(CUDA_REFUSAL)

    async def CudaSharedMemoryUnregister(self, request: RegionRequest,  # noqa: N802
                                         response: type[Message]) -> Message:
        return response()

    async def RepositoryIndex(self, request: ReadyFilter,  # noqa: N802
                              response: type[Message]) -> Message:
        rows = await self.repository.index_off_loop()
        if request.ready:
            rows = [r for r in rows if r["state"] == "READY"]
        return response(models=rows)

    async def RepositoryModelLoad(self, request: LoadRequest,  # noqa: N802
                                  response: type[Message]) -> Message:
        await self.repository.load(request.model_name, parameter_values(request.parameters))
        return response()

    async def RepositoryModelUnload(self, request: NamedModel,  # noqa: N802
                                    response: type[Message]) -> Message:
        await self.repository.unload(request.model_name)
        return response()

    async def LogSettings(self, request: SettingsRequest,  # noqa: N802
                          response: type[Message]) -> Message:
        answer = response()
        for key, value in SERVER_LOG.update(parameter_values(request.settings)).as_wire().items():
            field = ("bool_param" if isinstance(value, bool) else
                     "uint32_param" if isinstance(value, int) else "string_param")
            setattr(answer.settings[key], field, value)
        return answer


METHODS = ["ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
           "ModelConfig", "ModelStatistics", "ModelInfer", "RepositoryIndex",
           "RepositoryModelLoad", "RepositoryModelUnload", "SystemSharedMemoryStatus",
           "SystemSharedMemoryRegister",
           "SystemSharedMemoryUnregister", "CudaSharedMemoryStatus", "CudaSharedMemoryRegister",
           "CudaSharedMemoryUnregister", "LogSettings"]
"""The unary methods."""
STREAMING = "ModelStreamInfer"
"""The one streaming method: requests in, answers out, each as it is ready."""


# The handlers take the request's bytes and parse them themselves: a message that does not
# parse is then the client's INVALID_ARGUMENT, as on the uvicorn back end (grpc.aio answers a
# failing request_deserializer with UNKNOWN, as if the server had failed).
def _handler(call: Handler, request_type: type[Message], response_type: type[Message]
             ) -> grpc.RpcMethodHandler:
    async def handle(data: bytes, context: aio.ServicerContext) -> Message:
        try:
            return await call(request_type.FromString(data), response_type)
        except ServingError as e:  # abort() raises: the call ends with this status
            await context.abort(status_code(e), e.message)
        except (DecodeError, ValueError, TypeError) as e:  # a message of the wrong shape
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {e}")
        except Exception as e:  # a bug of the server's: INTERNAL, as on the uvicorn back end
            _log.exception("gRPC call %s failed", call.__name__)
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"internal error: {type(e).__name__}: {e}")

    return grpc.unary_unary_rpc_method_handler(
        handle, response_serializer=response_type.SerializeToString)


def _stream_handler(service: Service) -> grpc.RpcMethodHandler:
    request_type, response_type = method_types(STREAMING)

    async def parsed(requests: AsyncIterator[bytes]) -> AsyncIterator[Message]:
        async for data in requests:
            yield request_type.FromString(data)

    async def handle(requests: AsyncIterator[bytes], context: aio.ServicerContext
                     ) -> AsyncIterator[Message]:
        try:
            async for answer in service.ModelStreamInfer(parsed(requests), response_type):
                yield answer
        except DecodeError as e:  # after the answers to the requests before it
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {e}")

    return grpc.stream_stream_rpc_method_handler(
        handle, response_serializer=response_type.SerializeToString)


def unknown_method(path: str) -> str:
    """The ``UNIMPLEMENTED`` message for gRPC method ``path`` (``/service/Method``): for one of
    Triton's that is not served, which extension it is and what to use instead."""
    service, _, name = path.strip("/").partition("/")
    if service == SERVICE and name in UNSERVED_METHODS:
        return f"{name}: {UNSERVED_METHODS[name]}"
    return f"unknown method {path}; this server serves {SERVICE}"


def _unserved_handler(name: str) -> grpc.RpcMethodHandler:
    async def handle(request: bytes, context: aio.ServicerContext) -> bytes:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, unknown_method(f"/{SERVICE}/{name}"))
        raise AssertionError("abort() raises")  # pragma: no cover

    return grpc.unary_unary_rpc_method_handler(handle)  # bytes in and out: no message types


def _generic_handler(service: Service) -> grpc.GenericRpcHandler:
    handlers = {}
    for name in METHODS:
        request_type, response_type = method_types(name)
        handlers[name] = _handler(getattr(service, name), request_type, response_type)
    handlers[STREAMING] = _stream_handler(service)
    handlers.update({name: _unserved_handler(name) for name in UNSERVED_METHODS})
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


class GrpcEndpoint:
    """What both gRPC servers hold: the repository and metrics they serve and where they listen.
    Subclasses start and stop serving on a running loop."""

    def __init__(self, repository: ModelRepository, metrics: ServingMetrics, *,
                 host: str = "127.0.0.1", port: int = 0, max_message_bytes: int = 16 << 20,
                 reuse_port: bool = False, regions: SharedMemoryRegistry | None = None
                 ) -> None:
        self.repository = repository
        self.metrics = metrics
        self.regions = regions
        self.host = host
        self.requested_port = port
        self.max_message_bytes = max_message_bytes
        self.reuse_port = reuse_port  # share the port with sibling processes (--processes)
        self.port: int | None = None

    def listen_error(self, cause: object) -> OSError:
        """The error for a port this server cannot listen on."""
        return OSError(f"cannot listen for gRPC on {self.host}:{self.requested_port}: {cause}; "
                       "pick another --grpc-port or stop the process using it")

    async def start(self) -> int:
        """Bind and start serving; returns the port (the OS's pick when asked for 0)."""
        raise NotImplementedError

    async def stop(self, grace: float | None) -> None:
        """Refuse new calls; let calls in flight finish within ``grace`` seconds."""
        raise NotImplementedError


class GrpcServer(GrpcEndpoint):
    """A grpc.aio server of ``GRPCInferenceService``; start and stop it on a running loop."""

    _server: aio.Server | None = None  # while serving

    async def start(self) -> int:
        """Bind and start serving; returns the port (the OS's pick when asked for 0)."""
        options = [("grpc.max_receive_message_length", self.max_message_bytes),
                   ("grpc.max_send_message_length", -1),
                   ("grpc.so_reuseport", int(self.reuse_port))]
        server = aio.server(options=options)
        server.add_generic_rpc_handlers((_generic_handler(Service(
            self.repository, self.metrics, self.regions)),))
        host = f"[{self.host}]" if ":" in self.host else self.host
        try:
            port: int = server.add_insecure_port(f"{host}:{self.requested_port}")
        except RuntimeError as e:
            raise self.listen_error(e) from e
        await server.start()
        self._server, self.port = server, port
        _log.info("paraloom serving gRPC on %s:%d", self.host, port)
        return port

    async def stop(self, grace: float | None) -> None:
        """Refuse new calls; let calls in flight finish within ``grace`` seconds."""
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
