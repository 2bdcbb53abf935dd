"""The test tree shadows no installed module.

transformers 5.25 does ``from kernels import ...`` (the Hugging Face ``kernels`` package) when a module
named ``kernels`` can be found; a test package ``tests/kernels`` on ``sys.path`` won, and collection of
the Hugging Face tests failed. These tests keep the cause away: pytest's importlib mode puts no test
folder on ``sys.path`` (only the repository root, so helpers import as ``tests.ranks``), and no module
or folder name under ``tests/`` is also the name of a module this environment can import, so even a
run in pytest's old ``prepend`` mode could not shadow one.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _foreign_paths() -> list[str]:
    """``sys.path`` without the entries inside this repository: where installed modules come from."""
    return [p for p in sys.path if p and not _inside(Path(p).resolve(), ROOT)]


def _installed(name: str) -> bool:
    """Whether ``name`` is a module this environment imports from outside the repository."""
    if name in sys.builtin_module_names or name in sys.stdlib_module_names:
        return True
    spec = importlib.machinery.PathFinder.find_spec(name, _foreign_paths())
    # a folder without __init__.py (a namespace portion) never wins over a regular module elsewhere
    return spec is not None and (spec.origin is not None or spec.submodule_search_locations is None)


def _names_under_tests() -> dict[str, Path]:
    """Every name that a folder or module under tests/ would be imported by if its parent were on sys.path."""
    names: dict[str, Path] = {}
    for path in TESTS.rglob("*"):
        if "__pycache__" in path.parts:
            continue
        if path.is_dir() or path.suffix == ".py":
            names.setdefault(path.stem if path.suffix == ".py" else path.name, path)
    return names


def test_no_test_folder_is_on_sys_path() -> None:
    on_path = [p for p in sys.path if p and _inside(Path(p).resolve(), TESTS)]
    assert not on_path, f"test folders on sys.path (pytest must run with --import-mode=importlib): {on_path}"


def test_no_name_under_tests_is_an_installed_module() -> None:
    clashes = {name: str(path.relative_to(ROOT)) for name, path in _names_under_tests().items() if _installed(name)}
    assert not clashes, f"these test modules/folders share a name with an importable module; rename them: {clashes}"


def test_kernels_resolves_to_no_test_folder() -> None:
    """The case that broke collection: ``import kernels`` must never find a folder of this test tree."""
    spec = importlib.util.find_spec("kernels")
    assert spec is None or not _inside(Path(spec.origin or next(iter(spec.submodule_search_locations))).resolve(), TESTS)


def test_repository_root_exposes_no_installed_name() -> None:
    """The root is on sys.path (helpers import as ``tests.ranks``): what it exposes must shadow nothing."""
    exposed = [p.stem for p in ROOT.glob("*.py")] + [p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()]
    clashes = sorted(name for name in exposed if name != "quantlib" and _installed(name))
    assert not clashes, f"the repository root shadows installed modules: {clashes}"
