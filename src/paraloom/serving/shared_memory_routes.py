"""The HTTP endpoints of the shared memory extensions, at Triton's paths.

System shared memory (``/v2/systemsharedmemory/...``): status, register and unregister, over
the app's ``SharedMemoryRegistry`` (with shared memory off, status and register are refused
with the reason and unregistering is a no-op, so a client's clean-up works either way). CUDA
shared memory (``/v2/cudasharedmemory/...``) holds no region here: its status is empty and
unregistering is a no-op, so clients that clear both before they start work unchanged, and a
register is refused with the reason.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from paraloom.serving.body import read_body
from paraloom.serving.errors import NotFoundError, ProtocolError, short_repr
from paraloom.serving.protocol import load_json
from paraloom.serving.shared_memory import SharedMemoryRegistry, registry_or_refuse

__all__ = ["CUDA_REFUSAL", "SHARED_MEMORY_ROUTES", "registry_of", "regions_of"]

_BODY_LIMIT = 64 << 10
CUDA_REFUSAL = ("CUDA shared memory is not served by paraloom; use system shared memory "
                "(tritonclient.utils.shared_memory) or send the data in the request")


def regions_of(request: Request) -> SharedMemoryRegistry | None:
    """The app's shared memory registry; None when the server has shared memory off."""
    regions: SharedMemoryRegistry | None = request.app.state.regions
    return regions


def registry_of(request: Request) -> SharedMemoryRegistry:
    """The app's registry; ``ProtocolError`` when the server has shared memory off."""
    return registry_or_refuse(regions_of(request))


def _register_fields(obj: object) -> tuple[str, int, int]:
    usage = 'expected {"key": "/segment", "offset": 0, "byte_size": N}'
    if not isinstance(obj, dict):
        raise ProtocolError(f"register request body is {short_repr(obj)}; {usage}")
    key, offset, size = obj.get("key"), obj.get("offset", 0), obj.get("byte_size")
    if not isinstance(key, str) or not isinstance(offset, int) or not isinstance(size, int) \
            or isinstance(offset, bool) or isinstance(size, bool):
        raise ProtocolError(f"register request body is {short_repr(obj)}; {usage}")
    return key, offset, size


async def status(request: Request) -> Response:
    """GET /v2/systemsharedmemory[/region/{name}]/status."""
    return JSONResponse(registry_of(request).status(request.path_params.get("name")))


async def register(request: Request) -> Response:
    """POST /v2/systemsharedmemory/region/{name}/register."""
    body = await read_body(request, _BODY_LIMIT)
    try:
        obj = load_json(body)
    except ValueError as e:
        raise ProtocolError(f"register request body is not valid JSON: {e}") from e
    key, offset, size = _register_fields(obj)
    registry_of(request).register(request.path_params["name"], key, offset, size)
    return Response(status_code=200)


async def unregister(request: Request) -> Response:
    """POST /v2/systemsharedmemory[/region/{name}]/unregister (nothing to do, and no error,
    when shared memory is off: no region can be registered then)."""
    await read_body(request, _BODY_LIMIT)
    regions = regions_of(request)
    if regions is not None:
        regions.unregister(request.path_params.get("name"))
    return Response(status_code=200)


async def cuda_status(request: Request) -> Response:
    """GET /v2/cudasharedmemory[/region/{name}]/status: no region is ever registered."""
    name = request.path_params.get("name")
    if name is not None:
        raise NotFoundError(f"no CUDA shared memory region {name!r}: {CUDA_REFUSAL}")
    return JSONResponse([])


async def cuda_register(request: Request) -> Response:
    """POST /v2/cudasharedmemory/region/{name}/register: refused."""
    raise ProtocolError(CUDA_REFUSAL)


async def cuda_unregister(request: Request) -> Response:
    """POST /v2/cudasharedmemory[/region/{name}]/unregister: nothing to do."""
    await read_body(request, _BODY_LIMIT)
    return Response(status_code=200)


_SYSTEM, _CUDA = "/v2/systemsharedmemory", "/v2/cudasharedmemory"
SHARED_MEMORY_ROUTES = [
    Route(_SYSTEM + "/status", status, methods=["GET"]),
    Route(_SYSTEM + "/region/{name}/status", status, methods=["GET"]),
    Route(_SYSTEM + "/region/{name}/register", register, methods=["POST"]),
    Route(_SYSTEM + "/unregister", unregister, methods=["POST"]),
    Route(_SYSTEM + "/region/{name}/unregister", unregister, methods=["POST"]),
    Route(_CUDA + "/status", cuda_status, methods=["GET"]),
    Route(_CUDA + "/region/{name}/status", cuda_status, methods=["GET"]),
    Route(_CUDA + "/region/{name}/register", cuda_register, methods=["POST"]),
    Route(_CUDA + "/unregister", cuda_unregister, methods=["POST"]),
    Route(_CUDA + "/region/{name}/unregister", cuda_unregister, methods=["POST"]),
]
