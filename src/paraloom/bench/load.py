"""A closed-loop load generator for the serving benchmark: the same client for every server.

``concurrency`` callers spread over ``processes`` processes (so the client's own GIL does not
cap the load), each sending one pre-encoded request and waiting for its answer, again and again:
over HTTP a keep-alive connection POSTing the same bytes in one write, over gRPC an HTTP/2
connection per caller sending the same headers and serialized message on a new stream for each
call (``paraloom.bench.h2c``, nearly as cheap per call as the HTTP caller;
``Target(grpcio=True)`` uses grpcio's asyncio client instead, which costs the client several
times the CPU per call). The callers of a process share one asyncio event loop (uvloop when
installed): the client shares the cores with the servers, so every microsecond it spends per
request is taken from them. Neither side re-encodes tensors per request, so every server gets
the same work from the client. Measured: answers per second over the window, latency
percentiles, errors, and the CPU seconds the server's processes and the client used.
"""

from __future__ import annotations

import asyncio
import functools
import math
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paraloom.bench.caller import ClosedLoopCaller
from paraloom.bench.h2c import GrpcCaller

if TYPE_CHECKING:
    from multiprocessing.queues import Queue
    from multiprocessing.sharedctypes import Synchronized
    from multiprocessing.synchronize import Event

__all__ = ["Target", "cpu_seconds", "percentile", "run_load"]


@dataclass(frozen=True)
class Target:
    """Where and what to send: HTTP ``path`` with ``headers``, or gRPC ``method``."""

    host: str
    port: int
    body: bytes
    path: str = ""
    headers: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),)
    method: str = ""  # gRPC: "/inference.GRPCInferenceService/ModelInfer"
    grpcio: bool = False  # gRPC through grpcio's asyncio client, not the h2c caller


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, nearest rank."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


class _HttpCaller(ClosedLoopCaller):
    """One keep-alive HTTP/1.1 connection sending one pre-built request (head and body in one
    write; asyncio sets TCP_NODELAY) and reading each answer by Content-Length, again and again
    until ``stop_at``: a closed loop of one caller, driven by the event loop's callbacks."""

    def __init__(self, request: bytes, stop_at: float, measure_from: float,
                 out: list[float], errors: list[str], done: asyncio.Future[None]) -> None:
        super().__init__(stop_at, measure_from, out, errors, done)
        self.request = request

    def _request(self) -> None:
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buffer[:end]).lower()
        at = head.find(b"\r\ncontent-length:")  # not Inference-Header-Content-Length
        length = 0
        if at >= 0:
            stop = head.find(b"\r\n", at + 2)
            length = int(head[at + 17:stop if stop >= 0 else len(head)])
        if len(self.buffer) < end + 4 + length:
            return
        status = head[9:12]
        del self.buffer[:end + 4 + length]
        self._ended(None if status == b"200" else f"HTTP {status.decode(errors='replace')}")


async def _http_caller(target: Target, stop_at: float, measure_from: float,
                       out: list[float], errors: list[str]) -> None:
    head = [f"POST {target.path} HTTP/1.1", f"Host: {target.host}:{target.port}",
            f"Content-Length: {len(target.body)}", *(f"{k}: {v}" for k, v in target.headers)]
    request = ("\r\n".join(head) + "\r\n\r\n").encode() + target.body
    await _connected(target, stop_at, errors, lambda done: _HttpCaller(
        request, stop_at, measure_from, out, errors, done))


async def _h2c_caller(target: Target, stop_at: float, measure_from: float,
                      out: list[float], errors: list[str]) -> None:
    authority = f"{target.host}:{target.port}"
    await _connected(target, stop_at, errors, lambda done: GrpcCaller(
        target.method, authority, target.body, stop_at, measure_from, out, errors, done))


async def _connected(target: Target, stop_at: float, errors: list[str],
                     protocol: Callable[[asyncio.Future[None]], asyncio.Protocol]) -> None:
    """Run a caller's protocol until ``stop_at``; a lost connection is counted, then replaced."""
    loop = asyncio.get_running_loop()
    while time.perf_counter() < stop_at:
        done: asyncio.Future[None] = loop.create_future()
        try:
            await loop.create_connection(functools.partial(protocol, done),
                                         target.host, target.port)
        except OSError as e:
            errors.append(type(e).__name__)
            await asyncio.sleep(0.05)
            continue
        await done


async def _grpc_caller(target: Target, stop_at: float, measure_from: float,
                       out: list[float], errors: list[str]) -> None:
    import grpc
    from grpc import aio

    async with aio.insecure_channel(f"{target.host}:{target.port}", options=[
            ("grpc.max_receive_message_length", -1), ("grpc.use_local_subchannel_pool", 1)]
            ) as channel:
        call = channel.unary_unary(target.method)  # bytes in, bytes out: no per-call encoding
        while True:
            start = time.perf_counter()
            if start >= stop_at:
                break
            try:
                await call(target.body, timeout=60)
            except grpc.RpcError as e:
                errors.append(str(e.code()))
                continue
            end = time.perf_counter()
            if start >= measure_from and end <= stop_at:
                out.append(end - start)


