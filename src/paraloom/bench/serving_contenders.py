"""The servers ``paraloom bench serving`` measures: ``paraloom serve``, MLServer and LitServe.

Each contender starts its server on the same LeNet file with the same workers, torch threads per
worker and batch limit, checks one answer against the model's own output, then measures every
transport it offers at every concurrency level. MLServer is installed from PyPI into its own
venv under ``--cache-dir``, so its pins never touch this environment.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from paraloom.bench.load import Target
from paraloom.bench.serving_processes import free_port, run_server
from paraloom.bench.serving_requests import (
    GRPC_INFER,
    check_grpc,
    grpc_request,
    matches,
    post_json,
    v2_binary,
    v2_json,
)

__all__ = ["CONTENDERS", "Contender", "Measure"]

Measure = Callable[[str, Target, int, int], dict[str, Any]]
"""Measure one target: (its name, the target, the concurrency, the server's process group) ->
``run_load``'s result."""

Contender = Callable[[Path, torch.Tensor, torch.Tensor, argparse.Namespace, list[int], Measure],
                     dict[str, Any]]
"""Serve the model file, check an answer (input, expected output), measure each transport at
each level: ``{"outputs_match": ..., "<name> @<level>": result, ..., "server": description}``."""

_MLSERVER = "mlserver==1.7.1"
_MLSERVER_PINS = ["uvloop<0.22", "safetensors"]  # its workers fail to start with uvloop 0.23
_V2_INFER = "/v2/models/lenet/infer"

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


def _threads_per_worker(workers: int) -> int:
    """Torch threads per replica: the cores shared out over ``workers``."""
    return max(1, (os.cpu_count() or 1) // workers)


def _measure_levels(targets: dict[str, Target], levels: list[int], measure: Measure,
                    pgid: int) -> dict[str, dict[str, Any]]:
    """Every target at every level, level by level: ``{"<name> @<level>": result}``."""
    return {f"{name} @{level}": measure(name, target, level, pgid)
            for level in levels for name, target in targets.items()}


def _paraloom_targets(port: int, grpc_port: int, x: torch.Tensor, grpc_client: str
                      ) -> dict[str, Target]:
    binary_body, header = v2_binary(x)
    return {
        "paraloom http json": Target("127.0.0.1", port, v2_json(x), path=_V2_INFER),
        "paraloom http binary": Target("127.0.0.1", port, binary_body, path=_V2_INFER, headers=(
            ("Content-Type", "application/octet-stream"),
            ("Inference-Header-Content-Length", str(header)))),
        "paraloom grpc": Target("127.0.0.1", grpc_port, grpc_request(x), method=GRPC_INFER,
                                grpcio=grpc_client == "grpcio"),
    }


def _paraloom(path: Path, x: torch.Tensor, expected: torch.Tensor, args: argparse.Namespace,
              levels: list[int], measure: Measure) -> dict[str, Any]:
    port, grpc_port = free_port(), free_port()
    threads = _threads_per_worker(args.workers)
    processes = max(1, min(args.paraloom_processes, args.workers))
    workers = max(1, args.workers // processes)  # the same replicas in all: processes x workers
    cmd = [sys.executable, "-m", "paraloom.cli", "serve", str(path), "--name", "lenet",
           "--port", str(port), "--grpc-port", str(grpc_port), "--workers", str(workers),
           "--processes", str(processes), "--grpc-backend", args.paraloom_grpc_backend,
           "--batch-limit", str(args.batch_limit), "--max-wait-ms",
           str(args.paraloom_max_wait_ms), "--threads-per-worker", str(threads),
           "--queue-limit", str(max(256, 4 * max(levels))), "--log-level", "warning"]
    base = f"http://127.0.0.1:{port}"
    targets = _paraloom_targets(port, grpc_port, x, args.grpc_client)
    out: dict[str, Any] = {}
    with run_server(cmd, f"{base}/v2/health/ready") as pgid:
        answer = post_json(base + _V2_INFER, targets["paraloom http json"].body)
        out["outputs_match"] = (matches(answer["outputs"][0]["data"], expected)
                                and check_grpc(grpc_port, targets["paraloom grpc"].body,
                                               expected))
        out.update(_measure_levels(targets, levels, measure, pgid))
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


def _mlserver_settings(root: Path, path: Path, args: argparse.Namespace,
                       ports: tuple[int, int, int], threads: int) -> None:
    """Write MLServer's runtime, server settings and model settings into ``root``."""
    port, grpc_port, metrics_port = ports
    src = str(Path(__file__).resolve().parents[2])  # the folder holding the paraloom package
    (root / "runtime.py").write_text(_MLSERVER_RUNTIME)
    (root / "settings.json").write_text(json.dumps({
        "debug": False, "host": "127.0.0.1", "http_port": port, "grpc_port": grpc_port,
        "metrics_port": metrics_port, "parallel_workers": args.workers}))
    (root / "model-settings.json").write_text(json.dumps({
        "name": "lenet", "implementation": "runtime.LeNetRuntime",
        "max_batch_size": args.batch_limit, "max_batch_time": args.max_wait_ms / 1e3,
        "parameters": {"uri": str(path), "extra": {"paraloom_src": src,
                                                   "threads": threads}}}))


def _mlserver(path: Path, x: torch.Tensor, expected: torch.Tensor, args: argparse.Namespace,
              levels: list[int], measure: Measure) -> dict[str, Any]:
    python = _mlserver_python(Path(args.cache_dir))
    port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    threads = _threads_per_worker(args.workers)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _mlserver_settings(root, path, args, (port, grpc_port, metrics_port), threads)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        cmd = [str(python.parent / "mlserver"), "start", str(root)]
        base = f"http://127.0.0.1:{port}"
        json_body = v2_json(x)
        grpc_body = grpc_request(x)
        with run_server(cmd, f"{base}/v2/models/lenet/ready", env=env) as pgid:
            out["outputs_match"] = matches(post_json(base + _V2_INFER, json_body)
                                           ["outputs"][0]["data"], expected)
            try:
                out["grpc_outputs_match"] = check_grpc(grpc_port, grpc_body, expected)
            except Exception as e:  # reported, not fatal: its HTTP numbers still stand
                out["grpc_outputs_match"] = f"{type(e).__name__}: {e}"
            targets = {"mlserver http json": Target("127.0.0.1", port, json_body,
                                                    path=_V2_INFER)}
            if out["grpc_outputs_match"] is True:
                targets["mlserver grpc"] = Target("127.0.0.1", grpc_port, grpc_body,
                                                  method=GRPC_INFER,
                                                  grpcio=args.grpc_client == "grpcio")
            out.update(_measure_levels(targets, levels, measure, pgid))
    out["server"] = (f"{_MLSERVER}: parallel_workers={args.workers}, max_batch_size="
                     f"{args.batch_limit}, max_batch_time={args.max_wait_ms / 1e3} s, torch "
                     f"threads per worker={threads}")
    return out


def _litserve(path: Path, x: torch.Tensor, expected: torch.Tensor, args: argparse.Namespace,
              levels: list[int], measure: Measure) -> dict[str, Any]:
    import litserve

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    threads = _threads_per_worker(args.workers)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "litserve_lenet.py"
        script.write_text(_LITSERVE_SERVER)
        cmd = [sys.executable, str(script), str(path), str(port), str(args.workers),
               str(args.batch_limit), str(args.max_wait_ms / 1e3), str(threads)]
        body = json.dumps({"input": x[0].tolist()}).encode()
        with run_server(cmd, f"{base}/health") as pgid:
            out["outputs_match"] = matches(post_json(f"{base}/predict", body)["output"],
                                           expected)
            target = Target("127.0.0.1", port, body, path="/predict")
            out.update(_measure_levels({"litserve http json": target}, levels, measure, pgid))
    out["server"] = (f"litserve {litserve.__version__}: max_batch_size={args.batch_limit}, "
                     f"batch_timeout={args.max_wait_ms / 1e3}, workers_per_device="
                     f"{args.workers}, torch threads per worker={threads}")
    return out


CONTENDERS: dict[str, Contender] = {"paraloom": _paraloom, "mlserver": _mlserver,
                                    "litserve": _litserve}
"""Each server the benchmark can measure, by its ``--servers`` name."""
