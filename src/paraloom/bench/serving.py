"""``paraloom bench serving``: LeNet behind ``paraloom serve`` (HTTP and gRPC), MLServer, LitServe.

Every server gets the same LeNet weights, the same worker count, torch threads per worker and
batch limit, and the same requests (one row, 784 FP32 values) from the same closed-loop client
(``paraloom.bench.load``) at each concurrency. MLServer (installed from PyPI into its own venv
under a cache folder, so its pins never touch this environment) serves the model with a custom
runtime and adaptive batching; LitServe with its batching. Servers and concurrency levels are
measured in interleaved rounds; the report gives medians over rounds, ratios against MLServer
and LitServe, and the server's CPU use. Writes JSON and a PNG plot. Then (``--features``, on by
default; ``--only-features`` runs nothing else) shared memory against inline requests and a gRPC
stream against unary calls: ``paraloom.bench.serving_features``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from paraloom.arguments import count, count_list, seconds, wait
from paraloom.bench.common import results_path
from paraloom.bench.load import Target, run_load
from paraloom.bench.serving_contenders import CONTENDERS, Measure
from paraloom.bench.serving_features import run_features
from paraloom.bench.serving_report import ratios, summarize, write_report

__all__ = ["add_arguments", "main", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``paraloom bench serving``'s arguments to ``parser``."""
    parser.add_argument("--concurrency", type=count_list, default="1,16,64",
                        help="client concurrency levels, comma-separated (1,16,64)")
    parser.add_argument("--duration", type=seconds, default=5.0, help="seconds measured (5)")
    parser.add_argument("--warmup", type=wait, default=1.0, help="seconds before measuring (1)")
    parser.add_argument("--rounds", type=count, default=2,
                        help="interleaved rounds over every server; medians are reported (2)")
    parser.add_argument("--client-processes", type=count, default=2,
                        help="processes the client's callers are spread over (2)")
    parser.add_argument("--grpc-client", choices=("h2c", "grpcio"), default="h2c",
                        help="the load client's gRPC side: h2c, a raw HTTP/2 caller about as "
                        "cheap per call as the HTTP one, or grpcio's asyncio client (h2c)")
    parser.add_argument("--workers", type=count, default=2, help="model replicas per server (2)")
    parser.add_argument("--batch-limit", type=count, default=32, help="rows per batch (32)")
    parser.add_argument("--max-wait-ms", type=wait, default=5.0,
                        help="MLServer's and LitServe's batching wait in ms (5)")
    parser.add_argument("--paraloom-max-wait-ms", type=wait, default=0.0,
                        help="paraloom serve's --max-wait-ms (0: batches form under load)")
    parser.add_argument("--paraloom-processes", type=count, default=2,
                        help="paraloom serve --processes; the --workers replicas are divided "
                        "among them (2)")
    parser.add_argument("--paraloom-grpc-backend", choices=("auto", "uvicorn", "grpcio"),
                        default="auto", help="paraloom serve --grpc-backend (auto)")
    parser.add_argument("--image-size", type=count, default=28, help="LeNet input size (28)")
    parser.add_argument("--servers", default="paraloom,mlserver,litserve",
                        help="which servers to measure (paraloom,mlserver,litserve)")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "paraloom" / "bench"),
                        help="where MLServer's venv is created (~/.cache/paraloom/bench)")
    parser.add_argument("--output", type=results_path, default="benchmarks/results/serving.json",
                        help="where to write the results (benchmarks/results/serving.json)")
    features = parser.add_argument_group("features: shared memory and streaming")
    features.add_argument("--features", action=argparse.BooleanOptionalAction, default=True,
                          help="also measure shared memory against inline 1 MiB requests and a "
                          "gRPC stream against unary calls (default: on)")
    features.add_argument("--only-features", action="store_true",
                          help="measure only the features (no MLServer, no LitServe)")
    features.add_argument("--feature-concurrency", default="1,8",
                          help="client concurrency levels of the shared memory rows (1,8)")
    features.add_argument("--stream-requests", type=count, default=1000,
                          help="requests on the stream, and unary calls to compare (1000)")
    features.add_argument("--stream-concurrency", type=count, default=64,
                          help="unary calls in flight against the stream (64)")


