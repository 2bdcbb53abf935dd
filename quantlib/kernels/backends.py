"""Which implementation of an op runs: "auto" picks CUDA extension > Triton > C++ CPU extension >
torch reference, by the input's device and what is importable. Nothing is probed at import time.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Callable

import torch

BACKENDS = ("auto", "reference", "cpu", "triton", "cuda")
_log = logging.getLogger("quantlib.kernels")


@functools.cache
def native_extension():
    """The compiled ``quantlib._C`` module, or None (said once)."""
    try:
        return importlib.import_module("quantlib._C")
    except ImportError as exc:  # the library still works on the reference path
        _log.warning("quantlib._C is not built (%s): using the torch reference kernels", exc)
        return None


@functools.cache
def triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def has_cuda_kernels() -> bool:
    ext = native_extension()
    return ext is not None and getattr(ext, "has_cuda", lambda: False)()


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def resolve(backend: str, device: torch.device) -> str:
    """The concrete backend for a tensor on ``device``; an explicit choice that cannot run raises."""
    check_backend(backend)
    if backend == "auto":
        if device.type == "cuda":
            if has_cuda_kernels():
                return "cuda"
            return "triton" if triton_available() else "reference"
        if device.type == "cpu" and native_extension() is not None:
            return "cpu"
        return "reference"
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend 'cpu' cannot run on a {device.type} tensor")
        if native_extension() is None:
            raise RuntimeError("backend 'cpu' needs the compiled quantlib._C extension, which is not built")
    if backend == "cuda":
        if device.type != "cuda":
            raise ValueError(f"backend 'cuda' cannot run on a {device.type} tensor")
        if not has_cuda_kernels():
            raise RuntimeError("backend 'cuda' needs quantlib._C built with CUDA")
    if backend == "triton" and not triton_available():
        raise RuntimeError("backend 'triton' needs the triton package")
    return backend


_IMPLS: dict[tuple[str, str], Callable] = {}


def register(op: str, backend: str) -> Callable[[Callable], Callable]:
    """Register the implementation of ``op`` for ``backend``."""

    def deco(fn: Callable) -> Callable:
        _IMPLS[(op, backend)] = fn
        return fn

    return deco


def implementation(op: str, backend: str) -> Callable:
    """The function for ``op`` on a resolved ``backend``; raises (never falls back) if it has none."""
    _load(backend)
    fn = _IMPLS.get((op, backend))
    if fn is None:
        raise NotImplementedError(f"op {op!r} has no {backend!r} implementation")
    return fn


@functools.cache
def _load(backend: str) -> None:
    modules = {
        "reference": "quantlib.kernels.reference_impl",
        "cpu": "quantlib.kernels.cpu_impl",
        "cuda": "quantlib.kernels.cuda_impl",
        "triton": "quantlib.kernels.triton",
    }
    importlib.import_module(modules[backend])
