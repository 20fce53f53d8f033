"""The report of ``paraloom bench serving``: medians over rounds, ratios, the JSON and the plot."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from paraloom.bench.common import machine, pyplot, save_figure, write_results

__all__ = ["ratios", "summarize", "write_report"]


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Medians over rounds of each ``"<server transport> @<concurrency>"`` measurement."""
    keys = sorted({k for r in rounds for k in r})
    out: dict[str, dict[str, Any]] = {}
    for key in keys:
        runs = [r[key] for r in rounds if key in r]
        out[key] = {f: statistics.median(run[f] for run in runs)
                    for f in ("requests_per_s", "p50_ms", "p99_ms", "server_cpu_per_s")}
        for side in ("server", "client"):  # CPU ms per answered request: median over rounds
            per = [r[f"{side}_cpu_per_s"] / r["requests_per_s"] * 1e3 for r in runs
                   if f"{side}_cpu_per_s" in r and r["requests_per_s"]]
            out[key][f"{side}_cpu_ms_per_request"] = (
                round(statistics.median(per), 3) if per else None)
        out[key]["range_requests_per_s"] = [min(r["requests_per_s"] for r in runs),
                                            max(r["requests_per_s"] for r in runs)]
        out[key]["errors"] = sum(r["errors"] for r in runs)
    return out


def ratios(medians: dict[str, dict[str, Any]], levels: list[int]) -> dict[str, Any]:
    """paraloom's HTTP JSON against the others' (throughput, p99), and its gRPC against it."""
    found: dict[str, Any] = {}
    for level in levels:
        ours = medians.get(f"paraloom http json @{level}")
        grpc = medians.get(f"paraloom grpc @{level}")
        for other in ("mlserver http json", "litserve http json"):
            theirs = medians.get(f"{other} @{level}")
            if ours and theirs and theirs["requests_per_s"]:
                found[f"vs {other} @{level}"] = {
                    "throughput": round(ours["requests_per_s"] / theirs["requests_per_s"], 2),
                    "p99": round(ours["p99_ms"] / theirs["p99_ms"], 2)}
        if ours and grpc:
            found[f"grpc vs http json @{level}"] = round(
                grpc["requests_per_s"] / ours["requests_per_s"], 2)
    return found


def write_report(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Write the results as JSON under ``args.output``, print the ratios, plot the medians."""
    report = {
        "benchmark": "serving", "model": f"LeNet(image_size={args.image_size})",
        "request": "1 row of 784 FP32 values: v2 JSON, v2 binary or gRPC raw contents "
                   "(paraloom, MLServer), LitServe's JSON",
        "load": f"paraloom.bench.load: closed loop, {args.client_processes} client processes, "
                f"gRPC through the {args.grpc_client} caller, "
                f"{args.duration}s measured after {args.warmup}s warm-up, {args.rounds} "
                "interleaved rounds (medians)",
        "machine": machine(),
        "note": "the client, the servers and their workers share this machine's cores; a load "
                "average above the core count means other work ran too and the numbers are "
                "noisy",
        **results,
    }
    path = write_results(args.output, report)
    print(f"wrote {path}")
    print("ratios:", json.dumps(results["ratios"], indent=1))
    _plot(results["medians"], path.with_suffix(".png"))


def _plot(medians: dict[str, dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = sorted({k.rsplit(" @", 1)[0] for k in medians})
    levels = sorted({int(k.rsplit("@", 1)[1]) for k in medians})
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(levels))]
        left.bar(xs, [medians.get(f"{name} @{c}", {}).get("requests_per_s", 0) for c in levels],
                 width, label=name)
        right.bar(xs, [medians.get(f"{name} @{c}", {}).get("p99_ms", 0) for c in levels],
                  width, label=name)
    for ax, label in ((left, "requests/s (median)"), (right, "p99 latency, ms (median)")):
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(levels))],
                      [f"concurrency {c}" for c in levels])
        ax.set_ylabel(label)
    left.legend(fontsize=7)
    save_figure(fig, path)
