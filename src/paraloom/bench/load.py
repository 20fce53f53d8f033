"""A closed-loop load generator for the serving benchmark: the same client for every server.

``concurrency`` callers spread over ``processes`` processes (so the client's own GIL does not
cap the load), each sending one pre-encoded request and waiting for its answer, again and again:
over HTTP a keep-alive ``http.client`` connection POSTing the same bytes, over gRPC a channel per
caller calling the method with the same serialized message. Neither side re-encodes tensors per
request, so every server gets the same work from the client. Measured: answers per second over
the window, latency percentiles, errors, and the CPU seconds the server's processes used.
"""

from __future__ import annotations

import http.client
import math
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

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


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, nearest rank."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _http_caller(target: Target, stop_at: float, measure_from: float,
                 out: list[float], errors: list[str]) -> None:
    conn = http.client.HTTPConnection(target.host, target.port, timeout=60)
    headers = dict(target.headers)
    while True:
        start = time.perf_counter()
        if start >= stop_at:
            break
        try:
            conn.request("POST", target.path, body=target.body, headers=headers)
            response = conn.getresponse()
            response.read()
            ok = response.status == 200
        except (OSError, http.client.HTTPException) as e:
            errors.append(type(e).__name__)
            conn.close()
            conn = http.client.HTTPConnection(target.host, target.port, timeout=60)
            continue
        end = time.perf_counter()
        if not ok:
            errors.append(f"HTTP {response.status}")
        elif start >= measure_from and end <= stop_at:
            out.append(end - start)
    conn.close()


def _grpc_caller(target: Target, stop_at: float, measure_from: float,
                 out: list[float], errors: list[str]) -> None:
    import grpc

    channel = grpc.insecure_channel(f"{target.host}:{target.port}", options=[
        ("grpc.max_receive_message_length", -1), ("grpc.use_local_subchannel_pool", 1)])
    call = channel.unary_unary(target.method)  # bytes in, bytes out: no per-call encoding
    while True:
        start = time.perf_counter()
        if start >= stop_at:
            break
        try:
            call(target.body, timeout=60)
        except grpc.RpcError as e:
            errors.append(str(e.code()))
            continue
        end = time.perf_counter()
        if start >= measure_from and end <= stop_at:
            out.append(end - start)
    channel.close()


def _process(target: Target, callers: int, start_at: float, warmup: float, duration: float,
             results: Any) -> None:
    measure_from = start_at + warmup
    stop_at = measure_from + duration
    caller = _grpc_caller if target.method else _http_caller
    latencies: list[list[float]] = [[] for _ in range(callers)]
    errors: list[str] = []
    threads = [threading.Thread(target=caller, args=(target, stop_at, measure_from,
                                                     latencies[i], errors), daemon=True)
               for i in range(callers)]
    time.sleep(max(0.0, start_at - time.perf_counter()))
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration + warmup + 120)
    results.put(([x for one in latencies for x in one], errors,
                 time.process_time()))


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


def run_load(target: Target, *, concurrency: int, duration: float, warmup: float,
             processes: int, server_pgid: int | None = None) -> dict[str, Any]:
    """Load ``target`` from ``concurrency`` callers; requests/s, p50/p90/p99 ms, CPU use."""
    processes = max(1, min(processes, concurrency))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    start_at = time.perf_counter() + 1.5  # every process starts its callers at once
    counts = [concurrency // processes + (i < concurrency % processes)
              for i in range(processes)]
    procs = [ctx.Process(target=_process, args=(target, n, start_at, warmup, duration, results))
             for n in counts]
    for p in procs:
        p.start()
    time.sleep(max(0.0, start_at + warmup - time.perf_counter()))
    cpu_before = cpu_seconds(server_pgid) if server_pgid else math.nan
    time.sleep(duration)
    cpu_after = cpu_seconds(server_pgid) if server_pgid else math.nan
    latencies: list[float] = []
    errors: list[str] = []
    client_cpu = 0.0
    for _ in procs:
        got, errs, cpu = results.get(timeout=duration + warmup + 180)
        latencies += got
        errors += errs
        client_cpu += cpu
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
            "client_cpu_s": round(client_cpu, 2)}
