"""The one field parser of quantlib's configs: a dict read into a dataclass's fields, unknown keys and
ill-typed values refused with :class:`ConfigError` naming the key and the value.

The quantizer attribute config, the quantize config, the algorithm configs and the sequential options all
read their dict form through :func:`parse_fields`; what a type cannot say (ranges, combinations) stays in
each class's own checks. This module imports only ``quantlib.errors``, so every layer above the kernels may use it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Union

from .errors import ConfigError


def _type_name(annotation: Any) -> str:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or None" if type(None) in args else "")
    return getattr(annotation, "__name__", str(annotation))


def type_ok(value: Any, annotation: Any) -> bool:
    """Whether ``value`` is of the field type ``annotation``: a bool is no int nor float, an int is a fine
    float (ModelOpt's pydantic takes 1 for 1.0), a Union / Optional takes any of its members, a generic
    (``tuple[int, int]``) checks its container only."""
    if annotation is Any:
        return True
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return any(type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    origin = typing.get_origin(annotation)
    return isinstance(value, origin if origin is not None else annotation)


def parse_fields(cls: type, value: Mapping, where: str, noun: str = "key", ignored: frozenset = frozenset(),
                 check_types: bool = True) -> dict:
    """The keyword arguments of dataclass ``cls`` from ``value``: a key that is no field raises ConfigError
    ``"{where}unknown {noun} 'k' (value v); known: [...]"``; with ``check_types``, a value not of its
    field's annotated type raises ``"{where}k must be a T, got v"`` (classes whose own checks read every
    value, the attribute config's, pass False); float fields get floats. ``ignored`` keys are dropped."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}expected a dict, got {value!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, v in value.items():
        if key in ignored:
            continue
        if key not in known:
            raise ConfigError(f"{where}unknown {noun} {key!r} (value {v!r}); known: {sorted(known)}")
        if check_types:
            if not type_ok(v, hints[key]):
                name = _type_name(hints[key])
                raise ConfigError(f"{where}{key} must be {'an' if name[0] in 'aeiou' else 'a'} {name}, got {v!r}")
            if hints[key] is float:
                v = float(v)
        kwargs[key] = v
    return kwargs


__all__ = ["ConfigError", "parse_fields", "type_ok"]
