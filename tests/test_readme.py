"""The README is the quickstart and docs/ the manual: their sections and links exist, their
commands exist, their Python parses, and the blocks that need nothing else run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = sorted((ROOT / "docs").rglob("*.md"))
MANUAL = re.sub(r"```python\n--8<--[^`]*```", "", README + "".join(p.read_text() for p in PAGES))
"""The README and every docs page: where the code examples are (less the blocks that include a
file of examples/, which tests/test_examples.py runs)."""

SECTIONS = ["Quickstart", "Training on every core or GPU", "Inference", "Serving", "Spark",
            "GPU", "Benchmarks", "Development"]


@pytest.mark.parametrize("section", SECTIONS)
def test_every_section_is_there(section):
    assert re.search(rf"^## {re.escape(section)}", README, flags=re.M), section


def test_the_readme_is_a_quickstart_whose_links_lead_somewhere():
    assert len(README.splitlines()) <= 300
    links = re.findall(r"\]\(((?:docs/)[^)#]+)", README)
    assert len(links) >= 20
    for link in links:
        assert (ROOT / link).exists(), link


def test_the_quickstart_commands_exist_and_ci_runs_the_test_command():
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        assert f"{script}" in README and (ROOT / script).exists()
    assert "scripts/test.sh" in (ROOT / ".ci/run").read_text()


def test_every_python_example_parses():
    blocks = re.findall(r"```python\n(.*?)```", MANUAL, flags=re.S)
    assert len(blocks) >= 15
    for block in blocks:
        compile(block, "README.md or docs/", "exec")


def _free_names(code: str) -> set[str]:
    """Names a block reads before binding them (nor are builtins): what it expects from
    elsewhere. Statement by statement; within one statement (a def, a with) order is ignored."""
    import ast
    import builtins

    bound, free = set(dir(builtins)) | {"__name__"}, set()
    for statement in ast.parse(code).body:
        loaded, stored = set(), set()
        for node in ast.walk(statement):
            if isinstance(node, ast.Name):
                (loaded if isinstance(node.ctx, ast.Load) else stored).add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                stored.add(node.name)
            elif isinstance(node, ast.arg):
                stored.add(node.arg)
            elif isinstance(node, ast.alias):
                stored.add((node.asname or node.name).split(".")[0])
        free |= loaded - bound - stored
        bound |= stored
    return free


# Blocks that need something a test cannot have: a running server, a JVM, the network.
_EXTERNAL = ("tritonclient", "SparkSession", "serve(app")


def _standalone_blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", MANUAL, flags=re.S)
    return [b for b in blocks if not _free_names(b) and not any(x in b for x in _EXTERNAL)]


def test_the_complete_examples_import_what_they_use():
    blocks = re.findall(r"```python\n(.*?)```", MANUAL, flags=re.S)
    for needle in ("EarlyStoppingConfig(", "ParallelInference(model, inference_mode",
                   "paraloom.save(model"):
        block = next(b for b in blocks if needle in b)
        assert not _free_names(block), (needle, _free_names(block))


@pytest.mark.parametrize("index", range(len(_standalone_blocks())))
def test_the_standalone_examples_run(index, tmp_path, monkeypatch):
    """Each block that needs nothing from elsewhere runs as written (in a fresh namespace, in
    a scratch folder); what it guards with ``if __name__ == "__main__":`` (long training) is
    left out."""
    monkeypatch.chdir(tmp_path)
    code = _standalone_blocks()[index]
    exec(compile(code, f"README.md/docs block {index}", "exec"), {"__name__": "readme_example"})
