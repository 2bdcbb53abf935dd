"""House rules that the code keeps: imports only downhill through the layers of docs/design.md §1 (in the
source and at run time), no import circle inside quantlib, every module imports, no file over 600 lines, no
environment variable read."""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

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


#: docs/design.md §1, lowest first: a module may import its own layer and the layers before it. The most
#: specific prefix decides (``quantlib`` itself, the facade that imports everything, is the top).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("formats", ("quantlib.formats", "quantlib.errors", "quantlib._atomic_io")),
    ("kernels", ("quantlib.kernels",)),
    ("config", ("quantlib.config", "quantlib.calib_config", "quantlib.presets", "quantlib.parallel_state", "quantlib.fields")),
    ("nn", ("quantlib.nn", "quantlib.traversal")),
    ("calib", ("quantlib.calib", "quantlib.distributed", "quantlib.rollback", "quantlib.coverage", "quantlib.kv", "quantlib.collectives")),
    ("model_quant", ("quantlib.model_quant", "quantlib.checkpoint", "quantlib.auto_quantize")),
    ("plugins", ("quantlib.plugins",)),
    ("export", ("quantlib.export",)),
    ("pipeline", ("quantlib.pipeline", "quantlib.demo", "quantlib.__main__", "quantlib")),
]


def layer(module: str) -> int:
    """Index in :data:`LAYERS` of a quantlib module (its longest matching prefix)."""
    best, index = "", None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, index = prefix, i
    assert index is not None, f"{module} is in no layer of LAYERS: add it (and to docs/design.md §1)"
    return index


def uphill(edges: set[tuple[str, str]]) -> list[str]:
    """The (importer, imported) pairs that import a higher layer, as readable lines."""
    return sorted(f"{a} ({LAYERS[layer(a)][0]}) imports {b} ({LAYERS[layer(b)][0]})" for a, b in edges if layer(b) > layer(a))


def _targets(importer: str, name: str, fromlist: tuple, level: int, package: str) -> set[str]:
    """The quantlib modules an import runs (with their packages, less the importer's own ancestors)."""
    if level:
        base = package.rsplit(".", level - 1)[0] if level > 1 else package
        name = f"{base}.{name}" if name else base
    found = {name} | {f"{name}.{x}" for x in fromlist or () if isinstance(x, str)}
    out = set()
    for full in found:
        parts = full.split(".")
        for i in range(1, len(parts) + 1):
            dep = ".".join(parts[:i])
            if dep in MODULES and dep != importer and not importer.startswith(dep + "."):
                out.add(dep)
    return out


@contextlib.contextmanager
def trace_imports() -> Iterator[set[tuple[str, str]]]:
    """Records (importer, imported) for every ``import`` statement, ``__import__`` and
    ``importlib.import_module`` call that a quantlib module makes while active (a function's lazy import
    runs the statement on every call, so what already sits in ``sys.modules`` is seen too)."""
    edges: set[tuple[str, str]] = set()
    real_import, real_import_module = builtins.__import__, importlib.import_module

    def record(importer: object, name: str, fromlist: tuple, level: int, package: object) -> None:
        if isinstance(importer, str) and importer in MODULES:
            edges.update((importer, t) for t in _targets(importer, name, fromlist, level, str(package or "")))

    def traced_import(name, globals=None, locals=None, fromlist=(), level=0):
        g = globals or {}
        record(g.get("__name__"), name, tuple(fromlist or ()), level, g.get("__package__"))
        return real_import(name, globals, locals, fromlist, level)

    def traced_import_module(name: str, package: object = None):
        caller = sys._getframe(1).f_globals
        level = len(name) - len(name.lstrip("."))
        record(caller.get("__name__"), name.lstrip("."), (), level, package)
        return real_import_module(name, package)

    builtins.__import__, importlib.import_module = traced_import, traced_import_module
    try:
        yield edges
    finally:
        builtins.__import__, importlib.import_module = real_import, real_import_module


def test_imports_run_downhill_in_the_source() -> None:
    edges = {(a, b) for a, deps in import_graph().items() for b in deps}
    assert not uphill(edges), "imports up the layers (docs/design.md §1):\n" + "\n".join(uphill(edges))


def test_trace_sees_an_import_by_name() -> None:
    """The tracer itself: an ``importlib.import_module`` that no import statement shows, made by a module
    of a low layer, is reported (``exec`` with that module's globals stands in for its code)."""
    code = compile("importlib.import_module('quantlib.plugins')", "<nn code>", "exec")
    with trace_imports() as edges:
        globs = {"__name__": "quantlib.nn.quant_module", "__package__": "quantlib.nn", "importlib": importlib}
        exec(code, globs)  # noqa: S102  (fixed code)
    assert uphill(edges) == ["quantlib.nn.quant_module (nn) imports quantlib.plugins (plugins)"]


