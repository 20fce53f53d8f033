"""The README is the manual: its sections exist, its commands exist, its Python parses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

SECTIONS = ["Quickstart", "ParallelWrapper", "Training modes", "Early stopping", "Listeners",
            "Checkpoints and exact resume", "Precision", "ParallelInference",
            "Serving over HTTP", "Training on Apache Spark", "Data sets and models",
            "Saving and loading", "Command line", "Benchmarks"]


@pytest.mark.parametrize("section", SECTIONS)
def test_every_section_is_there(section):
    assert re.search(rf"^## {re.escape(section)}", README, flags=re.M), section


def test_the_quickstart_commands_exist_and_ci_runs_the_test_command():
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        assert f"{script}" in README and (ROOT / script).exists()
    assert "scripts/test.sh" in (ROOT / ".ci/run").read_text()


def test_every_python_example_parses():
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(blocks) >= 15
    for block in blocks:
        compile(block, "README.md", "exec")
