"""scripts/gpu-check.sh: its no-GPU path (here), and the report it ends with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paraloom.bench import gpu_report

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(60)


def test_without_cuda_it_says_so_in_one_line_and_exits_0() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PARALOOM_PYTHON": sys.executable}
    done = subprocess.run([str(ROOT / "scripts" / "gpu-check.sh")], env=env, timeout=50,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"gpu-check: no CUDA device (torch.cuda.is_available() is False in {sys.executable}); "
        "nothing to check"]


def _junit(path: Path, failed: bool) -> None:
    failure = '<failure message="boom"/>' if failed else ""
    path.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_cuda" name="test_one_worker_trains_on_the_gpu"/>'
        f'<testcase classname="tests.test_cuda" name="test_bf16">{failure}'
        '<system-err>noise\n{"accuracy": {"32-true": 0.97, "bf16-mixed": 0.965}}\n{not json'
        '</system-err></testcase>'
        '<testcase classname="tests.test_cuda" name="test_nccl">'
        '<skipped message="needs 2 GPUs for NCCL"/></testcase>'
        '</testsuite></testsuites>')


def _scaling(path: Path, allreduce: float) -> None:
    rows = [{"gpus": 1, "mode": "ddp", "samples_per_s": 1000.0, "speedup": 0.9,
             "efficiency": 0.9, "ratio_to_ddp": 1.0},
            {"gpus": 1, "mode": "allreduce", "samples_per_s": 1000.0 * allreduce,
             "speedup": 0.9 * allreduce, "efficiency": 0.9 * allreduce,
             "ratio_to_ddp": allreduce}]
    path.write_text(json.dumps({"machine": {"gpus": ["NVIDIA H100"]}, "scaling": rows}))


def test_the_report_counts_tests_and_passes_at_the_goal(tmp_path, capsys) -> None:
    _junit(tmp_path / "cuda-tests.xml", failed=False)
    _scaling(tmp_path / "training_cuda.json", allreduce=0.97)
    assert gpu_report.main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "gpu-check on 1 x NVIDIA H100" in printed
    assert "CUDA tests: 2 passed, 0 failed, 1 skipped" in printed
    assert "skipped test_nccl: needs 2 GPUs for NCCL" in printed
    assert 'test_bf16: {"accuracy": {"32-true": 0.97, "bf16-mixed": 0.965}}' in printed
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["problems"] == [] and summary["tests"]["passed"] == 2
    assert summary["tests"]["measured"] == {
        "test_bf16": {"accuracy": {"32-true": 0.97, "bf16-mixed": 0.965}}}


def test_the_report_fails_on_a_failed_test_a_slow_allreduce_or_a_missing_file(tmp_path) -> None:
    _junit(tmp_path / "cuda-tests.xml", failed=True)
    _scaling(tmp_path / "training_cuda.json", allreduce=0.9)
    summary, problems = gpu_report.summarize(tmp_path)
    assert problems == ["test failed: test_bf16",
                        "allreduce on 1 GPU(s) at 0.90 of DDP (goal 0.95)"]
    assert gpu_report.main([str(tmp_path)]) == 1
    (tmp_path / "training_cuda.json").unlink()
    _, problems = gpu_report.summarize(tmp_path)
    assert problems[-1].startswith("no benchmark results")
