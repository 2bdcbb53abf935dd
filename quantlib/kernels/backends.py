"""Which implementation of an op runs: a :class:`KernelPreference` (or its name). ``AUTO`` picks, per call,
the first backend that is available and covers the op and its case, in the order CUDA extension > Triton >
C++ CPU extension > torch reference; any other preference is that backend, or :class:`KernelUnavailable`
naming the op, the case and the backend: an explicit choice never runs another backend's kernel.

Each backend declares what it covers twice: the ops (:data:`COVERS`) and, where its kernels take only some
cases of an op, a ``gap`` function registered with the kernel (see :func:`register` and :func:`uncovered`).
Nothing is probed at import time.
"""

from __future__ import annotations

import enum
import functools
import importlib
import logging
from collections.abc import Callable

import torch

from ..errors import ConfigError


class KernelPreference(str, enum.Enum):
    """The kernels an op runs with (as torchao's ``KernelPreference``); a string names one by its value."""

    AUTO = "auto"  # the first available backend that covers the op (see the module docstring)
    REFERENCE = "reference"  # the pure-torch reference of quantlib.formats
    CPU = "cpu"  # the C++ CPU extension (quantlib._C)
    TRITON = "triton"  # the Triton kernels (quantlib.kernels.triton)
    CUDA = "cuda"  # the CUDA kernels of quantlib._C


#: a preference or its name, as every ``backend=`` argument takes it
Backend = KernelPreference | str
BACKENDS = tuple(p.value for p in KernelPreference)
_BY_NAME = {p.value: p for p in KernelPreference}
OPS = ("fake_quant", "block_amax", "fp8_blockwise_cast", "fp8_cast", "mx_cast", "nvfp4_cast")

#: the ops each backend implements (its module registers exactly these): AUTO passes over a backend for an
#: op it lacks, an explicit choice of it raises. The CUDA kernels have no ``fp8_cast`` and no ``block_amax``.
COVERS: dict[KernelPreference, frozenset[str]] = {
    KernelPreference.REFERENCE: frozenset(OPS),
    KernelPreference.CPU: frozenset(OPS),
    KernelPreference.TRITON: frozenset(OPS),
    KernelPreference.CUDA: frozenset({"fake_quant", "fp8_blockwise_cast", "mx_cast", "nvfp4_cast"}),
}


class KernelUnavailable(NotImplementedError):
    """An explicitly chosen backend that has no kernel for an op, or for a case of it; the message names the
    op, the case and the backend."""


_log = logging.getLogger("quantlib.kernels")


def as_preference(value: Backend) -> KernelPreference:
    """``value`` as a :class:`KernelPreference`; anything else raises ConfigError naming it."""
    if type(value) is KernelPreference:
        return value
    pref = _BY_NAME.get(value) if isinstance(value, str) else None
    if pref is None:
        raise ConfigError(f"backend={value!r}: expected a KernelPreference or one of {BACKENDS}")
    return pref


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


def check_backend(backend: Backend) -> str:
    """The name of the preference ``backend`` (ConfigError for anything else)."""
    return as_preference(backend).value


def _auto_order(device_type: str) -> list[KernelPreference]:
    """What AUTO tries on a device, best first; the reference runs everywhere."""
    order = []
    if device_type == "cuda":
        order += [KernelPreference.CUDA] if has_cuda_kernels() else []
        order += [KernelPreference.TRITON] if triton_available() else []
    elif device_type == "cpu" and native_extension() is not None:
        order.append(KernelPreference.CPU)
    return order + [KernelPreference.REFERENCE]


@functools.cache
def _auto(device_type: str, op: str | None) -> KernelPreference:
    return next(b for b in _auto_order(device_type) if op is None or op in COVERS[b])


def resolve(backend: Backend, device: torch.device, op: str | None = None) -> KernelPreference:
    """The backend that runs ``op`` (None: any op) on a tensor on ``device``: the first AUTO tries (it passes
    to the next for a case that one does not cover), or the explicit one, which raises where it cannot run
    (another device, not built, not installed, or not covering ``op``)."""
    pref = as_preference(backend)
    if pref is KernelPreference.AUTO:
        return _auto(device.type, op)
    if op is not None and op not in COVERS[pref]:  # before the device: this backend never runs the op
        others = [b.value for b in KernelPreference if b is not KernelPreference.AUTO and op in COVERS[b]]
        raise KernelUnavailable(
            f"op {op!r} has no kernel in backend {pref.value!r} (asked for explicitly); backend='auto' runs it, or one of {others}"
        )
    what = f"{op}: backend" if op else "backend"
    if pref is KernelPreference.CPU:
        if device.type != "cpu":
            raise ValueError(f"{what} 'cpu' cannot run on a {device.type} tensor")
        if native_extension() is None:
            raise RuntimeError(f"{what} 'cpu' needs the compiled quantlib._C extension, which is not built")
    elif pref is KernelPreference.CUDA:
        if device.type != "cuda":
            raise ValueError(f"{what} 'cuda' cannot run on a {device.type} tensor")
        if not has_cuda_kernels():
            raise RuntimeError(f"{what} 'cuda' needs quantlib._C built with CUDA")
    elif pref is KernelPreference.TRITON and not triton_available():
        raise RuntimeError(f"{what} 'triton' needs the triton package")
    return pref