async def _callers(target: Target, callers: int, stop_at: float, measure_from: float,
                   latencies: list[list[float]], errors: list[str]) -> None:
    caller = _http_caller
    if target.method:
        caller = _grpc_caller if target.grpcio else _h2c_caller
    await asyncio.wait_for(asyncio.gather(*(
        caller(target, stop_at, measure_from, latencies[i], errors) for i in range(callers))),
        timeout=stop_at - time.perf_counter() + 120)


def _run(main: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop when installed: the client's CPU is taken from the servers it measures."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


class _CpuWindow:
    """This process's CPU seconds between two ``perf_counter`` instants, read by a thread
    that sleeps until each (so start-up and warm-up are not counted)."""

    def __init__(self, start: float, stop: float) -> None:
        self.readings: list[float] = []
        self._thread = threading.Thread(target=self._read, args=(start, stop), daemon=True)
        self._thread.start()

    def _read(self, *instants: float) -> None:
        for at in instants:
            time.sleep(max(0.0, at - time.perf_counter()))
            self.readings.append(time.process_time())

    def seconds(self) -> float:
        self._thread.join(60)
        return self.readings[1] - self.readings[0] if len(self.readings) == 2 else math.nan


_ProcessResult = tuple[list[float], list[str], float]
"""One load process's latencies, errors and CPU seconds over the window."""


def _process(target: Target, callers: int, ready: Queue[int], go: Event,
             start: Synchronized[float], warmup: float, duration: float,
             results: Queue[_ProcessResult]) -> None:
    ready.put(os.getpid())  # imported and ready: the parent starts every process at once
    if not go.wait(300):
        results.put(([], ["never started"], time.process_time()))
        return
    measure_from = start.value + warmup
    stop_at = measure_from + duration
    latencies: list[list[float]] = [[] for _ in range(callers)]
    errors: list[str] = []
    window = _CpuWindow(measure_from, stop_at)
    try:
        _run(_callers(target, callers, stop_at, measure_from, latencies, errors))
    except Exception as e:  # noqa: BLE001 - reported as the run's errors, never a hang
        errors.append(f"{type(e).__name__}: {e}")
    results.put(([x for one in latencies for x in one], errors, window.seconds()))


def cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid`` (Linux)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the name: state ppid pgrp ...
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def _gather(results: Queue[_ProcessResult], processes: int, timeout: float
            ) -> _ProcessResult:
    """Every load process's report, merged: latencies, errors, client CPU seconds."""
    latencies: list[float] = []
    errors: list[str] = []
    client_cpu = 0.0
    for _ in range(processes):
        got, errs, cpu = results.get(timeout=timeout)
        latencies += got
        errors += errs
        client_cpu += cpu
    return latencies, errors, client_cpu


def run_load(target: Target, *, concurrency: int, duration: float, warmup: float,
             processes: int, server_pgid: int | None = None) -> dict[str, Any]:
    """Load ``target`` from ``concurrency`` callers; requests/s, p50/p90/p99 ms, CPU use."""
    processes = max(1, min(processes, concurrency))
    ctx = mp.get_context("spawn")
    results: Queue[_ProcessResult] = ctx.Queue()
    ready: Queue[int] = ctx.Queue()
    go = ctx.Event()
    start: Synchronized[float] = ctx.Value("d", 0.0)
    counts = [concurrency // processes + (i < concurrency % processes)
              for i in range(processes)]
    procs = [ctx.Process(target=_process, args=(target, n, ready, go, start, warmup, duration,
                                                results), daemon=True) for n in counts]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)  # bounded: a process that cannot even import fails the run
    start.value = time.perf_counter()  # CLOCK_MONOTONIC: the same clock in every process
    go.set()
    time.sleep(max(0.0, start.value + warmup - time.perf_counter()))
    cpu_before = cpu_seconds(server_pgid) if server_pgid else math.nan
    time.sleep(duration)
    cpu_after = cpu_seconds(server_pgid) if server_pgid else math.nan
    latencies, errors, client_cpu = _gather(results, len(procs), duration + warmup + 180)
    for p in procs:
        p.join(30)
    latencies.sort()
    return {"concurrency": concurrency, "requests": len(latencies),
            "requests_per_s": round(len(latencies) / duration, 1),
            "p50_ms": round(percentile(latencies, 50) * 1e3, 2),
            "p90_ms": round(percentile(latencies, 90) * 1e3, 2),
            "p99_ms": round(percentile(latencies, 99) * 1e3, 2),
            "errors": len(errors), "error_kinds": sorted(set(errors))[:5],
            "server_cpu_per_s": round((cpu_after - cpu_before) / duration, 2),
            "client_cpu_per_s": round(client_cpu / duration, 2)}
