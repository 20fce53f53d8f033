"""The ASGI app: Open Inference Protocol (v2) endpoints over a ParallelInference pool, or over
every model of a models directory."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from starlette.applications import Starlette
from torch import nn

from paraloom.serving.metrics import ServingMetrics
from paraloom.serving.repository.binding import bind
from paraloom.serving.repository.directory import ModelsDir
from paraloom.serving.repository.files import ModelFiles
from paraloom.serving.repository.models import ModelRepository
from paraloom.serving.routes import EXCEPTION_HANDLERS, ROUTES
from paraloom.serving.served import PoolOptions, ServedModel, build_pool
from paraloom.serving.shared_memory import SharedMemoryRegistry, on_by_default
from paraloom.serving.signature import ModelSignature, TensorSpec, infer_signature

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from paraloom.inference.parallel import ParallelInference

__all__ = ["AppOptions", "create_app", "create_repository_app", "repository_of",
           "settle_shared_memory"]

_log = logging.getLogger("paraloom.serving")


class AppOptions(PoolOptions, total=False):
    """``create_app``'s keyword arguments after ``name``: what ``serve`` passes through to it."""

    model: nn.Module | None
    sample: torch.Tensor | Sequence[torch.Tensor] | None
    inputs: Sequence[TensorSpec] | None
    outputs: Sequence[TensorSpec] | None
    max_body_bytes: int
    model_file: str | None
    model_dir: str | None
    retry_after: int
    shared_memory: bool | None


def repository_of(app: Starlette) -> ModelRepository | None:
    """The models an app from ``create_app`` or ``create_repository_app`` serves; None for
    another app."""
    repository = getattr(app.state, "repository", None)
    return repository if isinstance(repository, ModelRepository) else None


def _check_pool(pool_or_model: object, model: nn.Module | None, pool_options: PoolOptions
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
               shared_memory: bool | None = None, **pool_options: Unpack[PoolOptions]
               ) -> Starlette:
    """An ASGI app serving a model (or an existing ParallelInference) under the v2 protocol.

    Given a model, the app builds ``ParallelInference(model, **pool_options)`` and closes it,
    draining, at shutdown; a pool passed in stays the caller's to close (pass ``model=``, the
    module it serves, to describe it and to load new weights). The signature comes from
    ``inputs``/``outputs``, a ``sample`` input, or the model's first layer; declared ``inputs``
    named after ``forward``'s parameters are passed by name, as in a models directory
    (``paraloom.serving.repository.binding``). Remote loads may read
    only ``model_file`` or ``.safetensors`` files in ``model_dir`` (see ``ModelFiles``).
    ``shared_memory`` serves Triton's system shared memory extension (see
    ``paraloom.serving.shared_memory``): clients may then name segments of this host's shared
    memory, to be read and written. None (default): on when ``serve`` or ``ServerThread``
    binds a loopback address with one process, off otherwise (also under another ASGI
    server); True: on wherever it is served; False: off.
    """
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes={max_body_bytes}; expected a positive byte count")
    files = ModelFiles(model_file=model_file, model_dir=model_dir)
    _check_pool(pool_or_model, model, pool_options)
    owns = isinstance(pool_or_model, nn.Module)
    if isinstance(pool_or_model, nn.Module):
        if inputs is not None:  # declared inputs named after forward's parameters go by name
            pool_or_model = bind(pool_or_model, inputs, outputs or ())
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

    repository = ModelRepository()
    repository.add(served, rebuild)
    app = _app(repository, max_body_bytes, shared_memory)
    app.state.served = served
    return app


def create_repository_app(models_dir: str | Path, *, max_body_bytes: int = 16 << 20,
                          retry_after: int = 1, allow_handlers: bool = False,
                          allow_torchscript: bool = False,
                          shared_memory: bool | None = None,
                          **pool_defaults: Unpack[PoolOptions]
                          ) -> Starlette:
    """An ASGI app serving every model in ``models_dir`` (see ``paraloom.serving.repository``).

    Each model gets its own ``ParallelInference``, built with ``pool_defaults`` overridden by
    the model's config. Models that fail to load are listed as UNAVAILABLE with the reason.
    ``allow_handlers`` imports and runs a model folder's ``handler.py`` (code from the
    repository: off by default; such a model is then UNAVAILABLE, saying how to allow it).
    ``allow_torchscript`` serves TorchScript ``model.pt`` files in Triton's layout (a
    ``config.pbtxt`` beside numbered version folders; see ``paraloom.serving.repository.triton``);
    off by default, as a TorchScript archive is a program. ``shared_memory``: as for
    ``create_app``.
    """
    if max_body_bytes <= 0:
        raise ValueError(f"max_body_bytes={max_body_bytes}; expected a positive byte count")
    source = ModelsDir(models_dir, pool_defaults=pool_defaults, retry_after=retry_after,
                       allow_handlers=allow_handlers, allow_torchscript=allow_torchscript)
    repository = ModelRepository(source)
    try:
        for name, found in source.scan().items():
            try:
                versions = source.build_versions(found)
                for version, reason in versions.failed.items():
                    _log.error("model %r version %s not loaded: %s", name, version, reason)
                *older, latest = versions.served
                repository.add(latest, older=older, failed=versions.failed)
            except (ValueError, TypeError, RuntimeError, OSError) as e:
                _log.error("model %r not loaded: %s", name, e)
                repository.fail(name, str(e))
    except BaseException:
        for served in repository.every():
            served.pool.close(drain=False)
        raise
    app = _app(repository, max_body_bytes, shared_memory)
    app.state.served = None
    return app


def settle_shared_memory(app: Starlette, host: str, processes: int = 1) -> None:
    """Turn an app's shared memory on when it was left to "auto" (``shared_memory=None``), it
    is served on a loopback ``host``, and by one process; ``serve`` and ``ServerThread`` call
    it. An app served otherwise (another ASGI server, ``reuse_port``) keeps it off."""
    if not getattr(app.state, "shared_memory_auto", False):
        return
    regions: SharedMemoryRegistry | None = app.state.regions
    if on_by_default(host, processes):
        app.state.regions = regions or SharedMemoryRegistry()
    elif regions is not None:
        regions.close()
        app.state.regions = None


def _app(repository: ModelRepository, max_body_bytes: int, shared_memory: bool | None
         ) -> Starlette:
    app_metrics = ServingMetrics()
    app_metrics.watch(repository.served_pools)
    repository.on_pool_closed.append(app_metrics.retired)
    # "auto" (None) stays off until settle_shared_memory sees where the app is served.

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await repository.close()
        regions = app.state.regions
        if regions is not None:
            regions.close()

    app = Starlette(routes=ROUTES, lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)
    app.state.repository, app.state.metrics = repository, app_metrics
    app.state.max_body_bytes = max_body_bytes
    app.state.regions = SharedMemoryRegistry() if shared_memory is True else None
    app.state.shared_memory_auto = shared_memory is None
    return app
