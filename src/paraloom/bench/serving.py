"""``paraloom bench serving``: LeNet behind ``paraloom serve`` vs LitServe, loaded by ``wrk``.

Both servers get the same LeNet weights, the same worker count and batch limit, and the same
1-row JSON requests at the same concurrency from the same external load generator (wrk, a
closed loop). Writes requests/s and p50/p90/p99 latency for each to a JSON file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from paraloom.bench.common import machine, write_results

__all__ = ["add_arguments", "main", "run"]

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``paraloom bench serving``'s arguments to ``parser``."""
    parser.add_argument("--concurrency", type=int, default=64, help="open connections (64)")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds measured (15)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring (3)")
    parser.add_argument("--wrk-threads", type=int, default=2, help="wrk threads (2)")
    parser.add_argument("--workers", type=int, default=2, help="model replicas per server (2)")
    parser.add_argument("--batch-limit", type=int, default=32, help="rows per batch (32)")
    parser.add_argument("--image-size", type=int, default=28, help="LeNet input size (28)")
    parser.add_argument("--litserve-batch-timeout", type=float, default=0.005,
                        help="LitServe's batch_timeout in seconds (0.005)")
    parser.add_argument("--skip-litserve", action="store_true", help="measure paraloom only")
    parser.add_argument("--no-install", action="store_true",
                        help="never try to apt-get install wrk when it is missing")
    parser.add_argument("--output", default="benchmarks/results/serving.json",
                        help="where to write the results (benchmarks/results/serving.json)")


def _find_wrk(install: bool) -> str | None:
    found = shutil.which("wrk")
    if found or not install:
        return found
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        return None
    print("wrk is not installed; installing it with apt-get (Debian's 'wrk' package) ...")
    for cmd in ([apt, "update", "-qq"], [apt, "install", "-y", "-qq", "wrk"]):
        if subprocess.run(cmd, capture_output=True, timeout=600).returncode != 0:
            return None
    return shutil.which("wrk")


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


def _post_json(url: str, body: bytes, timeout: float = 10.0) -> Any:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def _server(cmd: list[str], ready_url: str, startup_s: float = 120.0) -> Iterator[None]:
    """Run a server process until the block ends; waits (bounded) until ``ready_url`` is 200."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + startup_s
        while _get(ready_url) != 200:  # a server in another process: polling is all we have
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-3000:]
                raise RuntimeError(f"server {cmd[:4]} did not become ready:\n{tail}")
            time.sleep(0.2)
        yield
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


def _wrk(wrk: str, url: str, body: bytes, args: argparse.Namespace, seconds: float
         ) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "body.json").write_bytes(body)
        script = Path(tmp) / "post.lua"
        script.write_text('wrk.method = "POST"\n'
                          f'wrk.body = io.open("{tmp}/body.json", "rb"):read("*a")\n'
                          'wrk.headers["Content-Type"] = "application/json"\n')
        cmd = [wrk, f"-t{args.wrk_threads}", f"-c{args.concurrency}",
               f"-d{max(1, round(seconds))}s", "--latency", "-s", str(script), url]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr.strip()}")
    return _parse_wrk(out.stdout)


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if match is None:
        raise ValueError(f"cannot read wrk latency {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _parse_wrk(text: str) -> dict[str, Any]:
    """requests/s, latency percentiles (ms) and error counts from wrk's ``--latency`` output."""
    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    total = re.search(r"(\d+) requests in", text)
    if rps is None or total is None:
        raise ValueError(f"cannot read wrk's output:\n{text}")
    result: dict[str, Any] = {"requests_per_s": float(rps.group(1)),
                              "requests": int(total.group(1))}
    for pct, value in re.findall(r"^\s+(50|75|90|99)%\s+(\S+)", text, flags=re.M):
        result[f"p{pct}_ms"] = _ms(value)
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    errors = re.search(r"Socket errors:(.*)", text)
    result["non_2xx"] = int(non_2xx.group(1)) if non_2xx else 0
    result["socket_errors"] = errors.group(1).strip() if errors else ""
    return result


def _measure(wrk: str, url: str, body: bytes, args: argparse.Namespace) -> dict[str, Any]:
    if args.warmup > 0:
        _wrk(wrk, url, body, args, args.warmup)
    return _wrk(wrk, url, body, args, args.duration)


