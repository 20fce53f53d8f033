"""``paraloom bench inference``: ParallelInference against naive threads and the offline limit.

One run: LeNet, ``--clients`` threads each sending ``--requests`` one-row requests. Three
measurements, on the same model and input:

* offline limit: the model on full batches of ``--offline-batch`` rows in a loop, the best of
  1 torch thread and one per core (a loaded machine can make the second much slower);
* naive: every client thread calls the model directly on its one row (best of the same two);
* batched: every client thread calls ``ParallelInference.output`` (inference_mode='batched').
  Default layout on C cores: min(2, C) workers x C // workers torch threads, batch_limit 32 and
  max_wait_ms 5, which lets the clients just answered send again before the next forward pass,
  so it runs on a full batch without their Python (GIL) traffic in its way.

Prints throughputs, p50/p99 latencies and the two ratios, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

import torch

from paraloom.arguments import count, seconds, wait
from paraloom.bench.common import (
    Machine,
    bar_plot,
    machine,
    plain_args,
    results_path,
    write_results,
)
from paraloom.inference import ParallelInference
from paraloom.inference.stats import Percentiles, percentiles
from paraloom.models import LeNet

__all__ = ["add_arguments", "run"]

DEFAULT_OUTPUT = "benchmarks/results/inference.json"
GOAL_VS_NAIVE = 2.5
GOAL_VS_OFFLINE = 0.7


class Latency(TypedDict):
    """Milliseconds per request."""

    p50: float
    p90: float
    p99: float
    max: float
    mean: float


class ClientRun(TypedDict):
    """Client threads sending one-row requests: throughput in rows/s."""

    requests: int
    seconds: float
    throughput: float
    latency_ms: Latency


class NaiveRun(ClientRun):
    """The best of the thread counts tried."""

    torch_threads: int
    by_torch_threads: dict[str, float]


class BatchedRun(ClientRun):
    """Through ParallelInference, with its batching counters."""

    batches: int
    mean_batch_rows: float
    queue_time_ms: Percentiles
    forward_time_ms: Percentiles


class OfflineRun(TypedDict):
    """Full batches in a loop: the limit, in rows/s."""

    batch: int
    torch_threads: int
    windows_by_torch_threads: dict[str, list[float]]
    throughput: float


class Ratios(TypedDict):
    """Batched throughput against the naive and offline ones, and the goals for each."""

    batched_vs_naive: float
    batched_vs_offline: float
    goal_vs_naive: float
    goal_vs_offline: float
    goals_met: bool


class InferenceResults(TypedDict):
    """The JSON that ``run`` writes."""

    benchmark: str
    machine: Machine
    config: dict[str, object]
    offline: OfflineRun
    naive: NaiveRun
    batched: BatchedRun
    ratios: Ratios


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``parser``."""
    parser.add_argument("--clients", type=count, default=64, help="concurrent client threads (64)")
    parser.add_argument("--requests", type=count, default=100,
                        help="one-row requests per client thread (100)")
    parser.add_argument("--image-size", type=count, default=28, help="LeNet input size (28: MNIST)")
    parser.add_argument("--workers", type=count, default=None,
                        help="ParallelInference workers (default: min(2, cores))")
    parser.add_argument("--threads-per-worker", type=count, default=None,
                        help="torch intra-op threads per worker (default: cores // workers)")
    parser.add_argument("--batch-limit", type=count, default=32, help="rows per batch at most (32)")
    parser.add_argument("--queue-limit", type=count, default=256,
                        help="queued requests at most (256)")
    parser.add_argument("--max-wait-ms", type=wait, default=5.0,
                        help="how long a free worker may wait for a fuller batch (5): lets the "
                             "clients just answered send again before the next forward pass")
    parser.add_argument("--offline-batch", type=count, default=128,
                        help="batch size of the offline limit (128)")
    parser.add_argument("--offline-seconds", type=seconds, default=1.0,
                        help="length of each timed offline window (1.0; 3 per thread count)")
    parser.add_argument("--output", "--out", dest="output", type=results_path,
                        default=DEFAULT_OUTPUT,
                        help=f"where to write the JSON ({DEFAULT_OUTPUT})")


