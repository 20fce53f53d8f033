"""``paraloom bench serving``: LeNet behind ``paraloom serve`` (HTTP and gRPC), MLServer, LitServe.

Every server gets the same LeNet weights, the same worker count, torch threads per worker and
batch limit, and the same requests (one row, 784 FP32 values) from the same closed-loop client
(``paraloom.bench.load``) at each concurrency. MLServer (installed from PyPI into its own venv
under a cache folder, so its pins never touch this environment) serves the model with a custom
runtime and adaptive batching; LitServe with its batching. Servers and concurrency levels are
measured in interleaved rounds; the report gives medians over rounds, ratios against MLServer
and LitServe, and the server's CPU use. Writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paraloom.bench.common import machine, pyplot, save_figure, write_results
from paraloom.bench.load import Target, run_load

__all__ = ["add_arguments", "main", "run", "summarize"]

_MLSERVER = "mlserver==1.7.1"
_MLSERVER_PINS = ["uvloop<0.22", "safetensors"]  # its workers fail to start with uvloop 0.23
_GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"

_LITSERVE_SERVER = '''
import sys, torch, litserve as ls, paraloom
path, port, workers, batch, timeout, threads = (sys.argv + [""] * 7)[1:7]

class LeNetAPI(ls.LitAPI):
    def setup(self, device):
        torch.set_num_threads(int(threads))
        self.model = paraloom.load(path).eval()
    def decode_request(self, request):
        return torch.tensor(request["input"], dtype=torch.float32)
    def predict(self, x):
        with torch.inference_mode():
            return self.model(x)
    def encode_response(self, output):
        return {"output": output.tolist()}

if __name__ == "__main__":  # LitServe spawns its workers: they re-import this file
    api = LeNetAPI(max_batch_size=int(batch), batch_timeout=float(timeout))
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=int(workers))
    server.run(host="127.0.0.1", port=int(port), log_level="warning",
               generate_client_file=False)
'''

_MLSERVER_RUNTIME = '''
import sys
import torch
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class LeNetRuntime(MLModel):
    """The same paraloom file, read by paraloom's own loader (torch and safetensors only)."""

    async def load(self) -> bool:
        extra = self.settings.parameters.extra
        sys.path.insert(0, extra["paraloom_src"])
        import paraloom

        torch.set_num_threads(int(extra["threads"]))
        self.model = paraloom.load(self.settings.parameters.uri).eval()
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0])
        with torch.inference_mode():
            y = self.model(torch.from_numpy(x)).numpy()
        return InferenceResponse(model_name=self.name,
                                 outputs=[NumpyCodec.encode_output("output", y)])
