"""The v2 HTTP endpoints: each route a thin translation between HTTP and the shared semantics
(``handling``) and model repository (``repository``); errors in the protocol's form."""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from paraloom.serving.body import read_body
from paraloom.serving.errors import ProtocolError, ServingError
from paraloom.serving.handling import describe_server
from paraloom.serving.infer_endpoint import InferEndpoint
from paraloom.serving.log_settings import SERVER_LOG
from paraloom.serving.metrics import CONTENT_TYPE_LATEST, ServingMetrics
from paraloom.serving.model_config import model_config
from paraloom.serving.protocol import load_json
from paraloom.serving.repository.models import ModelRepository
from paraloom.serving.served import ServedModel
from paraloom.serving.shared_memory_routes import SHARED_MEMORY_ROUTES, regions_of
from paraloom.serving.statistics import statistics
from paraloom.serving.unserved import unserved_path

__all__ = ["EXCEPTION_HANDLERS", "ROUTES", "error_response"]

_log = logging.getLogger("paraloom.serving")
_LOAD_BODY_LIMIT = 64 << 10


def error_response(status: int, message: str, retry_after: int | None = None) -> JSONResponse:
    """The protocol's error form, ``{"error": message}``."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _repository(request: Request) -> ModelRepository:
    repository: ModelRepository = request.app.state.repository
    return repository


def _metrics(request: Request) -> ServingMetrics:
    metrics: ServingMetrics = request.app.state.metrics
    return metrics


def _served(request: Request) -> ServedModel:
    return _repository(request).get(request.path_params["name"],
                                    request.path_params.get("version"))


async def server_metadata(request: Request) -> Response:
    """GET /v2."""
    return JSONResponse(describe_server(regions_of(request) is not None))


async def live(request: Request) -> Response:
    """GET /v2/health/live: 200 while the process answers."""
    return Response(status_code=200)


async def ready(request: Request) -> Response:
    """GET /v2/health/ready: 200 while the models take requests, 400 (the spec's 4xx) otherwise."""
    return Response(status_code=200 if _repository(request).ready else 400)


async def model_metadata(request: Request) -> Response:
    """GET /v2/models/{name}[/versions/{version}]."""
    return JSONResponse(_served(request).metadata())


async def model_statistics(request: Request) -> Response:
    """GET /v2/models[/{name}[/versions/{version}]]/stats: Triton's statistics of every model,
    of one, or of one version. ``GET /v2/models/stats`` is the metadata of a model called
    ``stats`` where there is one (gRPC ``ModelStatistics`` reads its statistics)."""
    params = request.path_params
    repository = _repository(request)
    if "name" not in params and "stats" in repository.models():
        return JSONResponse(repository.get("stats").metadata())
    return JSONResponse(statistics(repository, params.get("name"), params.get("version")))


async def model_config_route(request: Request) -> Response:
    """GET /v2/models/{name}[/versions/{version}]/config: Triton's model configuration."""
    return JSONResponse(model_config(_served(request)))


async def model_ready(request: Request) -> Response:
    """GET /v2/models/{name}[/versions/{version}]/ready."""
    ready = _repository(request).is_ready(request.path_params["name"],
                                        request.path_params.get("version"))
    return Response(status_code=200 if ready else 400)


async def repository_index(request: Request) -> Response:
    """POST /v2/repository/index: every model, its version and state (READY, UNAVAILABLE)."""
    body = await read_body(request, _LOAD_BODY_LIMIT)
    rows = await _repository(request).index_off_loop()
    if body.strip():
        try:
            obj = load_json(body)
        except ValueError as e:
            raise ProtocolError(f"index request body is not valid JSON: {e}") from e
        if isinstance(obj, dict) and obj.get("ready") is True:
            rows = [r for r in rows if r["state"] == "READY"]
    return JSONResponse(rows)


async def _load_parameters(request: Request) -> dict[str, object]:
    body = await read_body(request, _LOAD_BODY_LIMIT)
    if not body.strip():
        return {}
    try:
        obj = load_json(body)
    except ValueError as e:
        raise ProtocolError(f"load request body is not valid JSON: {e}") from e
    params = obj.get("parameters", {}) if isinstance(obj, dict) else None
    if not isinstance(params, dict):
        raise ProtocolError('load request body must be {"parameters": {"path": NAME}} or empty')
    return params


async def load_model(request: Request) -> Response:
    """POST /v2/repository/models/{name}/load: load, reload or swap in new weights."""
    name = request.path_params["name"]
    version = await _repository(request).load(name, await _load_parameters(request))
    _log.info("model %r now serves version %s", name, version)
    return JSONResponse({"name": name, "version": version})


async def unload_model(request: Request) -> Response:
    """POST /v2/repository/models/{name}/unload: stop serving it once in-flight requests end."""
    name = request.path_params["name"]
    await read_body(request, _LOAD_BODY_LIMIT)
    await _repository(request).unload(name)
    return JSONResponse({"name": name})


async def log_settings(request: Request) -> Response:
    """GET and POST /v2/logging: Triton's logging extension (``log_settings``). A POST's body is
    an object of the settings to change; both answer every setting now in force."""
    if request.method == "GET":
        return JSONResponse(SERVER_LOG.settings().as_wire())
    body = await read_body(request, _LOAD_BODY_LIMIT)
    try:
        changes = load_json(body) if body.strip() else {}
    except ValueError as e:
        raise ProtocolError(f"log settings request body is not valid JSON: {e}") from e
    if not isinstance(changes, dict):
        raise ProtocolError('log settings request body must be an object, e.g. '
                            '{"log_verbose_level": 1}')
    new = SERVER_LOG.update(changes)
    _log.info("log settings changed: %s", changes)
    return JSONResponse(new.as_wire())


async def metrics(request: Request) -> Response:
    """GET /metrics in Prometheus' text format."""
    return Response(_metrics(request).exposition(), media_type=CONTENT_TYPE_LATEST)


async def _on_serving_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServingError)
    return error_response(exc.status, exc.message, exc.retry_after)


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    # Starlette's outermost middleware calls this, then raises the error again (logged there).
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    unserved = unserved_path(request.url.path) if exc.status_code in (404, 405) else None
    if unserved is not None:
        message = f"{request.method} {request.url.path}: {unserved}"
        return error_response(404, message)
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
ROUTES = [
    # Starlette tries the routes in order: inference, the one that counts, is matched first
    # (no other route's pattern matches its paths, so the order changes nothing else), and
    # is a plain ASGI endpoint (see infer_endpoint).
    Route(_MODEL + "/infer", InferEndpoint(), methods=["POST"]),
    Route(_VERSION + "/infer", InferEndpoint(), methods=["POST"]),
    Route("/v2", server_metadata, methods=["GET"]),
    Route("/v2/health/live", live, methods=["GET"]),
    Route("/v2/health/ready", ready, methods=["GET"]),
    Route("/v2/models/stats", model_statistics, methods=["GET"]),
    Route(_MODEL + "/stats", model_statistics, methods=["GET"]),
    Route(_VERSION + "/stats", model_statistics, methods=["GET"]),
    Route(_MODEL, model_metadata, methods=["GET"]),
    Route(_VERSION, model_metadata, methods=["GET"]),
    Route(_MODEL + "/config", model_config_route, methods=["GET"]),
    Route(_VERSION + "/config", model_config_route, methods=["GET"]),
    Route(_MODEL + "/ready", model_ready, methods=["GET"]),
    Route(_VERSION + "/ready", model_ready, methods=["GET"]),
    Route("/v2/repository/index", repository_index, methods=["POST"]),
    Route("/v2/repository/models/{name}/load", load_model, methods=["POST"]),
    Route("/v2/repository/models/{name}/unload", unload_model, methods=["POST"]),
    Route("/v2/logging", log_settings, methods=["GET", "POST"]),
    Route("/metrics", metrics, methods=["GET"]),
    *SHARED_MEMORY_ROUTES,
]

EXCEPTION_HANDLERS = {ServingError: _on_serving_error, HTTPException: _on_http_error,
                      Exception: _on_unexpected}
"""Every ``ServingError``, routing error and unexpected failure answered in the protocol's
``{"error": ...}`` (an unexpected one as 500, naming the exception)."""
