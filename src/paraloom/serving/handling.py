"""The v2 semantics both transports share: look up, validate, infer, choose outputs, count.

HTTP and gRPC decode their own wire formats into an ``InferRequest`` and encode the
``InferAnswer``; everything between (model and version lookup, signature checks, the pool,
output selection, errors and metrics) is here, once, as is the server metadata both answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from paraloom._version import __version__
from paraloom.serving.errors import ModelFailedError, NotFoundError, ProtocolError, ServingError
from paraloom.serving.metrics import ServingMetrics
from paraloom.serving.protocol import InferRequest
from paraloom.serving.repository.models import ModelRepository
from paraloom.serving.served import ServedModel

__all__ = ["EXTENSIONS", "InferAnswer", "ServerMetadata", "describe_server", "handle_infer",
           "select_outputs"]

_log = logging.getLogger("paraloom.serving")
EXTENSIONS = ["binary_tensor_data", "model_repository"]


class ServerMetadata(TypedDict):
    """The v2 server metadata (``GET /v2``, gRPC ``ServerMetadata``)."""

    name: str
    version: str
    """paraloom's release: the protocol's server version, not a model's."""
    extensions: list[str]


def describe_server() -> ServerMetadata:
    """The server metadata both transports answer with."""
    return {"name": "paraloom", "version": __version__, "extensions": list(EXTENSIONS)}


@dataclass(frozen=True)
class InferAnswer:
    """An answered request: the model and version that ran it and the outputs to send."""

    model_name: str
    model_version: str
    request_id: str | None
    outputs: list[tuple[str, torch.Tensor, bool]]  # (name, tensor, as binary)


def select_outputs(served: ServedModel, parsed: InferRequest, result: Any
                   ) -> list[tuple[str, torch.Tensor, bool]]:
    """The outputs the request asked for (all by default), named as the signature says;
    ``result`` is whatever the user's model returned."""
    named = dict(served.signature.name_outputs(result))
    if parsed.outputs is None:
        return [(n, t, parsed.binary_output) for n, t in named.items()]
    unknown = [o.name for o in parsed.outputs if o.name not in named]
    if unknown:
        raise ProtocolError(f"request asks for outputs {unknown} that the model does not have; "
                            f"its outputs are {list(named)}")
    return [(o.name, named[o.name], parsed.binary_output if o.binary is None else o.binary)
            for o in parsed.outputs]


async def _infer(repository: ModelRepository, name: str, version: str | None,
                 parsed: InferRequest) -> InferAnswer:
    # No await between the lookup and the submit in served.infer: a model replaced or unloaded
    # meanwhile is never handed a request after it stopped taking them.
    served = repository.get(name, version)
    tensors = served.signature.check(parsed.inputs)
    result, used = await served.infer(tensors)
    if version is not None and used != version:
        raise NotFoundError(f"model {name!r} moved to version {used!r} while this request "
                            f"waited; version {version!r} is gone, send it again")
    return InferAnswer(served.name, used, parsed.id, select_outputs(served, parsed, result))


async def handle_infer(repository: ModelRepository, metrics: ServingMetrics, name: str,
                       version: str | None, decode: Callable[[], Awaitable[InferRequest]]
                       ) -> InferAnswer:
    """Decode, run and answer one request, counting it; every failure is a ``ServingError``."""
    label = repository.label(name)
    started = time.perf_counter()
    metrics.request(label)
    try:
        answer = await _infer(repository, name, version, await decode())
    except ServingError as e:
        metrics.failure(label, e.reason)
        raise
    except Exception as e:  # the model itself raised on every try: a server-side failure
        _log.exception("inference failed")
        metrics.failure(label, "model_error")
        raise ModelFailedError(f"the model failed: {type(e).__name__}: {e}") from e
    metrics.done(label, time.perf_counter() - started)
    return answer
