"""The README's Use snippet runs as written (in a temporary folder: it writes its checkpoint files)."""

from __future__ import annotations

import os
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def use_snippet() -> str:
    text = README.read_text()
    section = text[text.index("## Use\n") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_use_snippet_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = use_snippet()
    assert "build_fresh_model" not in code
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    assert sorted(os.listdir(tmp_path)) == ["model.pt", "quant.pt"]
