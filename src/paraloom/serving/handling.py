"""The v2 semantics both transports share: look up, validate, infer, choose outputs, count.

HTTP and gRPC decode their own wire formats into an ``InferRequest`` and encode the
``InferAnswer``; everything between (model and version lookup, signature checks, the pool,
output selection, errors and metrics) is here, once, as is the server metadata both answer.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

import anyio
import torch

from paraloom._version import __version__
from paraloom.serving.classification import classify
from paraloom.serving.datatypes import Value, value_to_bytes
from paraloom.serving.errors import ModelFailedError, NotFoundError, ProtocolError, ServingError
from paraloom.serving.handlers import HandlerFailedError
from paraloom.serving.metrics import ServingMetrics
from paraloom.serving.protocol import AnswerOutput, InferRequest
from paraloom.serving.repository.models import ModelRepository
from paraloom.serving.served import ServedModel
from paraloom.serving.shared_memory import RegionRef, SharedMemoryRegistry, registry_or_refuse

__all__ = ["EXTENSIONS", "InferAnswer", "ServerMetadata", "describe_server", "handle_infer",
           "select_outputs"]

_log = logging.getLogger("paraloom.serving")
EXTENSIONS = ["binary_tensor_data", "classification", "logging", "model_configuration",
              "model_repository", "statistics"]
SHARED_MEMORY = "system_shared_memory"  # listed when the server has shared memory on


class ServerMetadata(TypedDict):
    """The v2 server metadata (``GET /v2``, gRPC ``ServerMetadata``)."""

    name: str
    version: str
    """paraloom's release: the protocol's server version, not a model's."""
    extensions: list[str]


def describe_server(shared_memory: bool = False) -> ServerMetadata:
    """The server metadata both transports answer with (``shared_memory``: whether the system
    shared memory extension is on)."""
    return {"name": "paraloom", "version": __version__,
            "extensions": [*EXTENSIONS, *([SHARED_MEMORY] if shared_memory else [])]}


@dataclass(frozen=True)
class InferAnswer:
    """An answered request: the model and version that ran it and the outputs to send."""

    model_name: str
    model_version: str
    request_id: str | None
    outputs: list[AnswerOutput]


def select_outputs(served: ServedModel, parsed: InferRequest, result: Any) -> list[AnswerOutput]:
    """The outputs the request asked for (all by default), named as the signature says;
    ``result`` is whatever the user's model (or its handler's postprocess) returned."""
    named: dict[str, Value] = dict(served.signature.name_outputs(result))
    _check_outputs(served, named)
    if served.handler is None and served.batched and served.signature.inputs:
        first = served.signature.inputs[0].name  # the rows: the first declared input's
        given = next((t for t in parsed.inputs if t.name == first), None)
        if given is not None and given.shape:
            _check_rows(named, given.shape[0])
    if parsed.outputs is None:
        return [AnswerOutput(n, t, parsed.binary_output) for n, t in named.items()]
    _check_asked_outputs(parsed, list(named))
    return [AnswerOutput(o.name, named[o.name] if not o.classes else classify(
                named[o.name], o.classes, served.batch_dim, served.labels.get(o.name, ()),
                o.name),
                         parsed.binary_output if o.binary is None else o.binary, o.region)
            for o in parsed.outputs]


def _check_asked_outputs(parsed: InferRequest, names: list[str]) -> None:
    """``ProtocolError`` for a request that asks for an output not in ``names`` (the model's),
    or for one output twice: checked before the model runs, so such a request costs no pass."""
    if parsed.outputs is None:
        return
    unknown = [o.name for o in parsed.outputs if o.name not in names]
    if unknown:
        raise ProtocolError(f"request asks for outputs {unknown} that the model does not have; "
                            f"its outputs are {names}")
    twice = sorted(n for n, k in Counter(o.name for o in parsed.outputs).items() if k > 1)
    if twice:
        raise ProtocolError(f"request asks for outputs {twice} more than once; name each output "
                            "once")


def _check_outputs(served: ServedModel, outputs: dict[str, Value]) -> None:
    """A 500 naming the output whose datatype or shape breaks the model's declared signature
    (Triton fails such a request too), not data that contradicts the model's metadata."""
    wrong = served.signature.output_misfit(outputs)
    if wrong is None:
        return
    handler = served.handler
    if handler is not None and handler.postprocess is not None:
        raise HandlerFailedError(f"{handler.path.name} postprocess returned {wrong} in "
                                 "OUTPUTS; return arrays of the declared datatypes and shapes")
    raise ModelFailedError(f"the model returned {wrong}; make the model return that, or "
                           "declare what it returns (config.pbtxt, the config's outputs, or "
                           "outputs=)")