def _hf_round_trip(tmp: Path) -> None:
    """quantize + export + save + restore of a tiny transformers MoE model (fused experts, attention)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import quantlib as ql
    from quantlib.export import export_checkpoint, share_sibling_amax

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=2, num_experts_per_tok=1,
                         max_position_embeddings=16, experts_implementation="eager")  # fmt: skip
    model = Qwen3MoeForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    ql.quantize(model, ql.FP8_DEFAULT_CFG, lambda m: m(ids))
    share_sibling_amax(model)
    export_checkpoint(model, str(tmp / "export"), "modelopt_fp8")
    ql.save(model, tmp / "q.pt")
    ql.restore(Qwen3MoeForCausalLM(cfg).eval(), tmp / "q.pt")


def _megatron_round_trip(rank: int, world: int, tmp: str) -> list[tuple[str, str]]:
    """On one gloo rank: quantize + export + the dist-checkpoint state of a tiny Megatron-Core MoE GPT."""
    import quantlib as ql
    from quantlib.export.megatron_export import export_megatron_checkpoint
    from tests.test_plugins import megatron_shims as shims

    shims.set_layout(1, 1)
    model = shims.build_gpt(1, 1, 0, gated_linear_unit=True)
    with trace_imports() as edges:
        loop = shims.forward_loop(shims.token_batches(1, 1))
        ql.quantize(model, ql.INT8_WEIGHT_ONLY_CFG, loop, parallel_state=ql.ParallelState.from_megatron())
        export_megatron_checkpoint(model, f"{tmp}/megatron", "ct_int8", hf_config={})
        model.sharded_state_dict()
        ql.quantizer_state(model)
    return sorted(edges)


def test_imports_run_downhill_at_run_time(tmp_path: Path) -> None:
    """What a quantize + export + checkpoint of a transformers model and of a Megatron-Core model import
    while they run (plugins load by name; lazy imports run on every call) goes down the layers only."""
    pytest.importorskip("transformers")
    with trace_imports() as edges:
        _hf_round_trip(tmp_path)
    seen = set(edges)
    if importlib.util.find_spec("megatron") is not None:
        import megatron.core  # noqa: F401  (imported in the parent: the rank is forked, tests/test_plugins/megatron_shims.py)

        from tests.test_plugins import megatron_shims as shims

        seen |= {tuple(e) for e in shims.run_distributed(_megatron_round_trip, 1, str(tmp_path), timeout=240)[0]}
    assert any(b.startswith("quantlib.plugins.") for _, b in seen), "the trace saw no plugin load: it traces nothing"
    assert not uphill(seen), "imports up the layers at run time (docs/design.md §1):\n" + "\n".join(uphill(seen))


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


#: reads of the process environment (a switch must be an argument or a config field, docs/design.md §1)
_ENVIRON = re.compile(r"os\.environ|getenv|environ\.get|from os import[^\n]*environ")


def test_no_environment_variable_read_in_quantlib() -> None:
    reads = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in sorted(PACKAGE.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if _ENVIRON.search(line)]  # fmt: skip
    assert not reads, "environment variables read in quantlib/:\n" + "\n".join(reads)



def _cuda_skip(mark: str) -> bool:
    return "skipif" in mark and "cuda" in mark.lower()


def _cuda_skips_without_gpu_mark(path: Path) -> list[str]:
    """The tests of ``path`` (or the file) skipped without CUDA (a ``skipif`` whose condition names cuda) that carry
    no ``gpu`` mark, so that ``-m gpu`` never selects them."""
    tree = ast.parse(path.read_text())
    module = []
    for n in tree.body:
        if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets):
            module += [ast.unparse(m) for m in (n.value.elts if isinstance(n.value, (ast.List, ast.Tuple)) else [n.value])]
    if any(m.endswith("mark.gpu") for m in module):
        return []
    if any(_cuda_skip(m) for m in module):
        return [path.name]
    return [f"{path.name}::{node.name}" for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))
            and any(_cuda_skip(ast.unparse(d)) for d in node.decorator_list)
            and not any(ast.unparse(d).endswith("mark.gpu") for d in node.decorator_list)]  # fmt: skip


def test_every_test_skipped_without_cuda_is_marked_gpu() -> None:
    """scripts/gpu_suite.sh selects ``-m gpu``: a CUDA test without the mark runs nowhere (three did, 2026-12-06)."""
    lonely = [t for p in sorted((ROOT / "tests").rglob("test_*.py")) for t in _cuda_skips_without_gpu_mark(p)]
    assert not lonely, "tests skipped without CUDA but not marked gpu (the GPU suite never runs them):\n" + "\n".join(lonely)


def test_the_gpu_mark_check_sees_an_unmarked_cuda_test(tmp_path: Path) -> None:
    probe, skip = tmp_path / "test_probe.py", "pytest.mark.skipif(not torch.cuda.is_available(), reason='x')"
    probe.write_text(f"@{skip}\ndef test_a():\n    pass\n")
    assert _cuda_skips_without_gpu_mark(probe) == ["test_probe.py::test_a"]
    probe.write_text(f"pytestmark = {skip}\n")
    assert _cuda_skips_without_gpu_mark(probe) == ["test_probe.py"]
    probe.write_text(f"@pytest.mark.gpu\n@{skip}\ndef test_a():\n    pass\n")
    assert _cuda_skips_without_gpu_mark(probe) == []
    probe.write_text(f"pytestmark = [pytest.mark.gpu, {skip}]\n")
    assert _cuda_skips_without_gpu_mark(probe) == []
