"""``paraloom bench serving --features``: shared memory against inline requests, and a gRPC stream
against unary gRPC calls, each pair measured against the same ``paraloom serve`` process.

Shared memory: a model that takes 1 MiB of FP32 per row (262,144 values) and does little with
them (``PooledHead``: the mean of 64 slices, then a Linear layer to 4 outputs), so that the
transport, not the model, sets the pace, behind ``paraloom serve --shared-memory on``. The
same closed-loop client (``paraloom.bench.load``) sends requests whose input is in a registered
region (a small JSON body naming it) and requests that carry the 1 MiB inline: the binary
extension over HTTP and raw contents over gRPC.

Streaming: LeNet's one-row requests, ``--stream-requests`` of them (1,000) on one
``ModelStreamInfer`` stream, against the same number of unary ``ModelInfer`` calls at
``--stream-concurrency`` (64) calls in flight, both through grpcio's asyncio client in this
process; every answer is checked (its id, its rows). Rounds interleave; medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import urllib.request
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from paraloom.bench.common import bar_plot
from paraloom.bench.load import Target, run_load
from paraloom.bench.serving_processes import free_port, run_server
from paraloom.bench.serving_requests import GRPC_INFER, grpc_request, v2_binary

__all__ = ["FEATURES_WIDTH", "PooledHead", "pooled_head", "run_features"]

FEATURES_WIDTH = 1 << 18
"""FP32 values per row of the shared memory model: 1 MiB."""
_STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
_INFER = "/v2/models/{}/infer"


class PooledHead(nn.Module):
    """A light model over wide rows: the mean of each of 64 slices of a row, then Linear(64, 4).
    One pass over the input, so a request costs what its transport costs."""

    def __init__(self, in_features: int = FEATURES_WIDTH) -> None:
        super().__init__()
        self.config = {"in_features": in_features}
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled: torch.Tensor = self.head(x.reshape(x.shape[0], 64, -1).mean(dim=2))
        return pooled


def pooled_head() -> nn.Module:
    """``paraloom serve --factory paraloom.bench.serving_features:pooled_head``: seeded."""
    torch.manual_seed(0)
    return PooledHead().eval()


def _serve(path: Path | None, name: str, args: argparse.Namespace, extra: list[str]
           ) -> tuple[list[str], int, int]:
    port, grpc_port = free_port(), free_port()
    model = ([str(path)] if path is not None
             else ["--factory", "paraloom.bench.serving_features:pooled_head"])
    cmd = [sys.executable, "-m", "paraloom.cli", "serve", *model, "--name", name,
           "--port", str(port), "--grpc-port", str(grpc_port), "--workers", str(args.workers),
           "--grpc-backend", args.paraloom_grpc_backend, "--batch-limit",
           str(args.batch_limit), "--log-level", "warning", *extra]
    return cmd, port, grpc_port


def _shm_targets(port: int, grpc_port: int, x: torch.Tensor, region: str
                 ) -> dict[str, Target]:
    path = _INFER.format("wide")
    body, header = v2_binary(x)
    in_memory = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape),
                                        "datatype": "FP32", "parameters": {
                                            "shared_memory_region": region,
                                            "shared_memory_byte_size": x.numel() * 4}}],
                            "parameters": {"binary_data_output": True}}).encode()
    binary = (("Content-Type", "application/octet-stream"),
              ("Inference-Header-Content-Length", str(header)))
    return {
        "http inline (binary)": Target("127.0.0.1", port, body, path=path, headers=binary),
        "http shared memory": Target("127.0.0.1", port, in_memory, path=path),
        "grpc inline (raw)": Target("127.0.0.1", grpc_port, grpc_request(x, "wide"),
                                    method=GRPC_INFER),
        "grpc shared memory": Target("127.0.0.1", grpc_port, grpc_request(x, "wide", region),
                                     method=GRPC_INFER),
    }


def _register(port: int, name: str, key: str, size: int) -> None:
    body = json.dumps({"key": key, "offset": 0, "byte_size": size}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v2/systemsharedmemory/region/{name}/register", data=body,
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        r.read()


def _shared_memory_rows(args: argparse.Namespace, levels: list[int]
                        ) -> dict[str, list[dict[str, Any]]]:
    x = torch.rand(1, FEATURES_WIDTH)
    segment = shared_memory.SharedMemory(create=True, size=x.numel() * 4)
    try:
        np.ndarray((x.numel(),), dtype="<f4", buffer=segment.buf)[:] = x.numpy().ravel()
        cmd, port, grpc_port = _serve(None, "wide", args, ["--shared-memory", "on",
                                                           "--max-body-mb", "64"])
        rows: dict[str, list[dict[str, Any]]] = {}
        with run_server(cmd, f"http://127.0.0.1:{port}/v2/health/ready") as pgid:
            _register(port, "bench_input", "/" + segment.name, x.numel() * 4)
            targets = _shm_targets(port, grpc_port, x, "bench_input")
            for index in range(args.rounds):
                order = list(targets) if index % 2 == 0 else list(targets)[::-1]
                for name in order:
                    for level in levels:
                        result = run_load(targets[name], concurrency=level,
                                          duration=args.duration, warmup=args.warmup,
                                          processes=args.client_processes, server_pgid=pgid)
                        print(f"  {name} @{level}: {result['requests_per_s']:.0f} req/s, "
                              f"errors {result['errors']}", flush=True)
                        rows.setdefault(f"{name} @{level}", []).append(result)
        return rows
    finally:
        segment.close()
        segment.unlink()


async def _unary(port: int, bodies: list[bytes], concurrency: int) -> tuple[float, list[bytes]]:
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(GRPC_INFER)
        slots = asyncio.Semaphore(concurrency)

        async def one(body: bytes) -> bytes:
            async with slots:
                answer: bytes = await call(body, timeout=120)
                return answer

        await asyncio.gather(*(one(b) for b in bodies[:50]))  # warm the channel
        started = time.perf_counter()
        answers = await asyncio.gather(*(one(b) for b in bodies))
        return time.perf_counter() - started, list(answers)


async def _stream(port: int, bodies: list[bytes]) -> tuple[float, list[bytes]]:
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await channel.unary_unary(GRPC_INFER)(bodies[0], timeout=120)  # warm the channel
        started = time.perf_counter()
        call = channel.stream_stream(_STREAM)(iter(bodies), timeout=120)
        answers = [bytes(a) async for a in call]
        return time.perf_counter() - started, answers


def _check(answers: list[bytes], sent: int, expected: torch.Tensor, streamed: bool) -> bool:
    """Each of the ``sent`` requests answered once, under its id, with its own rows."""
    from paraloom.serving.grpc.messages import message

    seen: list[int] = []
    for raw in answers:
        if streamed:
            answer = message("ModelStreamInferResponse").FromString(raw)
            if answer.error_message:
                return False
            response = answer.infer_response
        else:
            response = message("ModelInferResponse").FromString(raw)
        i = int(response.id)
        got = np.frombuffer(response.raw_output_contents[0], dtype="<f4")
        if not np.allclose(got, expected[i % len(expected)].numpy(), atol=1e-5):
            return False
        seen.append(i)
    return sorted(seen) == list(range(sent))


def _stream_rows(tmp: Path, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    from paraloom.checkpoint import save
    from paraloom.models import LeNet

    torch.manual_seed(0)
    model = LeNet(image_size=28).eval()
    path = tmp / "lenet.safetensors"
    save(model, path)
    xs = torch.rand(8, 1, 1, 28, 28)
    with torch.no_grad():
        expected = torch.stack([model(x)[0] for x in xs])
    bodies = [grpc_request(xs[i % 8], request_id=str(i))
              for i in range(args.stream_requests)]
    cmd, port, grpc_port = _serve(path, "lenet", args, [])
    rows: dict[str, list[dict[str, Any]]] = {}
    with run_server(cmd, f"http://127.0.0.1:{port}/v2/health/ready"):
        for index in range(args.rounds):
            calls = [("grpc unary", False), ("grpc stream", True)]
            for name, streamed in calls if index % 2 == 0 else calls[::-1]:
                seconds, answers = asyncio.run(
                    _stream(grpc_port, bodies) if streamed
                    else _unary(grpc_port, bodies, args.stream_concurrency))
                result = {"requests": len(answers), "seconds": round(seconds, 3),
                          "requests_per_s": round(len(answers) / seconds, 1),
                          "all_answered_in_their_ids": _check(answers, len(bodies), expected,
                                                              streamed)}
                print(f"  {name}: {result}", flush=True)
                rows.setdefault(name, []).append(result)
    return rows


def _medians(rows: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    return {k: statistics.median(r["requests_per_s"] for r in v) for k, v in rows.items()}


def _ratios(shm: dict[str, float], stream: dict[str, float], levels: list[int]
            ) -> dict[str, float]:
    out = {}
    for level in levels:
        for proto in ("http", "grpc"):
            inline = shm[f"{proto} inline ({'binary' if proto == 'http' else 'raw'}) @{level}"]
            out[f"{proto} shared memory / inline @{level}"] = round(
                shm[f"{proto} shared memory @{level}"] / inline, 2)
    out["grpc stream / unary"] = round(stream["grpc stream"] / stream["grpc unary"], 2)
    return out


def run_features(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Measure both pairs; the rows, their medians and ratios, and a plot beside the JSON."""
    levels = [int(c) for c in args.feature_concurrency.split(",")]
    print("shared memory, 1 MiB per request:", flush=True)
    shm_rows = _shared_memory_rows(args, levels)
    print(f"a stream of {args.stream_requests} requests against unary calls:", flush=True)
    stream_rows = _stream_rows(tmp, args)
    shm, stream = _medians(shm_rows), _medians(stream_rows)
    ratios = _ratios(shm, stream, levels)
    print("feature ratios:", json.dumps(ratios, indent=1), flush=True)
    bar_plot(Path(args.output).with_name(Path(args.output).stem + "_features.png"),
             "paraloom serve: shared memory and streaming (median requests/s)",
             {**shm, **stream}, "requests/s")
    return {"shared_memory": {"rows": shm_rows, "medians": shm,
                              "request": f"1 x {FEATURES_WIDTH} FP32 (1 MiB) per request",
                              "model": "PooledHead (mean of 64 slices, Linear(64, 4))"},
            "streaming": {"rows": stream_rows, "medians": stream,
                          "request": "1 LeNet row (784 FP32) per request",
                          "unary_concurrency": args.stream_concurrency},
            "ratios": ratios}
