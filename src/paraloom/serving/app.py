"""The ASGI app: Open Inference Protocol (v2) endpoints over a ParallelInference pool."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
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
from paraloom.serving.errors import ProtocolError, ServingError
from paraloom.serving.handling import InferAnswer, handle_infer
from paraloom.serving.metrics import CONTENT_TYPE_LATEST, ServingMetrics
from paraloom.serving.protocol import InferRequest, encode_infer_response, parse_infer_request
from paraloom.serving.registry import ModelRegistry
from paraloom.serving.repository import ModelFiles
from paraloom.serving.served import ServedModel, build_pool
from paraloom.serving.signature import ModelSignature, TensorSpec, infer_signature

if TYPE_CHECKING:
    from paraloom.inference.parallel import ParallelInference

__all__ = ["EXTENSIONS", "create_app", "create_repository_app"]

_log = logging.getLogger("paraloom.serving")
_HEADER = "Inference-Header-Content-Length"
_PARSE_IN_THREAD = 1 << 20  # decode bodies this large off the event loop
_LOAD_BODY_LIMIT = 64 << 10
EXTENSIONS = ["binary_tensor_data", "model_repository"]


def error_response(status: int, message: str, retry_after: int | None = None) -> JSONResponse:
    """The protocol's error form, ``{"error": message}``."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _registry(request: Request) -> ModelRegistry:
    registry: ModelRegistry = request.app.state.registry
    return registry


def _served(request: Request) -> ServedModel:
    return _registry(request).get(request.path_params["name"], request.path_params.get("version"))


async def server_metadata(request: Request) -> Response:
    """GET /v2."""
    return JSONResponse({"name": "paraloom", "version": __version__, "extensions": EXTENSIONS})


async def live(request: Request) -> Response:
    """GET /v2/health/live: 200 while the process answers."""
    return Response(status_code=200)


async def ready(request: Request) -> Response:
    """GET /v2/health/ready: 200 while the models take requests, 400 (the spec's 4xx) otherwise."""
    return Response(status_code=200 if _registry(request).ready else 400)


async def model_metadata(request: Request) -> Response:
    """GET /v2/models/{name}[/versions/{version}]."""
    return JSONResponse(_served(request).metadata())


async def model_ready(request: Request) -> Response:
    """GET /v2/models/{name}[/versions/{version}]/ready."""
    ready = _registry(request).is_ready(request.path_params["name"],
                                        request.path_params.get("version"))
    return Response(status_code=200 if ready else 400)


def _header_length(request: Request) -> int | None:
    raw = request.headers.get(_HEADER)
    if raw is None:
        return None
    digits = raw.strip()
    if not (digits.isascii() and digits.isdigit()):
        raise ProtocolError(f"{_HEADER} is {raw!r}; expected the JSON part's length in bytes, "
                            "as ASCII digits")
    return int(digits)


def _encode(answer: InferAnswer) -> Response:
    body, header_length = encode_infer_response(
        model_name=answer.model_name, model_version=answer.model_version,
        request_id=answer.request_id, outputs=answer.outputs)
    if header_length is None:
        return Response(body, media_type="application/json")
    return Response(body, media_type="application/octet-stream",
                    headers={_HEADER: str(header_length)})


async def infer(request: Request) -> Response:
    """POST /v2/models/{name}[/versions/{version}]/infer."""
    async def decode() -> InferRequest:
        body = await read_body(request, request.app.state.max_body_bytes)
        header_length = _header_length(request)
        if len(body) > _PARSE_IN_THREAD:
            return await anyio.to_thread.run_sync(parse_infer_request, body, header_length)
        return parse_infer_request(body, header_length)

    try:
        answer = await handle_infer(_registry(request), request.app.state.metrics,
                                    request.path_params["name"],
                                    request.path_params.get("version"), decode)
    except ServingError as e:
        return error_response(e.status, e.message, e.retry_after)
    return _encode(answer)


async def repository_index(request: Request) -> Response:
    """POST /v2/repository/index: every model, its version and state (READY, UNAVAILABLE)."""
    body = await read_body(request, _LOAD_BODY_LIMIT)
    rows = _registry(request).index()
    if body.strip():
        try:
            obj = json.loads(body)
        except ValueError as e:
            raise ProtocolError(f"index request body is not valid JSON: {e}") from e
        if isinstance(obj, dict) and obj.get("ready") is True:
            rows = [r for r in rows if r["state"] == "READY"]
    return JSONResponse(rows)


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
    """POST /v2/repository/models/{name}/load: load, reload or swap in new weights."""
    name = request.path_params["name"]
    version = await _registry(request).load(name, await _load_parameters(request))
    _log.info("model %r now serves version %s", name, version)
    return JSONResponse({"name": name, "version": version})


async def unload_model(request: Request) -> Response:
    """POST /v2/repository/models/{name}/unload: stop serving it once in-flight requests end."""
    name = request.path_params["name"]
    await read_body(request, _LOAD_BODY_LIMIT)
    await _registry(request).unload(name)
    return JSONResponse({"name": name})


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
        pool = build_pool(pool_or_model, signature, probe, outputs is None, pool_options)
    else:
        pool = pool_or_model
    served = ServedModel(name, pool, model, signature, files=files, owns_pool=owns,
                         retry_after=retry_after)

    def rebuild(last: ServedModel) -> ServedModel:
        """After an unload: the same model (its latest weights) in a new pool."""
        if not last.owns_pool:  # the caller's pool was left open: serve it again
            return ServedModel(name, last.pool, last.model, signature, files=files,
                               owns_pool=False, retry_after=retry_after)
        assert last.model is not None
        fresh = build_pool(last.model, signature, probe, outputs is None, pool_options)
        return ServedModel(name, fresh, last.model, signature, files=files, owns_pool=True,
                           retry_after=retry_after, first_version=int(last.version) + 1)

    registry = ModelRegistry()
    registry.add(served, rebuild)
    app = _app(registry, max_body_bytes)
    app.state.served = served
    return app


def create_repository_app(models_dir: str | Path, *, max_body_bytes: int = 16 << 20,
                          retry_after: int = 1, **pool_defaults: Any) -> Starlette:
    """An ASGI app serving every model in ``models_dir`` (see ``paraloom.serving.model_dir``).

    Each model gets its own ``ParallelInference``, built with ``pool_defaults`` overridden by
    the model's config. Models that fail to load are listed as UNAVAILABLE with the reason.
    """
    from paraloom.serving.model_dir import ModelDir

    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes={max_body_bytes}; expected a positive byte count")
    source = ModelDir(models_dir, pool_defaults=pool_defaults, retry_after=retry_after)
    registry = ModelRegistry(source)
    try:
        for name, found in source.scan().items():
            try:
                *older, latest = source.build_versions(found)
                registry.add(latest, older=older)
            except (ValueError, TypeError, RuntimeError, OSError) as e:
                _log.error("model %r not loaded: %s", name, e)
                registry.fail(name, str(e))
    except BaseException:
        for served in registry.every():
            served.pool.close(drain=False)
        raise
    app = _app(registry, max_body_bytes)
    app.state.served = None
    return app


def _app(registry: ModelRegistry, max_body_bytes: int) -> Starlette:
    app_metrics = ServingMetrics()
    app_metrics.watch(registry.pools, registry.versions)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await registry.close()

    app = Starlette(routes=_ROUTES, lifespan=lifespan, exception_handlers={
        ServingError: _on_serving_error, HTTPException: _on_http_error})
    app.state.registry, app.state.metrics = registry, app_metrics
    app.state.max_body_bytes = max_body_bytes
    return app
