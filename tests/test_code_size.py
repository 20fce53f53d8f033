"""Rooms a newcomer can hold: no module in src/paraloom over 500 lines, no function over 60."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "paraloom"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _python_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_over_500_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in _python_files()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these modules by job: {long}"


def test_no_function_is_over_60_lines() -> None:
    long = {}
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = length
    assert not long, f"split these functions: {long}"