def _check_servers(servers: list[str]) -> bool:
    """Whether every server asked for can be measured here; if not, says why on stderr."""
    unknown = sorted(set(servers) - set(CONTENDERS))
    if unknown:
        print(f"paraloom bench serving: unknown servers {unknown}; pick from "
              f"{sorted(CONTENDERS)}", file=sys.stderr)
        return False
    if "litserve" in servers:
        try:
            import litserve  # noqa: F401
        except ImportError:
            print("paraloom bench serving: LitServe is not installed; run 'pip install "
                  "paraloom[bench]' or leave it out of --servers.", file=sys.stderr)
            return False
    return True


def _measurer(args: argparse.Namespace) -> Measure:
    """Load one target with the client ``args`` describe, and print the result."""
    def measure(name: str, target: Target, level: int, pgid: int) -> dict[str, Any]:
        result = run_load(target, concurrency=level, duration=args.duration,
                          warmup=args.warmup, processes=args.client_processes,
                          server_pgid=pgid)
        print(f"  {name} @{level}: {result['requests_per_s']:.0f} req/s, p50 "
              f"{result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms, server CPU "
              f"{result['server_cpu_per_s']:.2f} s/s, client CPU "
              f"{result['client_cpu_per_s']:.2f} s/s, errors {result['errors']}", flush=True)
        return result

    return measure


def _round(index: int, rounds: int, servers: list[str],
           contend: Callable[[str], dict[str, Any]], results: dict[str, Any]
           ) -> dict[str, dict[str, Any]]:
    """One round over every server: its measurements; each server's other facts (or its
    error) go to ``results["servers"]``."""
    order = servers if index % 2 == 0 else servers[::-1]  # interleave, alternate order
    measured: dict[str, dict[str, Any]] = {}
    for server in order:
        print(f"round {index + 1}/{rounds}: {server}", flush=True)
        try:
            got = contend(server)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            print(f"  {server} failed: {e}", file=sys.stderr)
            results["servers"].setdefault(server, {})["error"] = str(e)[-2000:]
            continue
        results["servers"][server] = {k: v for k, v in got.items() if "@" not in k}
        measured.update({k: v for k, v in got.items() if "@" in k})
    return measured


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; returns 0, or 2 when a server cannot be found or installed."""
    from paraloom.checkpoint import save
    from paraloom.models import LeNet

    if args.only_features:
        return _features_only(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not _check_servers(servers):
        return 2
    torch.manual_seed(0)
    model = LeNet(image_size=args.image_size).eval()
    x = torch.rand(1, 1, args.image_size, args.image_size)
    with torch.no_grad():
        expected = model(x)
    results: dict[str, Any] = {"load_average_before": list(os.getloadavg()), "servers": {}}
    measure = _measurer(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lenet.safetensors"
        save(model, path)

        def contend(server: str) -> dict[str, Any]:
            return CONTENDERS[server](path, x, expected, args, levels, measure)

        rounds = [_round(i, args.rounds, servers, contend, results) for i in range(args.rounds)]
        if args.features:
            results["features"] = run_features(args, Path(tmp))
    results["rounds"] = rounds
    results["medians"] = summarize(rounds)
    results["ratios"] = ratios(results["medians"], levels)
    results["load_average_after"] = list(os.getloadavg())
    write_report(args, results)
    return 0


def _features_only(args: argparse.Namespace) -> int:
    from paraloom.bench.common import machine, write_results

    with tempfile.TemporaryDirectory() as tmp:
        features = run_features(args, Path(tmp))
    path = write_results(args.output, {"benchmark": "serving features", "machine": machine(),
                                       "workers": args.workers, "features": features})
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/serving.py``: the same as ``paraloom bench serving``."""
    parser = argparse.ArgumentParser(prog="paraloom bench serving", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
