"""A closed-loop load generator for the serving benchmark: the same client for every server.

``concurrency`` callers spread over ``processes`` processes (so the client's own GIL does not
cap the load), each sending one pre-encoded request and waiting for its answer, again and again:
over HTTP a keep-alive connection POSTing the same bytes in one write, over gRPC a channel per
caller calling the method with the same serialized message. Neither side re-encodes tensors per
request, so every server gets the same work from the client. Measured: answers per second over
the window, latency percentiles, errors, and the CPU seconds the server's processes used.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import socket
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


class _HttpConnection:
    """A keep-alive HTTP/1.1 connection sending one pre-built request (head and body in one
    write, TCP_NODELAY: no Nagle stall) and reading the answer by Content-Length."""

    def __init__(self, target: Target) -> None:
        head = [f"POST {target.path} HTTP/1.1", f"Host: {target.host}:{target.port}",
                f"Content-Length: {len(target.body)}", *(f"{k}: {v}" for k, v in target.headers)]
        self.request = ("\r\n".join(head) + "\r\n\r\n").encode() + target.body
        self.address = (target.host, target.port)
        self.sock: socket.socket | None = None
        self.buffer = b""

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.buffer = sock, b""
        return sock

    def call(self) -> int:
        """Send the request, read the whole answer; returns the HTTP status."""
        sock = self.sock or self._connect()
        sock.sendall(self.request)
        while b"\r\n\r\n" not in self.buffer:
            self._read(sock)
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            rest += self._recv(sock)
        self.buffer = rest[length:]
        return status

    def _read(self, sock: socket.socket) -> None:
        self.buffer += self._recv(sock)

    def _recv(self, sock: socket.socket) -> bytes:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        return chunk

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _http_caller(target: Target, stop_at: float, measure_from: float,
                 out: list[float], errors: list[str]) -> None:
    conn = _HttpConnection(target)
    while True:
        start = time.perf_counter()
        if start >= stop_at:
            break
        try:
            status = conn.call()
        except (OSError, ValueError, IndexError) as e:
            errors.append(type(e).__name__)
            conn.close()
            continue
        end = time.perf_counter()
        if status != 200:
            errors.append(f"HTTP {status}")
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


def _process(target: Target, callers: int, ready: Any, go: Any, start: Any, warmup: float,
             duration: float, results: Any) -> None:
    ready.put(os.getpid())  # imported and ready: the parent starts every process at once
    if not go.wait(300):
        results.put(([], ["never started"], time.process_time()))
        return
    measure_from = start.value + warmup
    stop_at = measure_from + duration
    caller = _grpc_caller if target.method else _http_caller
    latencies: list[list[float]] = [[] for _ in range(callers)]
    errors: list[str] = []
    threads = [threading.Thread(target=caller, args=(target, stop_at, measure_from,
                                                     latencies[i], errors), daemon=True)
               for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration + warmup + 120)
    results.put(([x for one in latencies for x in one], errors, time.process_time()))


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
    results, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    start = ctx.Value("d", 0.0)
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