#: a backend's declaration of the cases of an op its kernel takes: called with the op's arguments, None for a
#: case it takes, else the case in words (the kernel is never called with it)
Gap = Callable[..., str | None]

#: (op, backend) -> its kernel and the gap the kernel declares (None: every case of the op)
_KERNELS: dict[tuple[str, KernelPreference], tuple[Callable, Gap | None]] = {}


def register(op: str, backend: Backend, gap: Gap | None = None) -> Callable[[Callable], Callable]:
    """Register the kernel of ``op`` for ``backend``, which must declare the op in :data:`COVERS`; ``gap``: the
    cases the kernel does not take (see :data:`Gap`), where it covers only some."""
    pref = as_preference(backend)
    if op not in COVERS[pref]:
        raise KernelUnavailable(f"register: backend {pref.value!r} does not declare op {op!r} in COVERS")

    def deco(fn: Callable) -> Callable:
        _KERNELS[(op, pref)] = (fn, gap)
        return fn if gap is None else _checked(op, pref, fn, gap)  # a direct call is refused outside the gap too

    return deco


def _kernel(op: str, pref: KernelPreference) -> tuple[Callable, Gap | None]:
    _load(pref)
    entry = _KERNELS.get((op, pref))
    if entry is None:
        raise KernelUnavailable(f"op {op!r} has no kernel in backend {pref.value!r}")
    return entry


def uncovered(op: str, backend: Backend, *args) -> str | None:
    """The case of ``op(*args)`` that ``backend`` has no kernel for, in words; None where it has one."""
    pref = as_preference(backend)
    if op not in COVERS[pref]:
        return "every case"
    _, gap = _kernel(op, pref)
    return None if gap is None else gap(*args)


def _refusal(op: str, pref: KernelPreference, case: str) -> KernelUnavailable:
    return KernelUnavailable(f"op {op!r}: {case} has no kernel in backend {pref.value!r} (asked for explicitly); "
                             f"backend='auto' runs it with the first backend that covers it")


def implementation(op: str, backend: Backend) -> Callable:
    """The function for ``op`` on a resolved ``backend``; it raises (never falls back) for an op or a case
    that backend has no kernel for."""
    pref = as_preference(backend)
    fn, gap = _kernel(op, pref)
    return fn if gap is None else _checked(op, pref, fn, gap)


def _checked(op: str, pref: KernelPreference, fn: Callable, gap: Gap) -> Callable:
    """``fn``, refusing by name the cases its ``gap`` declares."""

    def checked(*args):
        case = gap(*args)
        if case is not None:
            raise _refusal(op, pref, case)
        return fn(*args)

    return checked


def _auto_kernel(op: str, device_type: str) -> Callable:
    """AUTO's function for ``op`` on a device: the first backend of its order whose kernel takes the case."""
    chain = []
    for pref in _auto_order(device_type):
        if op in COVERS[pref]:
            fn, gap = _kernel(op, pref)
            chain.append((pref, fn, gap))
            if gap is None:  # takes every case: the backends after it are never reached
                break
    if len(chain) == 1:
        return chain[0][1]

    def first_covering(*args):
        for pref, fn, gap in chain:
            case = None if gap is None else gap(*args)
            if case is None:
                return fn(*args)
            _log.debug("auto: backend %r has no kernel for op %r, %s; trying the next", pref.value, op, case)
        raise KernelUnavailable(f"op {op!r}: {case} has no kernel in any available backend")

    return first_covering


#: (op, backend as given, device type) -> the function :func:`select` found: every op call asks, and what is
#: built or installed does not change within a process
_SELECTED: dict[tuple[str, Backend, str], Callable] = {}


def select(op: str, backend: Backend, device: torch.device) -> Callable:
    """The function that runs ``op`` for ``backend`` on a tensor on ``device`` (see :func:`resolve`)."""
    key = (op, backend, device.type)
    try:
        fn = _SELECTED.get(key)
    except TypeError:  # an unhashable backend: resolve names it in its ConfigError
        fn = None
    if fn is None:  # a choice that cannot run raises here on every call: nothing is kept for it
        pref = resolve(backend, device, op)
        auto = as_preference(backend) is KernelPreference.AUTO
        fn = _SELECTED[key] = _auto_kernel(op, device.type) if auto else implementation(op, pref)
    return fn


@functools.cache
def _load(backend: KernelPreference) -> None:
    modules = {
        KernelPreference.REFERENCE: "quantlib.kernels.reference_impl",
        KernelPreference.CPU: "quantlib.kernels.cpu_impl",
        KernelPreference.CUDA: "quantlib.kernels.cuda_impl",
        KernelPreference.TRITON: "quantlib.kernels.triton",
    }
    if backend in modules:  # AUTO is never loaded: it is resolved to one of these first
        importlib.import_module(modules[backend])
