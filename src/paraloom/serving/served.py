"""One model behind the server: its pool, signature, version checks, inference and reloads."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import anyio
import torch
from torch import nn

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
from paraloom.serving.repository import ModelFiles
from paraloom.serving.signature import ModelSignature

__all__ = ["ServedModel"]


class _GatewayTimeoutError(ServingError):
    status = 504
    reason = "timeout"


class ServedModel:
    """A named ``ParallelInference`` pool with the signature and file rules the server enforces."""

    def __init__(self, name: str, pool: Any, model: nn.Module | None, signature: ModelSignature, *,
                 files: ModelFiles, owns_pool: bool, retry_after: int = 1) -> None:
        self.name = name
        self.pool = pool
        self.model = model
        self.signature = signature
        self.files = files
        self.owns_pool = owns_pool
        self.retry_after = retry_after
        self.draining = False
        self._load_lock = asyncio.Lock()
        self._inplace = str(getattr(pool, "inference_mode", "")).lower().endswith("inplace")

    @property
    def version(self) -> str:
        """The version now served, as the protocol's string."""
        return str(self.pool.model_version)

    def check(self, name: str, version: str | None = None) -> None:
        """Raise ``NotFoundError`` unless this is the model (and version) named in the URL."""
        if name != self.name:
            raise NotFoundError(f"unknown model {name!r}; this server serves {self.name!r}")
        if version is not None and version != self.version:
            raise NotFoundError(f"model {name!r} has no version {version!r}; it serves version "
                                f"{self.version!r} (or leave the version out of the URL)")

    @property
    def ready(self) -> bool:
        """Whether new requests will be accepted."""
        return not self.draining and not getattr(self.pool, "closed", False)

    def metadata(self) -> dict[str, Any]:
        """The v2 model metadata object."""
        return {"name": self.name, "versions": [self.version], "platform": "pytorch",
                "inputs": [s.as_json() for s in self.signature.inputs],
                "outputs": [s.as_json() for s in self.signature.outputs]}

    async def infer(self, tensors: list[torch.Tensor]) -> tuple[Any, str]:
        """Run one request through the pool; returns the model's result and the version used."""
        if self.draining:
            raise UnavailableError("the server is shutting down and takes no new requests",
                                   reason="shutting_down", retry_after=self.retry_after)
        x: Any = tensors[0] if len(tensors) == 1 else tuple(tensors)
        try:
            if self._inplace:
                # In place, submit() runs the model in the calling thread, so it runs on a worker
                # thread; it waits for a free replica as the pool's own output_async does.
                future = await anyio.to_thread.run_sync(functools.partial(
                    self.pool.submit, x, block=True, return_version=True))
            else:  # queued: a full queue must answer 503 now, not block the event loop
                future = self.pool.submit(x, block=False, return_version=True)
            result, version = await asyncio.wrap_future(future)
        except QueueFullError as e:
            raise UnavailableError(f"the inference queue is full ({e}); retry after "
                                   f"{self.retry_after} s", reason="queue_full",
                                   retry_after=self.retry_after) from e
        except InferenceClosedError as e:
            raise UnavailableError(f"the model is not serving: {e}", reason="shutting_down",
                                   retry_after=self.retry_after) from e
        except InvalidRequestError as e:
            raise ProtocolError(str(e)) from e
        except RequestTimeoutError as e:
            raise _GatewayTimeoutError(str(e)) from e
        return result, str(version)

    async def load(self, parameters: dict[str, Any]) -> str:
        """Swap in the weights a load request names (see ``ModelFiles``); returns the version."""
        path = self.files.resolve(parameters)
        if self.model is None:
            raise ForbiddenError("this server was given a pool without model=, so it cannot "
                                 "build new versions; pass model= to create_app")
        async with self._load_lock:  # two loads at once would race on self.model
            model = await anyio.to_thread.run_sync(self.files.build, path, self.model)
            try:
                await anyio.to_thread.run_sync(self.pool.update_model, model)
            except ModelUpdateError as e:
                raise ProtocolError(f"{path.name} could not be served, the old version keeps "
                                    f"serving: {e}") from e
            self.model = model
        return self.version

    async def close(self) -> None:
        """Stop taking requests; if the server owns the pool, drain and close it."""
        self.draining = True
        if self.owns_pool:
            await anyio.to_thread.run_sync(lambda: self.pool.close(drain=True))