def _bench_paraloom(wrk: str, model_path: Path, x: torch.Tensor, expected: torch.Tensor,
                    args: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "paraloom.cli", "serve", str(model_path), "--name", "lenet",
           "--port", str(port), "--workers", str(args.workers), "--batch-limit",
           str(args.batch_limit), "--max-wait-ms", "0", "--queue-limit",
           str(max(256, 4 * args.concurrency)), "--log-level", "warning"]
    body = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.flatten().tolist()}]}).encode()
    url = f"{base}/v2/models/lenet/infer"
    with _server(cmd, f"{base}/v2/health/ready"):
        got = torch.tensor(_post_json(url, body)["outputs"][0]["data"]).reshape(expected.shape)
        result = _measure(wrk, url, body, args)
    result["outputs_match"] = bool(torch.allclose(got, expected, atol=1e-5))
    result["server"] = f"paraloom serve --workers {args.workers} --batch-limit " \
                       f"{args.batch_limit} --max-wait-ms 0"
    return result


def _bench_litserve(wrk: str, model_path: Path, x: torch.Tensor, expected: torch.Tensor,
                    args: argparse.Namespace) -> dict[str, Any]:
    import litserve

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "litserve_lenet.py"
        script.write_text(_LITSERVE_SERVER)
        cmd = [sys.executable, str(script), str(model_path), str(port), str(args.workers),
               str(args.batch_limit), str(args.litserve_batch_timeout), str(threads)]
        body = json.dumps({"input": x[0].tolist()}).encode()
        with _server(cmd, f"{base}/health"):
            got = torch.tensor(_post_json(f"{base}/predict", body)["output"])
            result = _measure(wrk, f"{base}/predict", body, args)
    result["outputs_match"] = bool(torch.allclose(got.reshape(expected.shape), expected,
                                                  atol=1e-5))
    result["server"] = (f"litserve {litserve.__version__}: max_batch_size={args.batch_limit}, "
                        f"batch_timeout={args.litserve_batch_timeout}, workers_per_device="
                        f"{args.workers}, torch threads per worker={threads}")
    return result


def _summary(results: dict[str, Any]) -> dict[str, Any]:
    ours, theirs = results["paraloom"], results.get("litserve")
    if not theirs:
        return {}
    return {"throughput_ratio": round(ours["requests_per_s"] / theirs["requests_per_s"], 3),
            "p99_ratio": round(ours["p99_ms"] / theirs["p99_ms"], 3),
            "goal_met": ours["requests_per_s"] >= 1.5 * theirs["requests_per_s"]
            and ours["p99_ms"] < theirs["p99_ms"]}


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; returns 0, or 2 when wrk or LitServe cannot be found."""
    from paraloom.checkpoint import save
    from paraloom.models import LeNet

    wrk = _find_wrk(install=not args.no_install)
    if wrk is None:
        print("paraloom bench serving: wrk (the HTTP load generator) was not found. Install it "
              "with 'sudo apt-get install wrk' (Debian/Ubuntu) or 'brew install wrk' (macOS), "
              "then run again.", file=sys.stderr)
        return 2
    if not args.skip_litserve:
        try:
            import litserve  # noqa: F401
        except ImportError:
            print("paraloom bench serving: LitServe is not installed; run 'pip install "
                  "paraloom[bench]' or pass --skip-litserve.", file=sys.stderr)
            return 2
    torch.manual_seed(0)
    model = LeNet(image_size=args.image_size).eval()
    x = torch.rand(1, 1, args.image_size, args.image_size)
    with torch.no_grad():
        expected = model(x)
    results: dict[str, Any] = {"load_average_before": list(os.getloadavg())}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lenet.safetensors"
        save(model, path)
        results["paraloom"] = _bench_paraloom(wrk, path, x, expected, args)
        print("paraloom:", json.dumps(results["paraloom"]))
        if not args.skip_litserve:
            results["litserve"] = _bench_litserve(wrk, path, x, expected, args)
            print("litserve:", json.dumps(results["litserve"]))
    results["load_average_after"] = list(os.getloadavg())
    _write(args, results)
    return 0


def _write(args: argparse.Namespace, results: dict[str, Any]) -> None:
    report = {
        "benchmark": "serving", "model": f"LeNet(image_size={args.image_size})",
        "request": "1 row, v2 JSON (paraloom) / LitServe JSON, same 784 float32 values",
        "load": f"wrk -t{args.wrk_threads} -c{args.concurrency} -d{args.duration}s --latency "
                f"(after {args.warmup}s warm-up)",
        "machine": machine(),
        "note": "wrk, both servers and their workers share this machine's cores; a load "
                "average above the core count means other work ran too and the numbers are "
                "noisy",
        **results, "summary": _summary(results),
    }
    print(f"wrote {write_results(args.output, report)}")
    if report["summary"]:
        print("summary:", json.dumps(report["summary"]))


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/serving.py``: the same as ``paraloom bench serving``."""
    parser = argparse.ArgumentParser(prog="paraloom bench serving", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
