"""One model behind the server: its pool, signature, version checks, inference and reloads."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import anyio
import torch
from torch import nn

from paraloom.inference.config import InferenceMode
from paraloom.inference.errors import (
    InferenceClosedError,
    InvalidRequestError,
    ModelUpdateError,
    QueueFullError,
    RequestTimeoutError,
)
from paraloom.serving.errors import (
    ForbiddenError,
    NotFoundError,
    ProtocolError,
    ServingError,
    UnavailableError,
)
from paraloom.serving.handlers import HandlerFailedError
from paraloom.serving.repository.binding import BoundModel
from paraloom.serving.repository.files import same_state
from paraloom.serving.signature import ModelSignature, TensorMetadata, probe_input
from paraloom.serving.statistics import RequestTotals

if TYPE_CHECKING:
    from paraloom.devices import DeviceSpec
    from paraloom.inference.parallel import ParallelInference
    from paraloom.precision import Precision
    from paraloom.serving.handlers import Handler
    from paraloom.serving.repository.files import ModelFiles

__all__ = ["MODEL_THREADS", "ModelMetadata", "PoolOptions", "ServedModel", "build_pool"]

MODEL_THREADS = 16
"""The worker threads each served model has for its handler's calls and its in-place requests
(the server's other work shares anyio's 40)."""

_DRAIN_POLL_S = 0.01  # how often a closing in-place model checks for requests still running


class ModelMetadata(TypedDict):
    """The v2 model metadata object (``GET /v2/models/{name}``)."""

    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class PoolOptions(TypedDict, total=False):
    """The ``ParallelInference`` options a server builds a pool with (its keyword arguments)."""

    inference_mode: InferenceMode | str
    workers: int | None
    batch_limit: int
    queue_limit: int
    max_wait_ms: float
    timeout: float | None
    devices: DeviceSpec
    precision: str | Precision
    example_input: object
    threads_per_worker: int | None


_log = logging.getLogger("paraloom.serving")


class _GatewayTimeoutError(ServingError):
    status = 504
    reason = "timeout"


class ServedModel:
    """A named ``ParallelInference`` pool with the signature and file rules the server enforces."""

    def __init__(self, name: str, pool: ParallelInference, model: nn.Module | None,
                 signature: ModelSignature, *, files: ModelFiles, owns_pool: bool,
                 retry_after: int = 1, first_version: int = 1, numbered: bool = False,
                 handler: Handler | None = None, batch_dim: bool = True,
                 labels: dict[str, list[str]] | None = None,
                 version_policy: dict[str, Any] | None = None,
                 weights_file: str = "model.safetensors",
                 tensor_config: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.name = name
        self.tensor_config = dict(tensor_config or {})
        """Fields of a tensor's entry in the repository's config, by tensor name, that
        ``/config`` gives back as written (``reshape``, ``label_filename``)."""
        self.weights_file = weights_file  # a numbered version folder's file (model.pt, ...)
        self.version_policy = version_policy or {"latest": {"num_versions": 1}}
        """Triton's ``version_policy`` for ``/config``: the repository config's, else the
        latest version."""
        self.handler = handler
        """The model's ``handler.py`` (then ``signature`` is the handler's), or None."""
        self.first_version = first_version  # the version the pool's first model is served as
        self.numbered = numbered
        """Whether the version is a numbered folder of a repository: its weights then stay."""
        self.pool = pool
        self.model = model
        self.signature = signature
        self.files = files
        self.owns_pool = owns_pool
        self.retry_after = retry_after
        self.draining = False
        self._load_lock = asyncio.Lock()
        self._inplace = pool.inference_mode is InferenceMode.INPLACE
        # In place, requests wait on threads for a free replica: at most this many at once.
        self._inplace_limit = pool.workers + pool.queue_limit
        self._inplace_now = 0  # changed on the event loop only
        self._admitted = 0  # requests past their lookup, not yet answered by the pool
        self._threads: anyio.CapacityLimiter | None = None  # made on the event loop
        self.close_timeout: float | None = None  # the server sets its graceful timeout here
        self.siblings: list[ServedModel] = [self]  # every version of this model served now
        self.outcomes = RequestTotals()
        """The requests answered and failed, by version (Triton's statistics)."""
        self.labels = labels or {}
        """Class labels by output name, for the classification extension."""
        self.batch_dim = batch_dim
        """Whether the signature's shapes begin with the rows (False: a ``config.pbtxt`` with
        ``max_batch_size: 0``)."""
        if self.batched and signature.rowless:
            if owns_pool:
                pool.close()
            raise ValueError(
                f"the model returned outputs {list(signature.rowless)} without a row per input "
                "row on its probe input (a model whose output has no batch dimension, e.g. "
                "x.sum(0)): batching requests would answer each with other requests' results; "
                "return a row per input row, or serve it unbatched (max_batch_size: 0 in "
                "config.pbtxt; paraloom serve --mode sequential or inplace, "
                "inference_mode= in Python)")

    @property
    def version(self) -> str:
        """The version now served, as the protocol's string."""
        return self._served_as(self.pool.model_version)

    def _served_as(self, generation: int) -> str:
        """The version the pool's ``generation`` of the model is served as. The pool counts its
        own (``model_version``: 1, then +1 per ``update_model``); a repository's numbered
        folders start elsewhere (``first_version``)."""
        return str(self.first_version + generation - 1)

    def check_version(self, version: str | None) -> None:
        """Raise ``NotFoundError`` unless ``version`` (None: any) is the one served."""
        if version is not None and version != self.version:
            raise NotFoundError(f"model {self.name!r} has no version {version!r}; it serves "
                                f"version {self.version!r} (or leave the version out of the URL)")

    @property
    def platform(self) -> str:
        """Triton's platform name: ``pytorch_libtorch`` for TorchScript, else ``pytorch``."""
        inner = self.model.model if isinstance(self.model, BoundModel) else self.model
        return "pytorch_libtorch" if isinstance(inner, torch.jit.ScriptModule) else "pytorch"

    @property
    def batched(self) -> bool:
        """Whether each output row answers an input row: the pool merges requests, or the
        model declares a batch dimension (``max_batch_size``)."""
        return self.merges_requests or (self.batch_dim and self.signature.max_rows > 0)

    @property
    def merges_requests(self) -> bool:
        """Whether the pool merges requests row by row (every input then gives as many rows);
        a sequential pool runs each request as it came, rows counted off the first input."""
        return self.batch_dim and self.pool.inference_mode is InferenceMode.BATCHED

    @property
    def threads(self) -> anyio.CapacityLimiter:
        """This model's own worker threads (``MODEL_THREADS``), for its handler's calls and
        its in-place requests: a slow model waits for its own, and holds none of the threads
        the server's other work shares (80 requests on a handler that slept 5 s took all 40
        of those, and another model's requests waited 8.6 s)."""
        if self._threads is None:
            self._threads = anyio.CapacityLimiter(MODEL_THREADS)
        return self._threads

    @property
    def ready(self) -> bool:
        """Whether new requests will be accepted."""
        return not self.draining and not self.pool.closed

    def metadata(self) -> ModelMetadata:
        """The v2 model metadata object."""
        return {"name": self.name, "versions": [s.version for s in self.siblings],
                "platform": self.platform,
                "inputs": [s.as_json() for s in self.signature.inputs],
                "outputs": [s.as_json() for s in self.signature.outputs]}

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """Take a request in: from its lookup to its answer from the pool, a ``close()`` (an
        unload, a replacement, the server's stop) waits for it (within its timeout), so a
        request in its handler's preprocess is answered by the model it was looked up on.
        ``UnavailableError`` once the model is closing."""
        self._refuse_if_draining()
        self._admitted += 1
        try:
            yield
        finally:
            self._admitted -= 1

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise UnavailableError("the server is shutting down and takes no new requests",
                                   reason="shutting_down", retry_after=self.retry_after)

    async def infer(self, tensors: list[torch.Tensor], *, admitted: bool = False,
                    timeout: float | None = None) -> tuple[Any, str]:
        """Run one request through the pool; returns the model's result (whatever the user's
        model returned) and the version that ran it. ``admitted``: the request holds an
        ``admitted()`` ticket, so it runs even if the model began closing after its lookup.
        ``timeout``: the request's own time limit in seconds, below the pool's (None: the
        pool's)."""
        if not admitted:
            self._refuse_if_draining()
        x: torch.Tensor | tuple[torch.Tensor, ...] = \
            tensors[0] if len(tensors) == 1 else tuple(tensors)
        time_limit: dict[str, float | None] = {}  # none given: the pool's default
        if timeout is not None:
            default = getattr(self.pool, "timeout", None)  # a pool of the caller's may lack it
            time_limit["timeout"] = timeout if default is None else min(timeout, default)
        try:
            if self._inplace:
                result, generation = await self._infer_inplace(x, time_limit)
            else:  # queued: a full queue must answer 503 now, not block the event loop
                future = self.pool.submit(x, block=False, return_version=True, **time_limit)
                result, generation = await asyncio.wrap_future(future)
        except QueueFullError as e:
            raise UnavailableError(f"the inference queue is full ({e}); retry after "
                                   f"{self.retry_after} s", reason="queue_full",
                                   retry_after=self.retry_after) from e
        except InferenceClosedError as e:
            raise UnavailableError(f"the model is not serving: {e}", reason="shutting_down",
                                   retry_after=self.retry_after) from e
        except InvalidRequestError as e:
            if self.handler is not None:  # the model got what the handler made of the request
                raise _preprocess_misfit(self.handler.path.name, e) from e
            raise ProtocolError(str(e)) from e
        except RequestTimeoutError as e:
            raise _GatewayTimeoutError(str(e)) from e
        return result, self._served_as(generation)

    async def _infer_inplace(self, x: torch.Tensor | tuple[torch.Tensor, ...],
                             time_limit: dict[str, float | None]) -> tuple[Any, int]:
        """Run x on a thread that waits for a free replica; QueueFullError past the limit.
        Returns the model's result and the pool's generation that ran it."""
        limit = self._inplace_limit
        if self._inplace_now >= limit:
            raise QueueFullError(f"{self._inplace_now} requests are running or waiting for a "
                                 f"replica, the most this pool takes (workers + queue_limit = "
                                 f"{limit}); retry later, or add workers or raise queue_limit")
        self._inplace_now += 1
        try:
            # In place, submit() runs the model in the calling thread, so it runs on a worker
            # thread; it waits for a free replica as the pool's own output_async does.
            future = await anyio.to_thread.run_sync(functools.partial(
                self.pool.submit, x, block=True, return_version=True, **time_limit),
                limiter=self.threads)
            result, generation = await asyncio.wrap_future(future)
            return result, generation
        finally:
            self._inplace_now -= 1

    async def load(self, parameters: Mapping[str, object]) -> str:
        """Swap in the weights a load request names (see ``ModelFiles``); returns the version:
        the next one, or the one served where the file holds the weights it serves."""
        if self.numbered:
            versions = [s.version for s in self.siblings]
            raise ProtocolError(
                f"model {self.name!r} serves numbered versions {versions}, each its folder's "
                f"weights, so a path cannot swap them: add the new weights as the next "
                f"numbered folder ({int(self.version) + 1}/{self.weights_file} in the model's "
                f"folder) and load {self.name!r} without a path")
        path = self.files.resolve(parameters)
        if self.model is None:
            raise ForbiddenError("this server was given a pool without model=, so it cannot "
                                 "build new versions; pass model= to create_app")
        async with self._load_lock:  # two loads at once would race on self.model
            self._check_serving()
            model = await anyio.to_thread.run_sync(self.files.build, path, self.model)
            if await anyio.to_thread.run_sync(same_state, model.state_dict(),
                                              self.model.state_dict()):
                return self.version  # as Triton's version stays its folder's: nothing new
            try:
                await anyio.to_thread.run_sync(self.pool.update_model, model)
            except ModelUpdateError as e:
                raise ProtocolError(f"{path.name} could not be served, the old version keeps "
                                    f"serving: {e}") from e
            except InferenceClosedError as e:
                raise self._shutting_down(f"cannot load {path.name}: {e}") from e
            self.model = model
        return self.version

    def _check_serving(self) -> None:
        if self.draining or self.pool.closed:
            raise self._shutting_down("the model is not serving: the server is shutting down")

    def _shutting_down(self, message: str) -> UnavailableError:
        return UnavailableError(f"{message}; retry after {self.retry_after} s, or on a running "
                                "server", reason="shutting_down", retry_after=self.retry_after)

    async def close(self, timeout: float | None = None) -> None:
        """Stop taking requests; if the server owns the pool, drain it within the timeout.

        ``timeout`` None: the server's ``close_timeout`` (None there too: wait for the drain).
        """
        self.draining = True
        timeout = self.close_timeout if timeout is None else timeout
        # Requests already admitted (in a handler's preprocess, or, in place, waiting for a
        # replica: an in-place pool has no queue to drain, its waiting requests are callers).
        timeout = await self._drained(timeout, lambda: self._admitted + self._inplace_now)
        if self.owns_pool:
            await anyio.to_thread.run_sync(lambda: self.pool.close(drain=True, timeout=timeout))

    @staticmethod
    async def _drained(timeout: float | None, busy: Callable[[], int]) -> float | None:
        """Wait (up to ``timeout``) until ``busy()`` is 0; the time left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while busy() and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(_DRAIN_POLL_S)
        return None if deadline is None else max(0.0, deadline - time.monotonic())


def build_pool(model: nn.Module, signature: ModelSignature,
               sample: torch.Tensor | Sequence[torch.Tensor] | None, probed: bool,
               pool_options: PoolOptions) -> ParallelInference:
    """ParallelInference(model), warmed on the signature's probe so errors are blamed right."""
    from paraloom.inference.parallel import ParallelInference

    options = pool_options.copy()
    if options.get("example_input") is not None:
        return ParallelInference(model, **options)
    # An input the model is known to accept: a later failure of one request is then that
    # request's fault (400), while a model failing on everything is the model's (500).
    options["example_input"] = probe_input(signature, sample)
    if probed or options["example_input"] is None:
        return ParallelInference(model, **options)
    try:
        return ParallelInference(model, **options)
    except ValueError as e:
        # Declared outputs: zeros shaped as declared may not be an input the model accepts
        # (the warm-up fails before any worker starts); then nothing is known until a
        # request succeeds, and no error is raised here, but the operator is told.
        _log.warning("the model failed on zeros shaped as its declared inputs (%s); if the "
                     "declared shapes are wrong every request will fail: %s",
                     ", ".join(f"{s.name} {list(s.shape)}" for s in signature.inputs), e)
        options["example_input"] = None
        return ParallelInference(model, **options)


def _preprocess_misfit(handler: str, error: InvalidRequestError) -> ServingError:
    """A 500 for a model that failed on what a handler's preprocess returned: the request
    matched the handler's INPUTS, so the handler (or the model) is at fault, not the client."""
    cause = error.__cause__
    failed = f"{type(cause).__name__}: {cause}" if cause is not None else str(error)
    if error.expected:
        wanted = f", the model takes {error.expected}; make preprocess return that"
    elif cause is not None:  # the model raised, and no input has run on this version yet
        wanted = (", the model takes an input it accepts (none has run on this version yet); "
                  "make preprocess return one")
    else:  # refused before the model ran (0 rows): the error says why
        wanted = "; make preprocess return what the model takes"
    return HandlerFailedError(f"the model failed on what {handler} preprocess returned for this "
                              f"request ({failed}): preprocess gave {error.received}{wanted}")
