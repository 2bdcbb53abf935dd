"""The tree passes ruff with the project's settings (pyproject.toml's [tool.ruff]), so the README's test
command, which CI runs, lints. ruff is pinned in the test extra."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_check_passes_on_the_tree():
    try:
        import ruff  # noqa: F401  (the pinned linter of the test extra)
    except ImportError:
        pytest.fail("ruff is not installed: pip install -e '.[test]' installs the pinned release")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", ROOT], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, f"ruff check found problems (fix them, or the rule set in pyproject.toml):\n{done.stdout}{done.stderr}"
