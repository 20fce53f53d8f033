"""Every script in examples/ runs (``--quick``: a few seconds of training) and prints what it
promises: replicas equal, results exact, bytes saved.

Each runs in this process as ``__main__`` (``runpy``), as ``python examples/NAME.py --quick``
would run it: the workers then come from this process's forkserver, started once, instead of
one forkserver per script (about 10 s each)."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

EXPECTED = {
    "train_on_every_core.py": r"test accuracy 0\.\d+",
    "compressed_sharing.py": r"1/(?P<ratio>\d+)\)",
    "slow_network_diloco.py": r"1/(?P<ratio>\d+)\)",
    "early_stopping.py": r"stopped: epoch_condition after 2 epochs",
    "checkpoint_and_resume.py": r"resumed equals uninterrupted: True",
    "survive_failures.py": r"failures survived 1; equals the fault-free run: True",
    "parallel_inference.py": r"answers equal the model's own: True",
    "serve_and_call.py": r"equals the model's own: True",
    "spark_local.py": r"replicas identical True",
}


def _shown_output(script: str) -> list[str]:
    """The output docs/examples.md shows for ``script``."""
    page = (ROOT / "docs" / "examples.md").read_text()
    assert f"`examples/{script}`" in page, f"docs/examples.md does not show {script}"
    section = page.split(f"`examples/{script}`", 1)[1]
    block = re.search(r"Output \(`--quick`\):\s*```text\n(.*?)```", section, re.S)
    assert block, f"docs/examples.md shows no output for {script}"
    return block.group(1).strip().splitlines()


def _shape(lines: list[str]) -> list[str]:
    """Lines with their numbers masked: what stays the same from run to run."""
    masked = [re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", line.strip()) for line in lines
              if line.strip()]
    return [re.sub(r"N(: N)?(, N(: N)?)+", "N, ...", line) for line in masked]  # any length


def _in_order(wanted: list[str], got: list[str]) -> bool:
    rest = iter(got)
    return all(any(line == have for have in rest) for line in wanted)


def test_every_example_is_checked():
    assert sorted(p.name for p in (ROOT / "examples").glob("[!_]*.py")) == sorted(EXPECTED)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_the_example_runs_and_says_what_it_promises(script, monkeypatch, capsys):
    if script == "spark_local.py":
        pytest.importorskip("pyspark")
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.setattr(sys, "argv", [script, "--quick"])
    monkeypatch.delitem(sys.modules, "_common", raising=False)  # reads --quick when imported
    runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
    out = capsys.readouterr().out
    found = re.search(EXPECTED[script], out)
    assert found, out
    # The page shows what the script prints (numbers aside): update it when this fails.
    assert _in_order(_shape(_shown_output(script)), _shape(out.splitlines())), out
    if "ratio" in found.groupdict():
        assert int(found["ratio"]) >= 50  # at least 50 times fewer bytes than all-reduce
