"""Which room holds what (docs/design.md §1): every collective in the one collective layer, the KV cache in one
package, only model-level algorithms in calib/, the design document in the repository and every citation of it
naming a section it has, no source file over 600 lines (the C++ / CUDA sources included)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "quantlib"
DESIGN = ROOT / "docs" / "design.md"
MAX_LINES = 600

#: torch.distributed's communication calls: only quantlib/collectives.py makes them (queries such as
#: get_rank / get_world_size / is_initialized are not communication)
COLLECTIVE_CALLS = frozenset({
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all", "all_to_all_single", "barrier",
    "broadcast", "broadcast_object_list", "gather", "gather_object", "irecv", "isend", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "scatter_object_list", "send",
})


def collective_calls(source: str, where: str) -> list[str]:
    """The ``dist.<collective>(...)`` / ``torch.distributed.<collective>(...)`` calls of ``source``, as lines."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVE_CALLS:
            base = ast.unparse(node.func.value)
            if base in ("dist", "torch.distributed"):
                found.append(f"{where}:{node.lineno}: {base}.{node.func.attr}")
    return found


def test_every_collective_goes_through_the_collective_layer() -> None:
    outside = [c for p in sorted(PACKAGE.rglob("*.py")) if p != PACKAGE / "collectives.py"
               for c in collective_calls(p.read_text(), str(p.relative_to(ROOT)))]  # fmt: skip
    assert not outside, "collectives outside quantlib/collectives.py (use its primitives):\n" + "\n".join(outside)


def test_the_collective_check_sees_a_call_and_not_a_query() -> None:
    src = ("import torch.distributed as dist\n\ndef f(t, g):\n    dist.get_rank(g)\n    torch.distributed.barrier(g)\n"
           "    dist.all_reduce(t, group=g)\n")
    assert collective_calls(src, "x.py") == ["x.py:5: torch.distributed.barrier", "x.py:6: dist.all_reduce"]


def test_the_kv_cache_lives_in_one_package() -> None:
    """quantlib/kv/ holds presets, attention quantizers, the KV export plan and the KV scales; the framework hooks
    (plugins/*_attention.py) load with their framework. No other module is named for the KV cache."""
    elsewhere = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                 if re.search(r"(^|_)kv(_|\.py$)|kv_cache", p.name) and p.parent != PACKAGE / "kv"]  # fmt: skip
    assert not elsewhere, f"KV-cache modules outside quantlib/kv/: {elsewhere}"
    assert {p.name for p in (PACKAGE / "kv").glob("*.py")} >= {"presets.py", "attention.py", "export_plan.py", "scales.py"}


def test_calib_holds_only_model_level_algorithms() -> None:
    """No tensor-level collector (nn/max_collector.py, nn/bias_collector.py) and no communication (collectives.py)
    in calib/: its modules run on a model, and each is an algorithm, the runners' registry, or a piece the
    algorithms share (named in docs/design.md §1 and §9)."""
    problems = []
    for p in sorted((PACKAGE / "calib").glob("*.py")):
        tree = ast.parse(p.read_text(), str(p))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(isinstance(f, ast.FunctionDef) and f.name == "collect" for f in node.body):
                problems.append(f"{p.name}: class {node.name} is a collector (a tensor-level statistic: nn/)")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n.startswith("torch.distributed") for n in names):
                    problems.append(f"{p.name}:{node.lineno}: imports torch.distributed (communication is quantlib/collectives.py)")
    assert not problems, "\n".join(problems)


_CITATION = re.compile(r"docs/design\.md(?:,)? §(\d+)(?:-§(\d+))?")


def _design_sections() -> set[int]:
    return {int(m.group(1)) for m in re.finditer(r"^## (\d+)\. ", DESIGN.read_text(), re.M)}


def test_the_design_is_in_the_repository_and_every_citation_names_one_of_its_sections() -> None:
    sections = _design_sections()
    assert sections >= set(range(1, 11)), f"docs/design.md sections: {sorted(sections)}"
    cited, bad, gone = set(), [], []
    for p in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "csrc").rglob("*.*"), *(ROOT / "tests").rglob("*.py")]):
        text = p.read_text(errors="replace")
        library = p.is_relative_to(PACKAGE) or p.is_relative_to(ROOT / "csrc")
        for m in _CITATION.finditer(text):
            for n in filter(None, m.groups()):
                cited.add(int(n))
                if int(n) not in sections:
                    bad.append(f"{p.relative_to(ROOT)}: §{n}")
        if library and re.search(r"\bDESIGN(\.md)? §|FACTS\.md|EXPORT\.md|\bnotes/", text):  # documents outside the repository
            gone.append(str(p.relative_to(ROOT)))
    assert not bad, f"citations of sections docs/design.md does not have: {bad}"
    assert not gone, f"citations of documents that are not in the repository: {gone}"
    assert {1, 3, 5, 8} <= cited, f"the code and its tests cite docs/design.md §{sorted(cited)}"


def test_no_source_file_over_600_lines_in_csrc() -> None:
    """tests/test_house.py counts the Python files; the C++ / CUDA sources keep the same rule."""
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "csrc").rglob("*")
            if p.suffix in (".cpp", ".cu", ".cuh", ".h", ".hpp") and (n := len(p.read_text().splitlines())) > MAX_LINES}  # fmt: skip
    assert not long, f"files over {MAX_LINES} lines: {long}"
