"""House rules that the code keeps: no import circle inside quantlib, every module imports, no file over
600 lines."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "quantlib"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(module: str, path: Path, node: ast.AST) -> list[str]:
    """The quantlib modules an import statement names (``from a import b`` may import module ``a.b``)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".")[: None if path.name == "__init__.py" else -1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
    return [n for n in names if n in MODULES]


def import_graph() -> dict[str, set[str]]:
    """quantlib module -> the quantlib modules it imports anywhere in its body (functions included: a
    lazy import is still a circle), without its own ancestor packages (importing ``a.b`` runs ``a``)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported(module, path, node):
                    parts = name.split(".")
                    for i in range(1, len(parts) + 1):  # importing a.b.c imports a.b as well
                        dep = ".".join(parts[:i])
                        if dep in MODULES and dep != module and not module.startswith(dep + "."):
                            deps.add(dep)
        graph[module] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` as [a, b, ..., a], or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_quantlib_has_no_import_circle() -> None:
    cycle = find_cycle(import_graph())
    assert not cycle, "import circle: " + " -> ".join(cycle)


def test_find_cycle_sees_a_lazy_circle() -> None:
    """The detector itself: a circle closed by an import inside a function is found."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("quantlib.plugins.")))
def test_every_core_module_imports(module: str) -> None:
    importlib.import_module(module)


def test_no_file_over_600_lines() -> None:
    long = {}
    for folder in ("quantlib", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                long[str(path.relative_to(ROOT))] = lines
    assert not long, f"files over {MAX_LINES} lines (split them into well-named modules): {long}"
