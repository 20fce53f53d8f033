"""The ASGI app: Open Inference Protocol (v2) endpoints over a ParallelInference pool."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from torch import nn

from paraloom._version import __version__
from paraloom.serving.body import read_body
from paraloom.serving.errors import NotFoundError, ProtocolError, ServingError
from paraloom.serving.metrics import CONTENT_TYPE_LATEST, ServingMetrics
from paraloom.serving.protocol import InferRequest, encode_infer_response, parse_infer_request
from paraloom.serving.repository import ModelFiles
from paraloom.serving.served import ServedModel
from paraloom.serving.signature import ModelSignature, TensorSpec, infer_signature, probe_input

if TYPE_CHECKING:
    from paraloom.inference.parallel import ParallelInference

__all__ = ["create_app"]

_log = logging.getLogger("paraloom.serving")
_HEADER = "Inference-Header-Content-Length"
_PARSE_IN_THREAD = 1 << 20  # decode bodies this large off the event loop
_LOAD_BODY_LIMIT = 64 << 10
_EXTENSIONS = ["binary_tensor_data", "model_repository"]


def error_response(status: int, message: str, retry_after: int | None = None) -> JSONResponse:
    """The protocol's error form, ``{"error": message}``."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _served(request: Request) -> ServedModel:
    served: ServedModel = request.app.state.served
    served.check(request.path_params["name"], request.path_params.get("version"))
    return served


async def server_metadata(request: Request) -> Response:
    """GET /v2."""
    return JSONResponse({"name": "paraloom", "version": __version__, "extensions": _EXTENSIONS})


async def live(request: Request) -> Response:
    """GET /v2/health/live: 200 while the process answers."""
    return Response(status_code=200)


async def ready(request: Request) -> Response:
    """GET /v2/health/ready: 200 while the model takes requests, 400 (the spec's 4xx) otherwise."""
    return Response(status_code=200 if request.app.state.served.ready else 400)


async def model_metadata(request: Request) -> Response:
    """GET /v2/models/{name}[/versions/{version}]."""
    return JSONResponse(_served(request).metadata())


async def model_ready(request: Request) -> Response:
    """GET /v2/models/{name}[/versions/{version}]/ready."""
    return Response(status_code=200 if _served(request).ready else 400)


def _header_length(request: Request) -> int | None:
    raw = request.headers.get(_HEADER)
    if raw is None:
        return None
    digits = raw.strip()
    if not (digits.isascii() and digits.isdigit()):
        raise ProtocolError(f"{_HEADER} is {raw!r}; expected the JSON part's length in bytes, "
                            "as ASCII digits")
    return int(digits)


def _encode(served: ServedModel, parsed: InferRequest, result: Any, version: str) -> Response:
    named = dict(served.signature.name_outputs(result))
    if parsed.outputs is None:
        chosen = [(n, t, parsed.binary_output) for n, t in named.items()]
    else:
        unknown = [o.name for o in parsed.outputs if o.name not in named]
        if unknown:
            raise ProtocolError(f"request asks for outputs {unknown} that the model does not "
                                f"have; its outputs are {list(named)}")
        chosen = [(o.name, named[o.name], parsed.binary_output if o.binary is None
                   else o.binary) for o in parsed.outputs]
    body, header_length = encode_infer_response(
        model_name=served.name, model_version=version, request_id=parsed.id, outputs=chosen)
    if header_length is None:
        return Response(body, media_type="application/json")
    return Response(body, media_type="application/octet-stream",
                    headers={_HEADER: str(header_length)})


async def _infer(request: Request, served: ServedModel) -> Response:
    pinned = request.path_params.get("version")
    body = await read_body(request, request.app.state.max_body_bytes)
    header_length = _header_length(request)
    if len(body) > _PARSE_IN_THREAD:
        parsed = await anyio.to_thread.run_sync(parse_infer_request, body, header_length)
    else:
        parsed = parse_infer_request(body, header_length)
    tensors = served.signature.check(parsed.inputs)
    result, version = await served.infer(tensors)
    if pinned is not None and version != pinned:
        raise NotFoundError(f"model {served.name!r} moved to version {version!r} while this "
                            f"request waited; version {pinned!r} is gone, send it again")
    return _encode(served, parsed, result, version)


