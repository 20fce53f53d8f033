"""``paraloom serve --processes N``: N server processes sharing the ports, each with its own pools.

One Python process parses HTTP and JSON on one event-loop thread, and that thread shares one GIL
with the pool's worker threads. N processes, each a whole server (its own loop, its own
``ParallelInference`` pools of ``--workers`` replicas), listen on the same HTTP and gRPC ports
with ``SO_REUSEPORT``, and the kernel spreads connections over them. The parent reserves the
ports (so port 0 resolves once), starts the children, relays SIGINT/SIGTERM (as SIGTERM: a
graceful stop) and SIGHUP, and stops them all when one fails. Loads and unloads over the API
would change one process only, so the children refuse them; SIGHUP to the parent reloads all.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType

from paraloom.serving.sockets import bind_socket

__all__ = ["refuse_log_changes_message", "refuse_loads_message", "reserve_port",
           "run_processes"]

_POLL = 0.2  # seconds between the parent's checks of its children


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, not listening, ``SO_REUSEPORT`` socket: holds the port for the children."""
    return bind_socket(host, port, reuse_port=True)


def refuse_loads_message(processes: int, parent: int) -> str:
    """Why a child of ``--processes N`` refuses loads and unloads over the API."""
    return (f"this server runs {processes} processes (paraloom serve --processes {processes}), "
            "each with its own copy of every model, and a load or unload would reach one of "
            f"them; send SIGHUP to the parent (kill -HUP {parent}) to reload the served file "
            "(or every model of --models-dir) in every process, or run with --processes 1 to "
            "load and unload over the API")


def refuse_log_changes_message(processes: int) -> str:
    """Why a child of ``--processes N`` refuses changes of the log settings over the API."""
    return (f"this server runs {processes} processes (paraloom serve --processes {processes}), "
            "each with its own log settings, and a change would reach one of them; start the "
            "server with the --log-level you want, or run with --processes 1 to change the "
            "log settings over the API")


def _watch_parent(parent: int) -> None:
    """In a child: stop gracefully if the parent dies (a SIGKILLed parent relays nothing)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="paraloom-parent-watch", daemon=True).start()


def _child(args: argparse.Namespace, parent: int,
           serve: Callable[[argparse.Namespace], int]) -> None:
    _watch_parent(parent)
    sys.exit(serve(args))


def _stop_all(children: Sequence[mp.process.BaseProcess], timeout: float) -> None:
    for child in children:
        if child.is_alive() and child.pid is not None:
            os.kill(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.is_alive():
            child.kill()
            child.join(5.0)


def run_processes(args: argparse.Namespace, serve: Callable[[argparse.Namespace], int]) -> int:
    """Serve with ``args.processes`` children, each running ``serve(args)`` (``paraloom serve``
    of one process: a module-level function, as spawn pickles it), until SIGINT/SIGTERM."""
    count = args.processes
    try:
        http = reserve_port(args.host, args.port)
        grpc = reserve_port(args.host, args.grpc_port) if args.grpc_port is not None else None
    except OSError as e:
        print(f"paraloom serve: error: {e}", file=sys.stderr)
        return 2
    child_args = copy.copy(args)
    child_args.processes = 1
    child_args.port = http.getsockname()[1]
    child_args.grpc_port = grpc.getsockname()[1] if grpc is not None else None
    child_args.reuse_port = True
    child_args.refuse_loads = refuse_loads_message(count, os.getpid())
    child_args.refuse_log_changes = refuse_log_changes_message(count)
    ctx = mp.get_context("spawn")  # never fork a process that may hold torch threads
    children = [ctx.Process(target=_child, args=(child_args, os.getpid(), serve),
                            name=f"paraloom-serve-{i}") for i in range(count)]
    stop = threading.Event()

    def on_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    def on_hup(signum: int, frame: FrameType | None) -> None:
        for child in children:
            if child.is_alive() and child.pid is not None:
                os.kill(child.pid, signal.SIGHUP)

    previous = {s: signal.signal(s, on_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    if hasattr(signal, "SIGHUP"):
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, on_hup)
    code = 0
    try:
        for child in children:
            child.start()
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"paraloom: {count} processes serving on http://{host}:{child_args.port}",
              flush=True)
        while not stop.wait(_POLL):
            failed = [c for c in children if not c.is_alive()]
            if failed:  # one server down: stop the rest rather than serve part of the time
                exitcode = failed[0].exitcode
                code = exitcode if exitcode is not None and exitcode > 0 else 1
                print(f"paraloom serve: process {failed[0].name} exited with "
                      f"{failed[0].exitcode}; stopping the others", file=sys.stderr)
                break
    finally:
        _stop_all(children, args.graceful_timeout + 10.0)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        http.close()
        if grpc is not None:
            grpc.close()
    return code
