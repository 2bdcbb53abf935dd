"""Load a script that lives outside any package (``benchmarks/``, ``tests/data/``) as a fresh module."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
DATA = ROOT / "tests" / "data"


def load_script(path: Path) -> ModuleType:
    """The Python file at ``path``, executed as a fresh module named after its stem."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py``."""
    return load_script(BENCH / f"{name}.py")


def load_golden_writer(schema: int) -> ModuleType:
    """``tests/data/write_v<schema>_golden.py``, the frozen script that wrote a schema's golden files."""
    return load_script(DATA / f"write_v{schema}_golden.py")
