"""The table ``scripts/gpu-check.sh`` ends with: what ran on the GPU and what it measured.

``python -m paraloom.bench.gpu_report DIR`` reads the CUDA tests' JUnit XML and the GPU
scaling JSON that the check wrote in DIR, prints one table, and writes ``DIR/summary.json``.
Exits 1 when a test failed, a file is missing, or allreduce fell below 0.95 of DDP.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, TypedDict

__all__ = ["ALLREDUCE_GOAL", "TestCounts", "main", "summarize", "test_counts"]

ALLREDUCE_GOAL = 0.95
"""allreduce's rate over DDP's on as many GPUs that the check asks for."""


class TestCounts(TypedDict):
    passed: int
    failed: int
    skipped: int
    failures: list[str]
    skips: list[str]
    measured: dict[str, Any]


def test_counts(path: Path) -> TestCounts:
    """Passed, failed and skipped tests in a pytest ``--junitxml`` file (our own output)."""
    counts: TestCounts = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "skips": [],
                          "measured": {}}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = case.get("name", "?")
        measured = _measured(case)
        if measured:
            counts["measured"][name] = measured
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            counts["failures"].append(name)
        elif (skipped := case.find("skipped")) is not None:
            counts["skipped"] += 1
            counts["skips"].append(f"{name}: {skipped.get('message', '')}")
        else:
            counts["passed"] += 1
    return counts


def _measured(case: ElementTree.Element) -> dict[str, Any]:
    """What a test printed to stderr as one-line JSON objects (``-o junit_logging=system-err``
    keeps it in the XML), merged: e.g. the accuracies of the bf16 test."""
    out: dict[str, Any] = {}
    for err in case.iter("system-err"):
        for line in (err.text or "").splitlines():
            if line.startswith("{"):
                try:
                    value = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(value, dict):
                    out.update(value)
    return out


def summarize(directory: Path) -> tuple[dict[str, Any], list[str]]:
    """The summary of a check's files, and the problems found (empty: the check passed)."""
    problems: list[str] = []
    summary: dict[str, Any] = {}
    tests = directory / "cuda-tests.xml"
    if tests.exists():
        counts = summary["tests"] = test_counts(tests)
        problems += [f"test failed: {name}" for name in counts["failures"]]
    else:
        problems.append(f"no test results ({tests} is missing: the tests did not finish)")
    scaling = directory / "training_cuda.json"
    if scaling.exists():
        result = json.loads(scaling.read_text())
        summary["gpus"] = result["machine"].get("gpus", [])
        summary["scaling"] = result["scaling"]
        problems += [f"allreduce on {row['gpus']} GPU(s) at {row['ratio_to_ddp']:.2f} of DDP "
                     f"(goal {ALLREDUCE_GOAL})" for row in result["scaling"]
                     if row["mode"] == "allreduce" and row["ratio_to_ddp"] < ALLREDUCE_GOAL]
    else:
        problems.append(f"no benchmark results ({scaling} is missing)")
    summary["problems"] = problems
    return summary, problems


def _print(summary: dict[str, Any]) -> None:
    gpus = summary.get("gpus") or ["?"]
    print(f"\ngpu-check on {len(gpus)} x {gpus[0]}")
    tests = summary.get("tests")
    if tests is not None:
        print(f"CUDA tests: {tests['passed']} passed, {tests['failed']} failed, "
              f"{tests['skipped']} skipped")
        for line in tests["skips"]:
            print(f"  skipped {line}")
        for name, measured in tests.get("measured", {}).items():
            print(f"  {name}: {json.dumps(measured)}")
    rows = summary.get("scaling", [])
    if rows:
        print(f"{'mode':<18}{'GPUs':>5}{'samples/s':>12}{'speed-up':>10}{'/DDP':>8}")
        for row in rows:
            print(f"{row['mode']:<18}{row['gpus']:>5}{row['samples_per_s']:>12.0f}"
                  f"{row['speedup']:>10.2f}{row['ratio_to_ddp']:>8.2f}")
    for problem in summary["problems"]:
        print(f"PROBLEM: {problem}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m paraloom.bench.gpu_report DIR (what gpu-check.sh wrote)")
        return 2
    directory = Path(args[0])
    summary, problems = summarize(directory)
    _print(summary)
    (directory / "summary.json").write_text(json.dumps(summary, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
