"""Running the app under uvicorn: ``serve`` (blocking) and ``ServerThread`` (in the background)."""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING

import uvicorn
from starlette.applications import Starlette
from torch import nn
from uvicorn.config import LOGGING_CONFIG

from paraloom.serving.app import AppOptions, create_app, repository_of, settle_shared_memory
from paraloom.serving.http1 import GuardedHttpTools
from paraloom.serving.sockets import bind_socket

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from paraloom.inference.parallel import ParallelInference
    from paraloom.serving.grpc.service import GrpcEndpoint

__all__ = ["GRPC_BACKENDS", "ServerThread", "bind_socket", "close_owned_pools",
           "resolve_grpc_backend", "serve"]

GRPC_BACKENDS = ("auto", "uvicorn", "grpcio")
"""What serves gRPC: uvicorn's HTTP/2 (``grpc/http2.py``; needs the ``zttp`` package, Python
3.11+), grpcio's grpc.aio (``grpc/service.py``), or "auto": uvicorn where it can, else grpcio."""

_log = logging.getLogger("paraloom.serving")
_DEFAULT_HOST = "127.0.0.1"  # never expose a model to the network unless asked to
# _SWITCH_NOTE: the event loop drops the GIL at every epoll wait, socket write and large numpy
# cast, then must take it back from the pool's worker threads, which run Python between torch
# ops and keep the GIL for up to the switch interval (Python's default: 5 ms). Under load that
# wait recurs on every loop turn: requests reach the pool one by one while cores sit idle. At
# 1 ms, LeNet at 64 concurrent JSON requests served ~40% more requests/s at a lower p99.
# _GC_NOTE: requests in flight live long enough to be promoted to the oldest generation, so
# under load Python runs full collections every few seconds, and each one walks every object
# the process holds (torch, the models, grpc): 0.1-0.44 s with the GIL held, LeNet at 64
# concurrent requests, which made the p99 latency. After startup ``serve`` collects once and
# freezes what exists (``gc.freeze``): later full collections walk only newer objects (under
# 10 ms). Not for ServerThread by default: it shares a process with the caller's own objects.
# _MALLOC_NOTE: a request of 1 MiB (a body, or an input read from shared memory) is a fresh
# allocation each time; glibc serves blocks that large with a new mapping of zeroed pages, and
# filling one costs 256 page faults (0.26 ms per MiB read from shared memory, against 0.11 ms
# once the heap reuses its blocks). ``serve`` raises glibc's mapping threshold to 32 MiB and its
# trim threshold to 64 MiB (``mallopt``), so such blocks come back from the heap already mapped.
# The heap may then keep up to 64 MiB more than it needs. Linux with glibc only; elsewhere a
# no-op. Not for ServerThread: the caller's process is its own to tune.


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def reuse_heap_blocks() -> bool:
    """Let glibc reuse freed blocks of up to 32 MiB instead of mapping fresh pages each time
    (see ``_MALLOC_NOTE``); whether it could (glibc only)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        return False
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20) and mallopt(_M_TRIM_THRESHOLD, 64 << 20))


def resolve_grpc_backend(name: str) -> str:
    """The backend ``name`` stands for ("auto" resolved); ValueError if unknown or missing."""
    if name not in GRPC_BACKENDS:
        raise ValueError(f"grpc_backend={name!r}; expected one of {GRPC_BACKENDS}")
    if name == "grpcio":
        return name
    try:
        import uvicorn.protocols.http.zttp_h2_impl  # noqa: F401
        import zttp  # noqa: F401
    except ImportError as e:
        if name == "auto":
            return "grpcio"
        raise ValueError(f"grpc_backend='uvicorn' needs uvicorn>=0.54 with zttp ({e}); "
                         "pip install 'paraloom[serve]' on Python 3.11+, or pass "
                         "grpc_backend='grpcio'") from e
    return "uvicorn"


class _Server(uvicorn.Server):
    """uvicorn's server, plus events for "startup finished (or failed)" and "shutdown began",
    and the gRPC endpoint (when asked for) started and stopped with it on the same loop."""

    def __init__(self, config: uvicorn.Config, grpc: GrpcEndpoint | None = None, *,
                 freeze_gc: bool = False) -> None:
        super().__init__(config)
        self.startup_done = threading.Event()
        self.stopping = threading.Event()
        self.grpc = grpc
        self.freeze_gc = freeze_gc  # see _GC_NOTE

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, except that a SIGTERM is not raised again once the graceful shutdown is
        done when nobody else handles it: ``serve()`` returns and ``paraloom serve`` exits 0
        (the default action killed the process at once, exit status 143, and the code after
        ``serve()`` never ran). A SIGINT is still raised again (``KeyboardInterrupt``), and so is
        a SIGTERM that the program handles itself."""
        term_is_default = signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)
        with super().capture_signals():
            try:
                yield
            finally:
                if term_is_default:
                    self._captured_signals = [s for s in self._captured_signals
                                              if s != signal.SIGTERM]

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            if self.grpc is not None:  # first: a busy gRPC port fails before HTTP answers
                port = await self.grpc.start()
                print(f"paraloom: gRPC on {self.grpc.host}:{port}", flush=True)
            await super().startup(sockets=sockets)
            if self.started:
                if self.freeze_gc:
                    gc.collect()
                    gc.freeze()
                for sock in sockets or []:
                    host, port = sock.getsockname()[:2]
                    _log.info("paraloom serving on http://%s:%d", host, port)
        finally:
            self.startup_done.set()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Not ready, and new requests refused (503), on both transports at once; in-flight
        gRPC calls, then HTTP requests, then the pools' queues finish, all within the one
        graceful timeout (each had it whole, one after the other)."""
        self.stopping.set()
        app = self.config.app
        repository = repository_of(app) if isinstance(app, Starlette) else None
        budget = self.config.timeout_graceful_shutdown
        deadline = None if budget is None else time.monotonic() + budget
        if repository is not None:
            repository.stop_taking_requests()
            repository.close_deadline = deadline
        if self.grpc is not None:  # in-flight gRPC calls finish before the pools drain
            await self.grpc.stop(budget)
        if deadline is not None:
            # uvicorn waits with asyncio.timeout, which takes any seconds (typed as an int).
            left = max(0.1, deadline - time.monotonic())
            self.config.timeout_graceful_shutdown = left  # type: ignore[assignment]
        await super().shutdown(sockets=sockets)


def _grpc(app: Starlette, host: str, port: int | None, backend: str, reuse_port: bool = False
          ) -> GrpcEndpoint | None:
    # Before either transport serves: both read the state. Siblings on one port: off.
    settle_shared_memory(app, host, processes=2 if reuse_port else 1)
    if port is None:
        return None
    if port < 0 or port > 65535:
        raise ValueError(f"grpc_port={port}; expected 0 (any free port) to 65535")
    server: type[GrpcEndpoint]
    if resolve_grpc_backend(backend) == "uvicorn":
        from paraloom.serving.grpc.http2 import Http2GrpcServer as server
    else:
        from paraloom.serving.grpc.service import GrpcServer as server
    state = app.state
    return server(state.repository, state.metrics, host=host, port=port,
                  max_message_bytes=state.max_body_bytes, reuse_port=reuse_port,
                  regions=getattr(state, "regions", None))


def _config(app: Starlette, *, log_level: str, access_log: bool, graceful_timeout: float,
            uvicorn_logging: bool = True) -> uvicorn.Config:
    if not math.isfinite(graceful_timeout) or graceful_timeout <= 0:
        raise ValueError(f"graceful_timeout={graceful_timeout}; expected a finite number of "
                         "seconds > 0")
    repository = repository_of(app)
    if repository is not None:  # the pools' drain at shutdown gets the same bound
        repository.close_timeout = graceful_timeout
        for served in repository.every():
            served.close_timeout = graceful_timeout
    # uvicorn types the graceful timeout as whole seconds; round up so it is never shortened.
    return uvicorn.Config(app, log_level=log_level, access_log=access_log,
                          timeout_graceful_shutdown=math.ceil(graceful_timeout), lifespan="on",
                          http=GuardedHttpTools,
                          log_config=LOGGING_CONFIG if uvicorn_logging else None)


def _as_app(pool_or_model: nn.Module | ParallelInference | Starlette, name: str | None,
            app_options: AppOptions) -> Starlette:
    if isinstance(pool_or_model, Starlette):
        if name is not None or app_options:
            raise TypeError("pass name and app options to create_app, not with an app")
        return pool_or_model
    return create_app(pool_or_model, name=name or "model", **app_options)


def serve(pool_or_model: nn.Module | ParallelInference | Starlette, *, name: str | None = None,
          host: str = _DEFAULT_HOST, port: int = 8000, log_level: str = "info",
          access_log: bool = False, graceful_timeout: float = 30.0, grpc_port: int | None = None,
          grpc_backend: str = "auto", switch_interval: float | None = 0.001,
          reuse_port: bool = False, freeze_gc: bool = True, uvicorn_logging: bool = True,
          **app_options: Unpack[AppOptions]) -> None:
    """Serve a model, a ParallelInference or an app from ``create_app`` until SIGINT/SIGTERM.

    Binds 127.0.0.1 unless ``host`` says otherwise. On shutdown, uvicorn stops accepting
    connections and waits up to ``graceful_timeout`` s for in-flight requests; then the pool drains.
    ``grpc_port`` (None: off; 0: a free port, printed) also serves the v2 gRPC endpoint on ``host``,
    with ``grpc_backend`` (see ``GRPC_BACKENDS``). Returns once a SIGTERM's graceful shutdown
    is done; after a SIGINT's it raises ``KeyboardInterrupt``.

    ``switch_interval`` (default 1 ms) sets ``sys.setswitchinterval`` for this process (None:
    leave Python's 5 ms): the event loop must take the GIL back from the pool's threads on every
    turn, and at 1 ms LeNet at 64 concurrent JSON requests served about 40% more requests/s.
    ``reuse_port`` shares the ports with sibling processes (``--processes``).
    ``uvicorn_logging`` (default True) gives uvicorn's loggers uvicorn's own handlers; False
    leaves them none, so their records go to the root logger's handlers (``paraloom serve``
    does this: ``--log-file`` and the ``log_format`` setting then cover them). ``freeze_gc``
    (default True) collects once after start and moves what exists out of the collector's reach
    (``gc.freeze``), so that later full collections take under 10 ms rather than up to 0.44 s
    with the GIL held. Large blocks (1 MiB bodies, shared-memory reads) are reused from the heap
    rather than mapped fresh for every request (glibc only; the heap may keep up to 64 MiB more).
    The process's soft limit of open files is raised to its hard limit (at most 65,536), so that
    a thousand slow clients do not take every descriptor; a request must arrive within
    ``paraloom.serving.http1.REQUEST_READ_S`` (60 s). ``app_options`` are ``create_app``'s
    (``workers``, ``batch_limit``, ...).

    Raises ``OSError`` when the port is taken (before any pool starts) and ``ValueError`` for a
    ``switch_interval`` that is not a positive number of seconds.
    """
    if switch_interval is not None:
        if not math.isfinite(switch_interval) or switch_interval <= 0:
            raise ValueError(f"switch_interval={switch_interval}; expected seconds > 0, e.g. "
                             "0.001, or None to keep Python's 0.005")
        sys.setswitchinterval(switch_interval)
    reuse_heap_blocks()  # see _MALLOC_NOTE
    raise_open_files_limit()
    # First: a busy port must fail before a pool starts.
    sock = bind_socket(host, port, reuse_port=reuse_port)
    try:
        app = _as_app(pool_or_model, name, app_options)
    except BaseException:
        sock.close()
        raise
    server = _Server(_config(app, log_level=log_level, access_log=access_log,
                             graceful_timeout=graceful_timeout, uvicorn_logging=uvicorn_logging),
                     _grpc(app, host, grpc_port, grpc_backend, reuse_port), freeze_gc=freeze_gc)
    try:
        server.run(sockets=[sock])
    except BaseException:
        close_owned_pools(app)  # uvicorn never ran the lifespan's shutdown
        raise
    finally:
        sock.close()


def raise_open_files_limit(most: int = 1 << 16) -> int:
    """Raise this process's soft limit of open files towards its hard limit (at most ``most``):
    every connection holds a descriptor, and many distributions start processes at 1,024.
    Returns the soft limit now (unchanged where the platform has no such limit)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = most if hard == resource.RLIM_INFINITY else min(hard, most)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            return wanted
    return soft


