"""The import graph: no cycles between modules or between folders; the server stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "paraloom"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import that can run: at import time or in a function (a lazy import still ties
    two modules together); only ``if TYPE_CHECKING:`` blocks are left out."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif not (isinstance(node, ast.If) and _is_type_checking(node)):
            todo += ast.iter_child_nodes(node)
    return found


def _edges(name: str, path: Path) -> set[str]:
    """The paraloom modules ``name`` imports."""
    out: set[str] = set()
    for node in _runtime_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative import
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        out |= {t for t in targets if t in MODULES and t != name}
    return out


GRAPH = {name: _edges(name, path) for name, path in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle in ``graph``, if any (depth-first search)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _folder(module: str) -> str:
    """``paraloom.spark.training.shared`` -> ``paraloom.spark``; top-level modules stand alone."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_the_graph_was_read():
    assert "paraloom.training.wrapper" in GRAPH
    assert "paraloom.training.messages" in GRAPH["paraloom.training.runner"]


def test_no_module_imports_one_that_imports_it_back():
    assert _cycle(GRAPH) is None, " -> ".join(_cycle(GRAPH) or [])


def test_no_folder_imports_one_that_imports_it_back():
    folders: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        if module == "paraloom":
            continue  # the package root only re-exports, lazily
        folders.setdefault(_folder(module), set()).update(
            _folder(t) for t in targets if _folder(t) != _folder(module) and t != "paraloom")
    assert _cycle(folders) is None, " -> ".join(_cycle(folders) or [])


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module, absent", [
    ("paraloom.serving.app", "paraloom.training"),
    ("paraloom.serving.app", "paraloom.sync"),
    ("paraloom.training.wrapper", "paraloom.serving"),
    ("paraloom", "torch"),
])
def test_importing_a_part_does_not_load_another(module, absent):
    code = (f"import sys, {module}; "
            f"print(sorted(m for m in sys.modules if m == {absent!r} "
            f"or m.startswith({absent!r} + '.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == "[]", f"importing {module} loaded {out}"


def test_every_public_name_resolves():
    import paraloom

    assert sorted(paraloom.__all__) == sorted(paraloom._WHERE)
    for name in paraloom.__all__:
        assert getattr(paraloom, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = paraloom.nope


def test_submodules_are_attributes_of_the_package():
    code = ("import paraloom; print(paraloom.sync.AllReduce.__name__, "
            "paraloom.models.LeNet.__name__, 'training' in dir(paraloom))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == "AllReduce LeNet True"