async def infer(request: Request) -> Response:
    """POST /v2/models/{name}[/versions/{version}]/infer."""
    served, metrics = request.app.state.served, request.app.state.metrics
    started = time.perf_counter()
    metrics.request(served.name)
    try:
        served.check(request.path_params["name"], request.path_params.get("version"))
        response = await _infer(request, served)
    except ServingError as e:
        metrics.failure(served.name, e.reason)
        return error_response(e.status, e.message, e.retry_after)
    except Exception as e:  # the model itself raised on every try: a server-side failure
        _log.exception("inference failed")
        metrics.failure(served.name, "model_error")
        return error_response(500, f"the model failed: {type(e).__name__}: {e}")
    metrics.done(served.name, time.perf_counter() - started)
    return response


async def repository_index(request: Request) -> Response:
    """POST /v2/repository/index."""
    served: ServedModel = request.app.state.served
    state = "READY" if served.ready else "UNAVAILABLE"
    return JSONResponse([{"name": served.name, "version": served.version, "state": state,
                          "reason": ""}])


async def _load_parameters(request: Request) -> dict[str, Any]:
    body = await read_body(request, _LOAD_BODY_LIMIT)
    if not body.strip():
        return {}
    try:
        obj = json.loads(body)
    except ValueError as e:
        raise ProtocolError(f"load request body is not valid JSON: {e}") from e
    params = obj.get("parameters", {}) if isinstance(obj, dict) else None
    if not isinstance(params, dict):
        raise ProtocolError('load request body must be {"parameters": {"path": NAME}} or empty')
    return params


async def load_model(request: Request) -> Response:
    """POST /v2/repository/models/{name}/load: swap in new weights (see ``ModelFiles``)."""
    served = _served(request)
    version = await served.load(await _load_parameters(request))
    _log.info("model %r now serves version %s", served.name, version)
    return JSONResponse({"name": served.name, "version": version})


async def unload_model(request: Request) -> Response:
    """POST /v2/repository/models/{name}/unload: refused, the server serves one model."""
    served = _served(request)
    raise ProtocolError(f"unloading is not supported: this server exists to serve "
                        f"{served.name!r}; stop the server instead")


async def metrics(request: Request) -> Response:
    """GET /metrics in Prometheus' text format."""
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


async def _on_serving_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServingError)
    return error_response(exc.status, exc.message, exc.retry_after)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = (f"no endpoint {request.method} {request.url.path}; the v2 endpoints are "
                   "under /v2 (GET /v2/models/NAME, POST /v2/models/NAME/infer)")
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return error_response(exc.status_code, message)


_MODEL = "/v2/models/{name}"
_VERSION = "/v2/models/{name}/versions/{version}"
_ROUTES = [
    Route("/v2", server_metadata, methods=["GET"]),
    Route("/v2/health/live", live, methods=["GET"]),
    Route("/v2/health/ready", ready, methods=["GET"]),
    Route(_MODEL, model_metadata, methods=["GET"]),
    Route(_VERSION, model_metadata, methods=["GET"]),
    Route(_MODEL + "/ready", model_ready, methods=["GET"]),
    Route(_VERSION + "/ready", model_ready, methods=["GET"]),
    Route(_MODEL + "/infer", infer, methods=["POST"]),
    Route(_VERSION + "/infer", infer, methods=["POST"]),
    Route("/v2/repository/index", repository_index, methods=["POST"]),
    Route("/v2/repository/models/{name}/load", load_model, methods=["POST"]),
    Route("/v2/repository/models/{name}/unload", unload_model, methods=["POST"]),
    Route("/metrics", metrics, methods=["GET"]),
]


