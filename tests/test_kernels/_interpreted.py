"""Modules of Triton tests that run under Triton's interpreter on the CPU.

The interpreter must be on when triton is first imported (it decides at decoration time whether a
``@triton.jit`` function, its own standard library's included, is interpreted), and the switch is
process-wide: where a GPU is present, turning it on in a worker would make every later GPU test of that
worker run interpreted (115 GPU failures on the H200, 2026-12-03). So such a module runs in this process
only where triton can still come up interpreted, and otherwise in a subprocess of its own (which
inherits TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

SUBPROCESS_TEST = "test_module_in_a_fresh_interpreter"


def start() -> bool:
    """Call before importing triton: whether this process runs the module's tests (the interpreter is
    then switched on)."""
    fresh = os.environ.get("TRITON_INTERPRET") == "1" or ("triton" not in sys.modules and not torch.cuda.is_available())
    if fresh:
        os.environ["TRITON_INTERPRET"] = "1"
    return fresh


def skip_unless_fresh(request, fresh: bool, why: str = "triton was imported before this module: these tests run in a subprocess instead"
                      ) -> None:
    """The autouse fixture's body: every test but the subprocess one skips where this process cannot run them."""
    if request.node.name != SUBPROCESS_TEST and not fresh:
        pytest.skip(why)


def run_in_subprocess(path: str, fresh: bool, interpret: bool = True) -> None:
    """The subprocess test's body: run the module at ``path`` in a fresh interpreter (its triton interpreted, or
    compiling where not ``interpret``), or skip where this process runs it."""
    if fresh:
        pytest.skip("the tests of this module run in this process")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
