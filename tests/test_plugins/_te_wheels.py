"""Transformer Engine's pure-Python wheels as test data: downloaded once into the pytest cache, read
with ``ast`` (nothing of TE is imported), and the signatures and call layouts found in them."""

from __future__ import annotations

import ast
import contextlib
import copy
import functools
import inspect
import os
import subprocess
import sys
import tempfile
import zipfile
from typing import Callable

import pytest
import torch

#: TE releases whose wheels the adapters are checked against, and the generation each belongs to.
WHEELS = {"1.13.0": "1.13", "2.8.0": "2.8", "2.14.0": "2.10", "2.17.0": "2.17", "2.20.2": "2.18"}
_MODULES = ("grouped_linear", "linear", "layernorm_linear")


def _download(version: str, folder: str) -> None:
    """Unpack TE ``version``'s module sources into ``folder`` (atomic: a temp folder, then rename)."""
    parent = os.path.dirname(folder)
    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-q",
               f"transformer-engine=={version}", "-d", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"cannot download transformer-engine=={version}: {exc}")
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if proc.returncode != 0 or not wheels:
            pytest.skip(f"cannot download transformer-engine=={version} (pip exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
        out = os.path.join(tmp, "src")
        os.makedirs(out)
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as whl:
            for mod in _MODULES:
                with open(os.path.join(out, f"{mod}.py"), "wb") as f:
                    f.write(whl.read(f"transformer_engine/pytorch/module/{mod}.py"))
        with contextlib.suppress(OSError):  # another worker got there first
            os.rename(out, folder)


@pytest.fixture(scope="session")
def te_source(request, tmp_path_factory) -> Callable[[str, str], str]:
    """``te_source(version, module)``: the source of ``transformer_engine/pytorch/module/<module>.py``."""
    store = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider: a folder of this run then
    cache = str(store.mkdir("quantlib-te-wheels") if store is not None else tmp_path_factory.mktemp("quantlib-te-wheels"))

    def get(version: str, module: str) -> str:
        folder = os.path.join(cache, version)
        if not os.path.isdir(folder):
            _download(version, folder)
        with open(os.path.join(folder, f"{module}.py")) as f:
            return f.read()

    return get


@functools.cache
def _tree(source: str) -> ast.Module:
    return ast.parse(source)


def _method(source: str, cls: str, name: str) -> ast.FunctionDef:
    for node in ast.walk(_tree(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == name:
                    return f
    raise AssertionError(f"{cls}.{name} not found")


def real_signature(source: str, cls: str, name: str = "forward") -> inspect.Signature:
    """``inspect.signature`` of ``cls.name`` as the module defines it: the def is compiled alone, with
    its parameter names, kinds and order, without the annotations and defaults (they name TE objects)."""
    fdef = copy.deepcopy(_method(source, cls, name))
    args = fdef.args
    for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
        if a is not None:
            a.annotation = None
    args.defaults = [ast.Constant(None) for _ in args.defaults]
    args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
    fdef.decorator_list, fdef.returns, fdef.body = [], None, [ast.Pass()]
    namespace: dict = {}
    exec(compile(ast.fix_missing_locations(ast.Module(body=[fdef], type_ignores=[])), f"<TE {cls}.{name}>", "exec"), namespace)
    return inspect.signature(namespace[name])


def non_tensor_args_fields(source: str, cls: str = "_GroupedLinear") -> list[str]:
    """The names ``forward`` unpacks ``non_tensor_args`` into (empty where there is no such arg)."""
    for node in ast.walk(_method(source, cls, "forward")):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id == "non_tensor_args":
            return [e.id for e in node.targets[0].elts]
    return []


def call_site(source: str) -> tuple[int, str]:
    """In ``GroupedLinear.forward``: (number of args passed to the autograd function before the weights,
    name of the first starred arg after them) — the layout the module really calls it with."""
    fdef = _method(source, "GroupedLinear", "forward")
    for node in ast.walk(fdef):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "linear_fn":
            items = node.args
            if len(items) == 1 and isinstance(items[0], ast.Starred):  # linear_fn(*args), args += (...)
                items = next(n.value.elts for n in ast.walk(fdef) if isinstance(n, ast.AugAssign)
                             and getattr(n.target, "id", None) == "args")
            items = [a for a in items if not (isinstance(a, ast.Starred) and a.value.id == "autograd_ctx")]
            first_starred = next(i for i, a in enumerate(items) if isinstance(a, ast.Starred))
            return first_starred, items[first_starred].value.id
    raise AssertionError("GroupedLinear.forward calls no linear_fn")


def grouped_args(sig: inspect.Signature, nta: list[str], inp, m_splits, tensors: list[torch.Tensor]) -> tuple:
    """Args after ``ctx`` for ``sig``, by parameter name: the input, the splits (where this generation
    expects them), ``non_tensor_args`` laid out as the wheel unpacks it, a fresh object everywhere else."""
    values = {"inp": inp, "m_splits": m_splits}
    if "non_tensor_args" in sig.parameters:
        values["non_tensor_args"] = tuple(values.get(f, object()) for f in nta)
    names = [p for p in sig.parameters if p != "ctx" and sig.parameters[p].kind != inspect.Parameter.VAR_POSITIONAL]
    return tuple(values.get(n, object()) for n in names) + tuple(tensors)
