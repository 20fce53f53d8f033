"""The models a server serves, by name: lookups, the index, and load/unload at run time.

One repository serves both transports (HTTP and gRPC). Each model is a ``ServedModel`` with its
own ``ParallelInference`` pool. Replacing or unloading a model takes it out of the lookup table
first, then drains its pool: requests already submitted to it finish on it, later ones go to the
new model (or get 404 once it is unloaded).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, TypedDict

import anyio

from paraloom.serving.errors import (
    ForbiddenError,
    NotFoundError,
    ProtocolError,
    UnavailableError,
    listed,
    short_repr,
)
from paraloom.serving.repository.directory import Found, NoVersionLoads, Versions
from paraloom.serving.repository.files import check_load_parameters, holds_weights
from paraloom.serving.served import ServedModel

if TYPE_CHECKING:
    from paraloom.inference.parallel import ParallelInference
    from paraloom.serving.repository.directory import ModelsDir

__all__ = ["IndexEntry", "ModelRepository"]

_log = logging.getLogger("paraloom.serving")
# The least time a replaced or unloaded version's admitted requests get to finish: a short
# --graceful-timeout bounds the server's stop, not a reload (it cut queued requests off, 503).
_RETIRE_TIMEOUT = 30.0
_UNLOADED = "unloaded"  # the reason an unloaded model gives
UNKNOWN = "unknown"  # the metrics label of requests for models the server does not have


class IndexEntry(TypedDict):
    """One row of ``/v2/repository/index``."""

    name: str
    version: str
    state: Literal["READY", "UNAVAILABLE"]
    reason: str


@dataclass
class _Entry:
    served: ServedModel | None
    last: ServedModel | None  # the last served model, kept after an unload to serve it again
    rebuild: Callable[[ServedModel], ServedModel] | None
    reason: str = ""
    older: dict[str, ServedModel] = field(default_factory=dict)  # versions below ``served``
    unloaded: list[str] = field(default_factory=list)  # the versions an unload stopped serving
    failed: dict[str, str] = field(default_factory=dict)  # versions that failed to load: why

    def every(self) -> list[ServedModel]:
        """Every version served now, oldest first."""
        return [*self.older.values(), *([self.served] if self.served is not None else [])]


class ModelRepository:
    """Named ``ServedModel``s; with a ``ModelsDir``, models are found and built from it."""

    def __init__(self, source: ModelsDir | None = None) -> None:
        self.source = source
        self._entries: dict[str, _Entry] = {}
        self._locks: dict[str, asyncio.Lock] = {}  # per model, made on the event loop
        self._retiring: dict[ServedModel, asyncio.Task[None]] = {}  # draining, replaced
        self.draining = False
        self.close_deadline: float | None = None
        self.close_timeout: float | None = None
        # Set in each process of ``--processes N``: API loads and unloads are refused with it.
        self.refuse_loads: str | None = None
        # Called with (name, pool) once a replaced or unloaded version's own pool is closed.
        self.on_pool_closed: list[Callable[[str, ParallelInference], None]] = []

    def add(self, served: ServedModel,
            rebuild: Callable[[ServedModel], ServedModel] | None = None,
            older: list[ServedModel] | None = None, failed: Mapping[str, str] | None = None
            ) -> None:
        """Serve ``served`` (and ``older`` versions of it) under its name; ``rebuild`` serves it
        again after an unload; ``failed``: the versions that did not load, and why."""
        self._entries[served.name] = self._entry(served, rebuild, older or [], failed or {})

    def _entry(self, served: ServedModel, rebuild: Callable[[ServedModel], ServedModel] | None,
               older: list[ServedModel], failed: Mapping[str, str]) -> _Entry:
        entry = _Entry(served, served, rebuild, older={s.version: s for s in older},
                       failed=dict(failed))
        for one in entry.every():
            one.close_timeout = self.close_timeout
            one.siblings = entry.every()
        return entry

    def fail(self, name: str, reason: str) -> None:
        """List ``name`` as unavailable for ``reason`` (a model that could not be loaded)."""
        entry = self._entries.get(name)
        if entry is None:
            self._entries[name] = _Entry(None, None, None, reason)
        elif entry.served is None:
            entry.reason = reason

    def get(self, name: str, version: str | None = None) -> ServedModel:
        """The model serving ``name`` (and ``version``, when given); ``NotFoundError`` if none."""
        entry = self._entries.get(name)
        if entry is None:
            raise NotFoundError(f"unknown model {short_repr(name)}; this server serves "
                                f"{listed(self.models())}" + self._unavailable())
        if entry.served is None and entry.reason not in ("", _UNLOADED):
            # It failed to load: loading it again fails the same way; the reason says why.
            raise NotFoundError(f"model {name!r} is not loaded: {entry.reason}")
        if entry.served is None:
            raise NotFoundError(f"model {name!r} is not loaded (unloaded); load it with POST "
                                f"/v2/repository/models/{name}/load (gRPC: "
                                "RepositoryModelLoad)")
        if version is not None and version in entry.older:
            return entry.older[version]
        if version is not None and version in entry.failed:
            raise NotFoundError(f"model {name!r} version {version} is not loaded: "
                                f"{entry.failed[version]}; it serves versions "
                                f"{[s.version for s in entry.every()]}")
        if entry.older and version is not None and version != entry.served.version:
            raise NotFoundError(f"model {name!r} has no version {version!r}; it serves versions "
                                f"{[s.version for s in entry.every()]} (or leave the version "
                                "out of the URL for the latest)")
        entry.served.check_version(version)
        return entry.served

    def _unavailable(self) -> str:
        """``"; not serving: [...]"`` for the models known but not loaded ("" if none)."""
        down = [n for n, e in self._entries.items() if e.served is None]
        return f" (not serving now: {listed(down)})" if down else ""

    def is_ready(self, name: str, version: str | None = None) -> bool:
        """Whether ``name`` takes requests: False once unloaded; ``NotFoundError`` if unknown."""
        entry = self._entries.get(name)
        if entry is not None and (entry.served is None or version in entry.failed):
            return False
        return self.get(name, version).ready

    def label(self, name: str) -> str:
        """The metrics label for requests naming ``name`` (bounded: unknown names share one)."""
        return name if name in self._entries else UNKNOWN

    def models(self) -> dict[str, ServedModel]:
        """The models loaded now, by name (their latest version)."""
        return {n: e.served for n, e in self._entries.items() if e.served is not None}

    def every(self) -> list[ServedModel]:
        """Every version of every model loaded now."""
        return [s for e in self._entries.values() for s in e.every()]

    def pools(self) -> dict[str, ParallelInference]:
        """The pools serving now: the latest version's by model name, other versions' as
        ``name/version``."""
        pools = {n: s.pool for n, s in self.models().items()}
        for name, entry in self._entries.items():
            pools.update({f"{name}/{v}": s.pool for v, s in entry.older.items()})
        return pools

    def served_pools(self) -> dict[str, list[tuple[ParallelInference, int]]]:
        """Every pool serving now and its version, by model name, latest last (for metrics):
        a replaced or unloaded version's pool until it is closed (``on_pool_closed``) too."""
        pools: dict[str, list[tuple[ParallelInference, int]]] = {}
        for served in [*self._retiring, *self.every()]:
            pools.setdefault(served.name, []).append((served.pool, int(served.version)))
        return pools

    @property
    def ready(self) -> bool:
        """Whether the server takes requests: not shutting down, every loaded model ready."""
        return not self.draining and all(s.ready for s in self.every())

    def index(self, found: Mapping[str, Found] | None = None) -> list[IndexEntry]:
        """Every model known (loaded, unloaded, failed, or in the models directory); a model
        serving several versions has a row per version. ``found``: the directory's models as
        ``scan()`` gave them (scanned here where not given; on the event loop, use
        ``await index_off_loop()``, which scans in a thread)."""
        rows: dict[str, list[IndexEntry]] = {}
        if found is None:
            found = self.scan()
        for name, one in found.items():
            versions = [str(v) for v in one.versions] or [""]
            rows[name] = [{"name": name, "version": v, "state": "UNAVAILABLE",
                           "reason": one.error or "not loaded"} for v in versions]
        return self._index_entries(rows)

    async def index_off_loop(self) -> list[IndexEntry]:
        """``index()``, the models directory read in a worker thread: it parses every config,
        which on the event loop held every other request up (0.4 s for 400 folders)."""
        return self.index(await anyio.to_thread.run_sync(self.scan))

    def scan(self) -> dict[str, Found]:
        """What the models directory holds now ({} without one)."""
        return {} if self.source is None else self.source.scan()

    def _index_entries(self, rows: dict[str, list[IndexEntry]]) -> list[IndexEntry]:
        """``rows`` (the directory's models) with the served and unloaded models' rows."""
        for name, entry in self._entries.items():
            if entry.served is not None:
                served: list[IndexEntry] = [
                    {"name": name, "version": s.version,
                     "state": "READY" if s.ready else "UNAVAILABLE",
                     "reason": "" if s.ready else "shutting down"} for s in entry.every()]
                served += [{"name": name, "version": v, "state": "UNAVAILABLE", "reason": r}
                           for v, r in entry.failed.items()]
                rows[name] = sorted(served, key=lambda row: int(row["version"] or 0))
            elif entry.reason or name not in rows:
                versions = entry.unloaded or [entry.last.version if entry.last is not None
                                              else ""]
                rows[name] = [{"name": name, "version": v, "state": "UNAVAILABLE",
                               "reason": entry.reason or _UNLOADED} for v in versions]
        return [row for n in sorted(rows) for row in rows[n]]

    def _check_open(self, trusted: bool = False) -> None:
        if self.refuse_loads is not None and not trusted:
            raise ForbiddenError(self.refuse_loads)
        if self.draining:
            raise UnavailableError("the server is shutting down: no loads or unloads",
                                   reason="shutting_down")

    def _guard(self, name: str) -> asyncio.Lock:
        """One load or unload of ``name`` at a time; other models' go on meanwhile (one lock
        for all held every load behind another model's drain)."""
        return self._locks.setdefault(name, asyncio.Lock())

    async def load(self, name: str, parameters: Mapping[str, object], *, trusted: bool = False
                   ) -> str:
        """Load, reload or replace ``name``; returns the version now served.

        ``parameters.path`` swaps the weights of the loaded model in place (its pool stays);
        otherwise a models-directory model is built anew from the directory (a new pool: config
        changes apply) and replaces the old one, whose in-flight requests finish on it.
        ``trusted``: asked by the operator (SIGHUP), not a client; ``refuse_loads`` does not apply.
        """
        replaced: list[ServedModel] = []
        try:
            async with self._guard(name):
                self._check_open(trusted)
                entry = self._entries.get(name)
                current = entry.served if entry is not None else None
                if current is not None and (self.source is None or "path" in parameters):
                    return await current.load(parameters)
                built = await self._build(name, entry, parameters)
                *older, new = built.served
                self._entries[name] = self._entry(new, entry.rebuild if entry else None, older,
                                                  built.failed)
                replaced = entry.every() if entry is not None else []
                if "path" in parameters:
                    return await new.load(parameters)
                return new.version
        finally:  # the new version serves; the old ones finish what they took, off the lock
            await self._retire(replaced)

    async def reload(self) -> dict[str, str]:
        """Reload every model, as the operator's SIGHUP asks: the served file again, or each
        model of the models directory that is not unloaded (new folders too); returns the
        version each now serves. A model that fails to load is logged and keeps its old
        version (or stays unavailable), and the others still reload."""
        names = set(self._entries) if self.source is None else set(
            await anyio.to_thread.run_sync(self.scan))
        names -= {n for n, e in self._entries.items()
                  if e.served is None and e.reason == _UNLOADED}
        versions: dict[str, str] = {}
        for name in sorted(names):
            try:
                versions[name] = await self.load(name, {}, trusted=True)
            except (ProtocolError, NotFoundError, UnavailableError) as e:
                _log.error("reload of model %r failed: %s", name, e)
        return versions

    async def _build(self, name: str, entry: _Entry | None, parameters: Mapping[str, object]
                     ) -> Versions:
        check_load_parameters(parameters)  # the same refusals as a weights load
        if self.source is not None:
            found = await anyio.to_thread.run_sync(self.source.find, name)
            last = entry.last if entry is not None else None
            if not found.numbered and found.path is not None and last is not None:
                # No version folders: each build of new weights is the next version, as a
                # reload of a served file is, so a request pinned to the old one never gets
                # them; the weights it serves keep their version (Triton's is the folder's).
                same = last.model is not None and await anyio.to_thread.run_sync(
                    holds_weights, found.path, last.model)
                found = replace(found, version=int(last.version) + (0 if same else 1))
            try:
                built = await anyio.to_thread.run_sync(self.source.build_versions, found)
            except (ValueError, TypeError, RuntimeError, OSError) as e:
                kept = entry is not None and entry.served is not None
                if not kept:
                    self.fail(name, str(e))
                elif isinstance(e, NoVersionLoads) and entry is not None:
                    # The index lists the new versions as UNAVAILABLE, with why, as Triton does.
                    serving = {s.version for s in entry.every()}
                    entry.failed.update({v: r for v, r in e.failed.items() if v not in serving})
                raise ProtocolError(f"model {name!r} could not be loaded: {e}"
                                    + ("; the old version keeps serving" if kept else "")) from e
        elif entry is not None and entry.rebuild is not None and entry.last is not None:
            built = Versions([await anyio.to_thread.run_sync(entry.rebuild, entry.last)])
        else:
            raise NotFoundError(f"unknown model {short_repr(name)}; this server serves "
                                f"{listed(self._entries)} and has no models directory to "
                                "load others from (paraloom serve --models-dir DIR)")
        _log.info("model %r loaded, versions %s", name, [s.version for s in built.served])
        for version, reason in built.failed.items():
            _log.error("model %r version %s not loaded: %s", name, version, reason)
        return built

    async def unload(self, name: str) -> None:
        """Stop serving ``name``; its in-flight requests finish first (bounded)."""
        async with self._guard(name):
            self._check_open()
            entry = self._entries.get(name)
            if entry is None:
                raise NotFoundError(f"unknown model {short_repr(name)}; this server serves "
                                    f"{listed(self._entries)}")
            retired = entry.every()
            entry.served, entry.older, entry.reason, entry.failed = None, {}, _UNLOADED, {}
            entry.unloaded = [s.version for s in retired]
        await self._retire(retired)
        if retired:
            _log.info("model %r unloaded", name)

    async def _retire(self, models: list[ServedModel]) -> None:
        """Close ``models`` (out of the lookup table already): their admitted requests finish
        first, for at least ``_RETIRE_TIMEOUT`` s. The caller waits for it, but a caller that is
        cancelled (a client gone) leaves it running, and ``close()`` cuts it to its deadline."""
        timeout = max(self.close_timeout or 0.0, _RETIRE_TIMEOUT)
        tasks = []
        for served in models:
            task = asyncio.ensure_future(served.close(timeout=timeout))
            self._retiring[served] = task
            task.add_done_callback(functools.partial(self._retired, served))
            tasks.append(task)
        if tasks:
            await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))  # logged

    def _retired(self, served: ServedModel, task: asyncio.Task[None]) -> None:
        self._retiring.pop(served, None)
        if served.owns_pool:  # a caller's pool stays open: it may serve again and count on
            for hook in self.on_pool_closed:
                hook(served.name, served.pool)
        if not task.cancelled() and task.exception() is not None:
            _log.error("closing a version of model %r failed: %s", served.name,
                       task.exception())

    def stop_taking_requests(self) -> None:
        """Not ready, and every new request refused (503); those admitted still run."""
        self.draining = True
        for served in self.every():
            served.draining = True

    async def close(self) -> None:
        """Stop taking requests; drain every pool the server owns (until ``close_deadline``,
        a ``time.monotonic()`` the server's shutdown set, if any)."""
        self.stop_taking_requests()
        models = [*self.every(), *self._retiring]  # a replaced version still draining too
        left = None if self.close_deadline is None else \
            max(0.0, self.close_deadline - time.monotonic())
        await asyncio.gather(*(s.close(left) for s in models))

