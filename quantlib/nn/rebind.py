"""Rebinding a converted module's hooks: conversion builds a new object from the original's ``__dict__``,
so every hook, weak reference or closure the original registered on itself still points at the original.

Those must follow the module: torch's ``_register_load_state_dict_pre_hook(..., with_module=True)`` keeps
only a weak reference to the module (Megatron's TE grouped linears register two such hooks), which dies
with the replaced module ("You are trying to call the hook of a dead Module!"); a bound method or a
closure keeps the replaced module alive and acts on it instead of the live one.
"""

from __future__ import annotations

import copy
import functools
import types
import weakref
from typing import Any

from torch import nn
from torch.nn.modules import module as _torch_module

#: the per-module hook dicts of ``torch.nn.Module``
HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_NOT_ATTRIBUTES = frozenset(HOOK_DICTS) | {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}
#: how far into partials, closures and wrapped hooks a reference is followed
_DEPTH = 4
#: longer lists or tuples are data, not hooks: not searched
_MAX_ITEMS = 256
#: what ``_register_load_state_dict_pre_hook(hook, with_module=True)`` stores (torch-private: looked up)
_WRAPPED_HOOK = getattr(_torch_module, "_WrappedHook", None)


def rebind_hooks(old: nn.Module, new: nn.Module) -> int:
    """Point every hook of ``new`` (its hook dicts) and every plain attribute that refers to ``old`` (the
    module itself, a weak reference, a bound or weak method, a partial, a closure cell, a torch
    ``_WrappedHook``) at ``new``. Hook dicts are updated in place (handles keep working). Returns the count."""
    count = 0
    for name, value in list(new.__dict__.items()):
        if name in HOOK_DICTS:
            for key, hook in list(value.items()):
                rebound = _rebound(hook, old, new, _DEPTH)
                if rebound is not hook:
                    value[key] = rebound
                    count += 1
        elif name not in _NOT_ATTRIBUTES:
            rebound = _rebound(value, old, new, _DEPTH)
            if rebound is not value:
                new.__dict__[name] = rebound
                count += 1
    return count


def _rebound(value: Any, old: nn.Module, new: nn.Module, depth: int) -> Any:
    """``value`` with its references to ``old`` replaced by ``new`` (the same object where it has none)."""
    if value is old:
        return new
    if depth <= 0 or isinstance(value, (nn.Module, str, bytes, int, float, bool, type(None))):
        return value
    if isinstance(value, weakref.WeakMethod):  # (a subclass of weakref.ref: test it first)
        target = value()
        if isinstance(target, types.MethodType) and target.__self__ is old:
            return weakref.WeakMethod(types.MethodType(target.__func__, new))
        return value
    if isinstance(value, weakref.ReferenceType):
        return weakref.ref(new, value.__callback__) if value() is old else value
    if isinstance(value, types.MethodType):
        return types.MethodType(value.__func__, new) if value.__self__ is old else value
    if isinstance(value, functools.partial):
        func = _rebound(value.func, old, new, depth - 1)
        args = [_rebound(a, old, new, depth - 1) for a in value.args]
        kwargs = {k: _rebound(v, old, new, depth - 1) for k, v in value.keywords.items()}
        changed = func is not value.func or any(a is not b for a, b in zip(args, value.args))
        changed = changed or any(kwargs[k] is not v for k, v in value.keywords.items())
        return functools.partial(func, *args, **kwargs) if changed else value
    if isinstance(value, types.FunctionType):
        return _rebound_closure(value, old, new, depth)
    if isinstance(value, (list, tuple)) and len(value) <= _MAX_ITEMS:
        items = [_rebound(v, old, new, depth - 1) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(items) if type(value) in (list, tuple) else value
    if _WRAPPED_HOOK is not None and isinstance(value, _WRAPPED_HOOK):
        return _rebound_wrapped_hook(value, old, new, depth)
    return value


def _rebound_closure(fn: types.FunctionType, old: nn.Module, new: nn.Module, depth: int) -> types.FunctionType:
    """A copy of ``fn`` whose closure cells refer to ``new`` where they referred to ``old``."""
    if not fn.__closure__:
        return fn
    cells, changed = [], False
    for cell in fn.__closure__:
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell (a variable not yet assigned)
            cells.append(cell)
            continue
        rebound = _rebound(content, old, new, depth - 1)
        changed = changed or rebound is not content
        cells.append(types.CellType(rebound) if rebound is not content else cell)
    if not changed:
        return fn
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
    out.__kwdefaults__ = copy.copy(fn.__kwdefaults__)
    out.__dict__.update(fn.__dict__)
    out.__qualname__, out.__doc__, out.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    return out


def _rebound_wrapped_hook(value: Any, old: nn.Module, new: nn.Module, depth: int) -> Any:
    """A copy of torch's ``_WrappedHook`` bound (by weak reference) to ``new`` where it was bound to ``old``."""
    hook = _rebound(value.hook, old, new, depth - 1)
    module_ref = getattr(value, "module", None) if value.with_module else None
    bound_to_old = module_ref is not None and module_ref() is old
    if hook is value.hook and not bound_to_old:
        return value
    out = object.__new__(type(value))  # (not copy.copy: its __getstate__ revives the module strongly)
    out.__dict__.update(value.__dict__)
    out.hook = hook
    if bound_to_old:
        out.module = weakref.ref(new)
    return out


__all__ = ["HOOK_DICTS", "rebind_hooks"]