def _clients(n: int, per_client: int, call: Callable[[], object]) -> tuple[float, list[float]]:
    """Run ``n`` threads that each call ``call`` ``per_client`` times; (seconds, latencies)."""
    start = threading.Barrier(n + 1)
    latencies: list[list[float]] = [[] for _ in range(n)]
    errors: list[BaseException] = []

    def client(i: int) -> None:
        own = latencies[i]
        try:
            start.wait(timeout=60)
            for _ in range(per_client):
                t0 = time.perf_counter()
                call()
                own.append(time.perf_counter() - t0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    start.wait(timeout=60)
    began = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    if errors:
        raise RuntimeError(f"{len(errors)} client threads failed; first: {errors[0]!r}")
    return elapsed, [x for own in latencies for x in own]


def _summary(requests: int, seconds: float, latencies: list[float]) -> ClientRun:
    lat = percentiles([x * 1e3 for x in latencies])
    return {"requests": requests, "seconds": seconds, "throughput": requests / seconds,
            "latency_ms": {"p50": lat["p50"], "p90": lat["p90"], "p99": lat["p99"],
                           "max": lat["max"], "mean": lat["mean"]}}


def _offline(model: torch.nn.Module, x: torch.Tensor, batch: int, cores: int,
             seconds: float = 1.0, windows: int = 3) -> OfflineRun:
    """The model on full batches in a loop: the best window over 1 and ``cores`` torch threads."""
    xb = x.expand(batch, *x.shape[1:]).contiguous()
    by_threads: dict[str, list[float]] = {}
    with torch.inference_mode():
        for threads in sorted({1, cores}):
            torch.set_num_threads(threads)
            _loop(model, xb, seconds / 2)  # warm-up: the first calls build kernels
            rates = []
            for _ in range(windows):
                n, elapsed = _loop(model, xb, seconds)
                rates.append(n * batch / elapsed)
            by_threads[str(threads)] = rates
    torch.set_num_threads(cores)
    best = max(by_threads, key=lambda t: max(by_threads[t]))
    return {"batch": batch, "torch_threads": int(best), "windows_by_torch_threads": by_threads,
            "throughput": max(by_threads[best])}


def _loop(model: torch.nn.Module, xb: torch.Tensor, seconds: float) -> tuple[int, float]:
    n, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        model(xb)
        n += 1
    return n, time.perf_counter() - began


def _naive(model: torch.nn.Module, x: torch.Tensor, args: argparse.Namespace,
           cores: int) -> NaiveRun:
    """Client threads calling the model directly; the best of 1 and ``cores`` torch threads."""
    def call() -> None:
        with torch.inference_mode():
            model(x)

    runs = {}
    for threads in sorted({1, cores}):
        torch.set_num_threads(threads)  # client threads started after this inherit it
        _clients(args.clients, 3, call)  # warm-up
        seconds, latencies = _clients(args.clients, args.requests, call)
        runs[threads] = _summary(args.clients * args.requests, seconds, latencies)
    torch.set_num_threads(cores)
    best = max(runs, key=lambda t: runs[t]["throughput"])
    return {**runs[best], "torch_threads": best,
            "by_torch_threads": {str(t): r["throughput"] for t, r in runs.items()}}


def _batched(model: torch.nn.Module, x: torch.Tensor, args: argparse.Namespace
             ) -> BatchedRun:
    with ParallelInference(model, inference_mode="batched", workers=args.workers,
                           batch_limit=args.batch_limit, queue_limit=args.queue_limit,
                           max_wait_ms=args.max_wait_ms, example_input=x,
                           threads_per_worker=args.threads_per_worker) as pi:
        _clients(args.clients, 3, lambda: pi.output(x))  # warm-up
        before = pi.stats()
        seconds, latencies = _clients(args.clients, args.requests, lambda: pi.output(x))
        after = pi.stats()
    batches = after["batches"] - before["batches"]
    return {**_summary(args.clients * args.requests, seconds, latencies), "batches": batches,
            "mean_batch_rows": (after["rows"] - before["rows"]) / max(1, batches),
            "queue_time_ms": after["queue_time_ms"], "forward_time_ms": after["forward_time_ms"]}


def _settle(args: argparse.Namespace, cores: int) -> argparse.Namespace:
    """Fill in the thread layout: workers x threads_per_worker <= cores."""
    workers = args.workers or min(2, cores)
    threads = args.threads_per_worker or max(1, cores // workers)
    return argparse.Namespace(**{**vars(args), "workers": workers,
                                 "threads_per_worker": threads})


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the ratios, write the JSON; 0 on success."""
    host = machine()
    cores = int(host["cores"] or 1)
    args = _settle(plain_args(args), cores)
    torch.manual_seed(0)
    model = LeNet(image_size=args.image_size).eval()
    x = torch.rand(1, 1, args.image_size, args.image_size)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(cores)
        offline = _offline(model, x, args.offline_batch, cores, seconds=args.offline_seconds)
        naive = _naive(model, x, args, cores)
        batched = _batched(model, x, args)
    finally:
        torch.set_num_threads(before)
    vs_naive = batched["throughput"] / naive["throughput"]
    vs_offline = batched["throughput"] / offline["throughput"]
    result: InferenceResults = {
        "benchmark": "inference", "machine": host,
        "config": {"model": f"LeNet(image_size={args.image_size})", **vars(args)},
        "offline": offline, "naive": naive, "batched": batched,
        "ratios": {"batched_vs_naive": vs_naive, "batched_vs_offline": vs_offline,
                   "goal_vs_naive": GOAL_VS_NAIVE, "goal_vs_offline": GOAL_VS_OFFLINE,
                   "goals_met": vs_naive >= GOAL_VS_NAIVE and vs_offline >= GOAL_VS_OFFLINE}}
    path = write_results(args.output, result)
    print(_report(result, path))
    bar_plot(path, f"LeNet(image_size={args.image_size}): one-row requests from "
             f"{args.clients} threads", {"offline": offline["throughput"],
                                         "naive": naive["throughput"],
                                         "batched": batched["throughput"]}, "rows/s")
    return 0


def _report(result: InferenceResults, path: Path) -> str:
    def line(name: str, throughput: float, lat: Latency | None = None) -> str:
        tail = f"  p50 {lat['p50']:.2f} ms  p99 {lat['p99']:.2f} ms" if lat else ""
        return f"{name:<40}{throughput:>8,.0f} rows/s{tail}"

    ratios = result["ratios"]
    c = result["config"]
    return "\n".join([
        f"{c['model']}, {c['clients']} client threads x {c['requests']} one-row "
        f"requests, {result['machine']['cores']} cores",
        line(f"offline (batch {c['offline_batch']}, torch threads="
             f"{result['offline']['torch_threads']})", result["offline"]["throughput"]),
        line(f"naive (torch threads={result['naive']['torch_threads']})",
             result["naive"]["throughput"], result["naive"]["latency_ms"]),
        line(f"batched ({c['workers']}x{c['threads_per_worker']} threads)",
             result["batched"]["throughput"], result["batched"]["latency_ms"]),
        f"mean batch: {result['batched']['mean_batch_rows']:.1f} rows",
        f"batched / naive   = {ratios['batched_vs_naive']:.2f}  (goal >= {GOAL_VS_NAIVE})",
        f"batched / offline = {ratios['batched_vs_offline']:.2f}  (goal >= {GOAL_VS_OFFLINE})",
        f"wrote {path}",
    ])


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m paraloom.bench.inference``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