def close_owned_pools(app: Starlette) -> None:
    """Close, without draining, every pool the app built (when its lifespan never ran)."""
    repository = repository_of(app)
    if repository is None:
        return
    repository.stop_taking_requests()
    for served in repository.every():
        if served.owns_pool:
            served.pool.close(drain=False, timeout=5.0)


class ServerThread:
    """A uvicorn server on a background thread, for tests and notebooks; a context manager.

    It listens on a socket bound before start (port 0: a free port chosen by the OS), so ``url``
    is right as soon as the object exists. ``stop`` asks for a graceful shutdown, then forces one
    after ``graceful_timeout`` s, and never waits forever. ``freeze_gc=True`` freezes the
    process's objects once started, as ``serve`` does (off: they are the caller's too).
    """

    def __init__(self, app: Starlette, *, host: str = _DEFAULT_HOST, port: int = 0,
                 graceful_timeout: float = 5.0, log_level: str = "warning",
                 grpc_port: int | None = None, grpc_backend: str = "auto",
                 freeze_gc: bool = False) -> None:
        self.app = app
        self._sock = bind_socket(host, port)
        self.host, self.port = self._sock.getsockname()[:2]
        self.graceful_timeout = graceful_timeout
        self._server = _Server(_config(app, log_level=log_level, access_log=False,
                                       graceful_timeout=graceful_timeout),
                               _grpc(app, host, grpc_port, grpc_backend),
                               freeze_gc=freeze_gc)
        self._thread = threading.Thread(target=self._run, name=f"uvicorn:{self.port}",
                                        daemon=True)
        self._error: BaseException | None = None

    @property
    def stopping(self) -> threading.Event:
        """Set when shutdown began: no new connections; in-flight requests still finish."""
        return self._server.stopping

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def grpc_url(self) -> str:
        """``host:port`` of the gRPC endpoint (as tritonclient.grpc takes it); after start."""
        grpc = self._server.grpc
        if grpc is None or grpc.port is None:
            raise RuntimeError("this server has no gRPC endpoint: pass grpc_port= (0: any)")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{grpc.port}"

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._sock])
        except BaseException as e:  # surfaced by start() in the caller's thread
            self._error = e
        finally:
            self._server.startup_done.set()  # a failed startup must not leave start() waiting

    def start(self, timeout: float = 30.0) -> ServerThread:
        """Start serving; returns once the app's startup finished (or raises)."""
        self._thread.start()
        if not self._server.startup_done.wait(timeout) or not self._server.started:
            self.stop()
            if self._error is not None:
                close_owned_pools(self.app)
            raise RuntimeError(f"uvicorn did not start within {timeout} s"
                               + (f": {self._error!r}" if self._error else ""))
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Shut down gracefully, forcing it after the graceful timeout; bounded either way."""
        limit = self.graceful_timeout if timeout is None else timeout
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(limit + 5.0)
        if self._thread.is_alive():
            self._server.force_exit = True  # uvicorn then skips the lifespan shutdown, so
            self._thread.join(5.0)
            close_owned_pools(self.app)  # close the pool here, or its workers outlive us
        self._sock.close()
        if self._thread.is_alive():
            raise RuntimeError(f"uvicorn on port {self.port} did not stop within {limit + 10} s")

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