def _build_pool(model: nn.Module, signature: ModelSignature,
                sample: torch.Tensor | Sequence[torch.Tensor] | None, probed: bool,
                pool_options: dict[str, Any]) -> ParallelInference:
    """ParallelInference(model), warmed on the signature's probe so errors are blamed right."""
    from paraloom.inference.parallel import ParallelInference

    options = dict(pool_options)
    if probed and options.get("example_input") is None:
        # An input the model is known to accept: a later failure of one request is then that
        # request's fault (400), while a model failing on everything is the model's (500).
        options["example_input"] = probe_input(signature, sample)
    return ParallelInference(model, **options)


def _check_pool(pool_or_model: object, model: nn.Module | None, pool_options: dict[str, Any]
                ) -> None:
    if isinstance(pool_or_model, nn.Module):
        if model is not None:
            raise TypeError("model= is for create_app(pool, model=...); pass the model once")
        return
    if pool_options:
        raise TypeError(f"pool options {sorted(pool_options)} only apply when create_app builds "
                        "the pool from a model; configure the ParallelInference you passed")
    if not hasattr(pool_or_model, "submit") or not hasattr(pool_or_model, "model_version"):
        raise TypeError(f"create_app takes an nn.Module or a ParallelInference, got "
                        f"{type(pool_or_model).__name__}")


def _signature(model: nn.Module | None, *,
               sample: torch.Tensor | Sequence[torch.Tensor] | None,
               inputs: Sequence[TensorSpec] | None,
               outputs: Sequence[TensorSpec] | None) -> ModelSignature:
    if model is not None:
        return infer_signature(model, sample=sample, inputs=inputs, outputs=outputs)
    if inputs is None or outputs is None:
        raise TypeError("create_app(pool) needs model= (the module the pool serves) or both "
                        "inputs= and outputs= to describe the model")
    return ModelSignature(tuple(inputs), tuple(outputs))


def create_app(pool_or_model: nn.Module | ParallelInference, *, name: str = "model",
               model: nn.Module | None = None,
               sample: torch.Tensor | Sequence[torch.Tensor] | None = None,
               inputs: Sequence[TensorSpec] | None = None,
               outputs: Sequence[TensorSpec] | None = None,
               max_body_bytes: int = 16 << 20, model_file: str | None = None,
               model_dir: str | None = None, retry_after: int = 1,
               **pool_options: Any) -> Starlette:
    """An ASGI app serving a model (or an existing ParallelInference) under the v2 protocol.

    Given a model, the app builds ``ParallelInference(model, **pool_options)`` and closes it,
    draining, at shutdown; a pool passed in stays the caller's to close (pass ``model=``, the
    module it serves, to describe it and to load new weights). The signature comes from
    ``inputs``/``outputs``, a ``sample`` input, or the model's first layer. Remote loads may read
    only ``model_file`` or ``.safetensors`` files in ``model_dir`` (see ``ModelFiles``).
    """
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes={max_body_bytes}; expected a positive byte count")
    files = ModelFiles(model_file=model_file, model_dir=model_dir)
    _check_pool(pool_or_model, model, pool_options)
    owns = isinstance(pool_or_model, nn.Module)
    if isinstance(pool_or_model, nn.Module):
        model = pool_or_model
    signature = _signature(model, sample=sample, inputs=inputs, outputs=outputs)
    # The probe ran the model only when the outputs were read from it.
    probe = sample if outputs is None else None
    if isinstance(pool_or_model, nn.Module):
        pool = _build_pool(pool_or_model, signature, probe, outputs is None, pool_options)
    else:
        pool = pool_or_model
    served = ServedModel(name, pool, model, signature, files=files, owns_pool=owns,
                         retry_after=retry_after)
    app_metrics = ServingMetrics()
    app_metrics.watch(name, pool)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await served.close()

    app = Starlette(routes=_ROUTES, lifespan=lifespan, exception_handlers={
        ServingError: _on_serving_error, HTTPException: _on_http_error})
    app.state.served, app.state.metrics = served, app_metrics
    app.state.max_body_bytes = max_body_bytes
    return app