def _check_rows(outputs: dict[str, Value], rows: int) -> None:
    """A 500 when a batched model answers a request of ``rows`` rows with another number of
    rows: a request never gets another's rows, or fewer than it sent."""
    for name, value in outputs.items():
        if isinstance(value, torch.Tensor) and (value.dim() == 0 or value.shape[0] != rows):
            raise ModelFailedError(
                f"the model returned {list(value.shape)} for output {name!r} on a request of "
                f"{rows} rows; a batched model returns one row per input row (a model without "
                "a batch dimension is served with max_batch_size: 0 in config.pbtxt, or mode "
                "'inplace')")


def request_timeout(parameters: Mapping[str, object]) -> float | None:
    """The ``timeout`` request parameter (Triton's: microseconds; tritonclient's
    ``infer(timeout=...)``) in seconds; None where it is not given or 0 (no limit).
    ``ProtocolError`` for anything but a non-negative integer."""
    value = parameters.get("timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProtocolError(f"request parameter timeout={value!r}; expected a whole number of "
                            "microseconds >= 0 (0: no limit)")
    return value / 1e6 if value else None


def write_regions(outputs: list[AnswerOutput], regions: SharedMemoryRegistry | None
                  ) -> list[AnswerOutput]:
    """Write the outputs asked for in shared memory there; each then records the bytes
    written as its region's size (what the response reports)."""
    written = []
    for out in outputs:
        if out.region is not None:
            where = f"output {out.name!r}"
            target = registry_or_refuse(regions, f"{where} asks for shared memory region "
                                                 f"{out.region.region!r}, but ")
            data = value_to_bytes(out.value)
            target.write(out.region, data, where)
            out = out._replace(region=RegionRef(out.region.region, len(data),
                                                out.region.offset))
        written.append(out)
    return written


async def _infer(repository: ModelRepository, name: str, version: str | None,
                 parsed: InferRequest, regions: SharedMemoryRegistry | None
                 ) -> tuple[ServedModel, InferAnswer]:
    served = repository.get(name, version)
    # Admitted from the lookup on: a model unloaded or replaced while its handler's
    # preprocess runs still answers this request (its close waits), as a submitted one does.
    with served.admitted():
        values = served.signature.check(parsed.inputs, batched=served.merges_requests)
        _check_asked_outputs(parsed, [o.name for o in served.signature.outputs])
        tensors = values if served.handler is None else \
            await anyio.to_thread.run_sync(served.handler.to_model, values,
                                           limiter=served.threads)
        result, used = await served.infer(tensors, admitted=True,  # type: ignore[arg-type]
                                          timeout=request_timeout(parsed.parameters))
    if version is not None and used != version:
        raise NotFoundError(f"model {name!r} moved to version {used!r} while this request "
                            f"waited; version {version!r} is gone, send it again")
    if served.handler is not None:
        result = await anyio.to_thread.run_sync(served.handler.from_model, result,
                                                limiter=served.threads)
    if parsed.outputs is not None and any(o.classes for o in parsed.outputs):
        # Classification formats a string per class kept, per row: off the event loop.
        chosen = await anyio.to_thread.run_sync(select_outputs, served, parsed, result)
    else:
        chosen = select_outputs(served, parsed, result)
    return served, InferAnswer(served.name, used, parsed.id, write_regions(chosen, regions))


async def handle_infer(repository: ModelRepository, metrics: ServingMetrics, name: str,
                       version: str | None, decode: Callable[[], Awaitable[InferRequest]],
                       regions: SharedMemoryRegistry | None = None) -> InferAnswer:
    """Decode, run and answer one request, counting it; every failure is a ``ServingError``.
    ``regions``: the shared memory regions outputs may be written to (None: off)."""
    label = repository.label(name)
    started = time.perf_counter()
    metrics.request(label)
    found: ServedModel | None = None  # counts a failure in its statistics once found
    try:
        found = repository.get(name, version)  # an unknown model or version: 404 before the body
        served, answer = await _infer(repository, name, version, await decode(), regions)
    except ServingError as e:
        _failed(found, started)
        metrics.failure(label, e.reason)
        _log.debug("model %r: a request failed with %d: %s", name, e.status, e.message)
        raise
    except anyio.get_cancelled_exc_class():  # the call was cancelled or its deadline passed
        _failed(found, started)
        metrics.failure(label, "cancelled")
        raise
    except Exception as e:  # the model itself raised on every try: a server-side failure
        _log.exception("inference failed")
        _failed(found, started)
        metrics.failure(label, "model_error")
        raise ModelFailedError(f"the model failed: {type(e).__name__}: {e}") from e
    elapsed = time.perf_counter() - started
    served.outcomes.succeeded(answer.model_version, elapsed)
    metrics.done(label, elapsed)
    if _log.isEnabledFor(logging.DEBUG):  # log_verbose_level >= 1 (the logging extension)
        _log.debug("model %r version %s answered request %r in %.3f ms", answer.model_name,
                   answer.model_version, answer.request_id, elapsed * 1e3)
    return answer


def _failed(found: ServedModel | None, started: float) -> None:
    if found is not None:
        found.outcomes.failed(found.version, time.perf_counter() - started)