'''


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``paraloom bench serving``'s arguments to ``parser``."""
    parser.add_argument("--concurrency", default="1,16,64",
                        help="client concurrency levels, comma-separated (1,16,64)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured (5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before measuring (1)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="interleaved rounds over every server; medians are reported (2)")
    parser.add_argument("--client-processes", type=int, default=2,
                        help="processes the client's callers are spread over (2)")
    parser.add_argument("--grpc-client", choices=("h2c", "grpcio"), default="h2c",
                        help="the load client's gRPC side: h2c, a raw HTTP/2 caller about as "
                        "cheap per call as the HTTP one, or grpcio's asyncio client (h2c)")
    parser.add_argument("--workers", type=int, default=2, help="model replicas per server (2)")
    parser.add_argument("--batch-limit", type=int, default=32, help="rows per batch (32)")
    parser.add_argument("--max-wait-ms", type=float, default=5.0,
                        help="MLServer's and LitServe's batching wait in ms (5)")
    parser.add_argument("--paraloom-max-wait-ms", type=float, default=0.0,
                        help="paraloom serve's --max-wait-ms (0: batches form under load)")
    parser.add_argument("--paraloom-processes", type=int, default=2,
                        help="paraloom serve --processes; the --workers replicas are divided "
                        "among them (2)")
    parser.add_argument("--paraloom-grpc-backend", choices=("auto", "uvicorn", "grpcio"),
                        default="auto", help="paraloom serve --grpc-backend (auto)")
    parser.add_argument("--image-size", type=int, default=28, help="LeNet input size (28)")
    parser.add_argument("--servers", default="paraloom,mlserver,litserve",
                        help="which servers to measure (paraloom,mlserver,litserve)")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "paraloom" / "bench"),
                        help="where MLServer's venv is created (~/.cache/paraloom/bench)")
    parser.add_argument("--output", default="benchmarks/results/serving.json",
                        help="where to write the results (benchmarks/results/serving.json)")


def _free_port() -> int:
    with socket.socket() as s:  # the OS picks a free port; the server binds it right after
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except (urllib.error.URLError, OSError):
        return 0


def _post_json(url: str, body: bytes, timeout: float = 30.0) -> Any:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def _server(cmd: list[str], ready_url: str, startup_s: float = 180.0,
            env: dict[str, str] | None = None) -> Iterator[int]:
    """Run a server process group until the block ends; yields its process group id."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)
    try:
        deadline = time.monotonic() + startup_s
        while _get(ready_url) != 200:  # a server in another process: polling is all we have
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-3000:]
                raise RuntimeError(f"server {cmd[:4]} did not become ready:\n{tail}")
            time.sleep(0.2)
        yield proc.pid
    finally:
        _stop(proc)
        log.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    with contextlib.suppress(ProcessLookupError):  # workers left behind in the group
        os.killpg(proc.pid, signal.SIGKILL)


def _v2_json(x: torch.Tensor) -> bytes:
    return json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.flatten().tolist()}]}).encode()


def _v2_binary(x: torch.Tensor) -> tuple[bytes, int]:
    head = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.numel() * 4}}],
                       "parameters": {"binary_data_output": True}}).encode()
    return head + x.numpy().astype("<f4").tobytes(), len(head)


def _grpc_request(x: torch.Tensor) -> bytes:
    from paraloom.serving.grpc.messages import message

    request = message("ModelInferRequest")(model_name="lenet")
    request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.numpy().astype("<f4").tobytes())
    return bytes(request.SerializeToString())


def _check_grpc(port: int, body: bytes, expected: torch.Tensor) -> bool:
    import grpc

    from paraloom.serving.grpc.messages import message

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        raw = channel.unary_unary(_GRPC_INFER)(body, timeout=30)
    response = message("ModelInferResponse").FromString(raw)
    if response.raw_output_contents:
        got = np.frombuffer(response.raw_output_contents[0], dtype="<f4")
    else:
        got = np.asarray(response.outputs[0].contents.fp32_contents, dtype=np.float32)
    return bool(np.allclose(got.reshape(tuple(expected.shape)), expected.numpy(), atol=1e-5))


def _matches(data: Any, expected: torch.Tensor) -> bool:
    got = torch.tensor(data, dtype=torch.float32).reshape(expected.shape)
    return bool(torch.allclose(got, expected, atol=1e-5))


Measure = Callable[[str, Target, int, int], dict[str, Any]]  # name, target, level, pgid


def _paraloom(path: Path, x: torch.Tensor, expected: torch.Tensor, args: argparse.Namespace,
              levels: list[int], measure: Measure) -> dict[str, Any]:
    port, grpc_port = _free_port(), _free_port()
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    processes = max(1, min(args.paraloom_processes, args.workers))
    workers = max(1, args.workers // processes)  # the same replicas in all: processes x workers
    cmd = [sys.executable, "-m", "paraloom.cli", "serve", str(path), "--name", "lenet",
           "--port", str(port), "--grpc-port", str(grpc_port), "--workers", str(workers),
           "--processes", str(processes), "--grpc-backend", args.paraloom_grpc_backend,
           "--batch-limit", str(args.batch_limit), "--max-wait-ms",
           str(args.paraloom_max_wait_ms), "--threads-per-worker", str(threads),
           "--queue-limit", str(max(256, 4 * max(levels))), "--log-level", "warning"]
    base = f"http://127.0.0.1:{port}"
    json_body = _v2_json(x)
    binary_body, header = _v2_binary(x)
    grpc_body = _grpc_request(x)
    out: dict[str, Any] = {}
    with _server(cmd, f"{base}/v2/health/ready") as pgid:
        out["outputs_match"] = (_matches(_post_json(f"{base}/v2/models/lenet/infer", json_body)
                                         ["outputs"][0]["data"], expected)
                                and _check_grpc(grpc_port, grpc_body, expected))
        targets = {
            "paraloom http json": Target("127.0.0.1", port, json_body,
                                         path="/v2/models/lenet/infer"),
            "paraloom http binary": Target("127.0.0.1", port, binary_body,
                                           path="/v2/models/lenet/infer", headers=(
                                               ("Content-Type", "application/octet-stream"),
                                               ("Inference-Header-Content-Length",
                                                str(header)))),
            "paraloom grpc": Target("127.0.0.1", grpc_port, grpc_body, method=_GRPC_INFER,
                                    grpcio=args.grpc_client == "grpcio"),
        }
        for level in levels:
            for name, target in targets.items():
                out[f"{name} @{level}"] = measure(name, target, level, pgid)
    from paraloom.serving.server import resolve_grpc_backend

    out["server"] = (f"paraloom serve --processes {processes} --workers {workers} --grpc-backend "
                     f"{resolve_grpc_backend(args.paraloom_grpc_backend)} --batch-limit "
                     f"{args.batch_limit} --max-wait-ms {args.paraloom_max_wait_ms} "
                     f"--threads-per-worker {threads}")
    return out


def _mlserver_python(cache: Path) -> Path:
    """MLServer's own venv under ``cache`` (created, with pip, on first use)."""
    venv = cache / "mlserver-1.7.1"
    python = venv / "bin" / "python"
    marker = venv / ".paraloom-ready"
    if marker.exists():
        return python
    print(f"installing {_MLSERVER} into its own venv at {venv} (once) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", _MLSERVER, *_MLSERVER_PINS,
                           torch_pin], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"pip could not install {_MLSERVER}: {done.stderr[-2000:]}")
    marker.write_text("ok\n")
    return python


def _mlserver(path: Path, x: torch.Tensor, expected: torch.Tensor, args: argparse.Namespace,
              levels: list[int], measure: Measure) -> dict[str, Any]:
    python = _mlserver_python(Path(args.cache_dir))
    port, grpc_port, metrics_port = _free_port(), _free_port(), _free_port()
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    src = str(Path(__file__).resolve().parents[2])  # the folder holding the paraloom package
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "runtime.py").write_text(_MLSERVER_RUNTIME)
        (root / "settings.json").write_text(json.dumps({
            "debug": False, "host": "127.0.0.1", "http_port": port, "grpc_port": grpc_port,
            "metrics_port": metrics_port, "parallel_workers": args.workers}))
        (root / "model-settings.json").write_text(json.dumps({
            "name": "lenet", "implementation": "runtime.LeNetRuntime",
            "max_batch_size": args.batch_limit, "max_batch_time": args.max_wait_ms / 1e3,
            "parameters": {"uri": str(path), "extra": {"paraloom_src": src,
                                                       "threads": threads}}}))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        cmd = [str(python.parent / "mlserver"), "start", str(root)]
        base = f"http://127.0.0.1:{port}"
        json_body = _v2_json(x)
        grpc_body = _grpc_request(x)
        with _server(cmd, f"{base}/v2/models/lenet/ready", env=env) as pgid:
            out["outputs_match"] = _matches(_post_json(f"{base}/v2/models/lenet/infer",
                                                       json_body)["outputs"][0]["data"],
                                            expected)
            try:
                out["grpc_outputs_match"] = _check_grpc(grpc_port, grpc_body, expected)
            except Exception as e:  # reported, not fatal: its HTTP numbers still stand
                out["grpc_outputs_match"] = f"{type(e).__name__}: {e}"
            targets = {"mlserver http json": Target("127.0.0.1", port, json_body,
                                                    path="/v2/models/lenet/infer")}
            if out["grpc_outputs_match"] is True:
                targets["mlserver grpc"] = Target("127.0.0.1", grpc_port, grpc_body,
                                                  method=_GRPC_INFER,
                                                  grpcio=args.grpc_client == "grpcio")
            for level in levels:
                for name, target in targets.items():
                    out[f"{name} @{level}"] = measure(name, target, level, pgid)
    out["server"] = (f"{_MLSERVER}: parallel_workers={args.workers}, max_batch_size="
                     f"{args.batch_limit}, max_batch_time={args.max_wait_ms / 1e3} s, torch "
                     f"threads per worker={threads}")
    return out


def _litserve(path: Path, x: torch.Tensor, expected: torch.Tensor, args: argparse.Namespace,
              levels: list[int], measure: Measure) -> dict[str, Any]:
    import litserve

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "litserve_lenet.py"
        script.write_text(_LITSERVE_SERVER)
        cmd = [sys.executable, str(script), str(path), str(port), str(args.workers),
               str(args.batch_limit), str(args.max_wait_ms / 1e3), str(threads)]
        body = json.dumps({"input": x[0].tolist()}).encode()
        with _server(cmd, f"{base}/health") as pgid:
            out["outputs_match"] = _matches(_post_json(f"{base}/predict", body)["output"],
                                            expected)
            target = Target("127.0.0.1", port, body, path="/predict")
            for level in levels:
                out[f"litserve http json @{level}"] = \
                    measure("litserve http json", target, level, pgid)
    out["server"] = (f"litserve {litserve.__version__}: max_batch_size={args.batch_limit}, "
                     f"batch_timeout={args.max_wait_ms / 1e3}, workers_per_device="
                     f"{args.workers}, torch threads per worker={threads}")
    return out


_SERVERS = {"paraloom": _paraloom, "mlserver": _mlserver, "litserve": _litserve}


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


def _ratios(medians: dict[str, dict[str, Any]], levels: list[int]) -> dict[str, Any]:
    ratios: dict[str, Any] = {}
    for level in levels:
        ours = medians.get(f"paraloom http json @{level}")
        grpc = medians.get(f"paraloom grpc @{level}")
        for other in ("mlserver http json", "litserve http json"):
            theirs = medians.get(f"{other} @{level}")
            if ours and theirs and theirs["requests_per_s"]:
                ratios[f"vs {other} @{level}"] = {
                    "throughput": round(ours["requests_per_s"] / theirs["requests_per_s"], 2),
                    "p99": round(ours["p99_ms"] / theirs["p99_ms"], 2)}
        if ours and grpc:
            ratios[f"grpc vs http json @{level}"] = round(
                grpc["requests_per_s"] / ours["requests_per_s"], 2)
    return ratios


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; returns 0, or 2 when a server cannot be found or installed."""
    from paraloom.checkpoint import save
    from paraloom.models import LeNet

    levels = [int(c) for c in args.concurrency.split(",")]
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = sorted(set(servers) - set(_SERVERS))
    if unknown:
        print(f"paraloom bench serving: unknown servers {unknown}; pick from "
              f"{sorted(_SERVERS)}", file=sys.stderr)
        return 2
    if "litserve" in servers:
        try:
            import litserve  # noqa: F401
        except ImportError:
            print("paraloom bench serving: LitServe is not installed; run 'pip install "
                  "paraloom[bench]' or leave it out of --servers.", file=sys.stderr)
            return 2
    torch.manual_seed(0)
    model = LeNet(image_size=args.image_size).eval()
    x = torch.rand(1, 1, args.image_size, args.image_size)
    with torch.no_grad():
        expected = model(x)
    results: dict[str, Any] = {"load_average_before": list(os.getloadavg()), "servers": {}}
    rounds: list[dict[str, dict[str, Any]]] = []

    def measure(name: str, target: Target, level: int, pgid: int) -> dict[str, Any]:
        result = run_load(target, concurrency=level, duration=args.duration,
                          warmup=args.warmup, processes=args.client_processes,
                          server_pgid=pgid)
        print(f"  {name} @{level}: {result['requests_per_s']:.0f} req/s, p50 "
              f"{result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms, server CPU "
              f"{result['server_cpu_per_s']:.2f} s/s, client CPU "
              f"{result['client_cpu_per_s']:.2f} s/s, errors {result['errors']}", flush=True)
        return result

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lenet.safetensors"
        save(model, path)
        for index in range(args.rounds):
            order = servers if index % 2 == 0 else servers[::-1]  # interleave, alternate order
            measured: dict[str, dict[str, Any]] = {}
            for server in order:
                print(f"round {index + 1}/{args.rounds}: {server}", flush=True)
                try:
                    got = _SERVERS[server](path, x, expected, args, levels, measure)
                except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                    print(f"  {server} failed: {e}", file=sys.stderr)
                    results["servers"].setdefault(server, {})["error"] = str(e)[-2000:]
                    continue
                results["servers"][server] = {k: v for k, v in got.items() if "@" not in k}
                measured.update({k: v for k, v in got.items() if "@" in k})
            rounds.append(measured)
    results["rounds"] = rounds
    results["medians"] = summarize(rounds)
    results["ratios"] = _ratios(results["medians"], levels)
    results["load_average_after"] = list(os.getloadavg())
    _write(args, results)
    return 0


def _write(args: argparse.Namespace, results: dict[str, Any]) -> None:
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


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/serving.py``: the same as ``paraloom bench serving``."""
    parser = argparse.ArgumentParser(prog="paraloom bench serving", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
