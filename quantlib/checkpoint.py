"""Quantizer state: capture, atomic save, validated restore into a fresh model, schema migrations.

State (schema 1)::

    {"schema": 1, "config": <QuantizeConfig.to_dict() or None>,
     "quantizers": {full name: {"type": "tensor", "attrs": {...}, "_amax": Tensor | None}
                              | {"type": "sequential" | "grouped", "members": [<member state>, ...]}}}

Everything is plain containers and tensors, so ``torch.load(weights_only=True)`` reads it.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Union

import torch
from torch import nn

from .config import ConfigError, QuantizeConfig, QuantizerAttributeConfig
from .nn.containers import GroupedQuantizer, SequentialQuantizer
from .nn.quant_module import QuantModule, QuantModuleRegistry
from .nn.tensor_quantizer import TensorQuantizer

SCHEMA_VERSION = 1

#: migrations[v] turns a schema-v state into a schema-(v+1) one.
MIGRATIONS: dict[int, Callable[[dict], dict]] = {}


class CheckpointError(ValueError):
    """A quantizer checkpoint that cannot be restored into this model; the model is left untouched."""


# ------------------------------------------------------------------------------------ capture


def _quantizer_state(q: nn.Module) -> dict:
    if isinstance(q, TensorQuantizer):
        amax = q.amax
        return {"type": "tensor", "attrs": q.attrs.to_dict() | {"enable": q.is_enabled}, "_amax": None if amax is None else amax.detach().cpu().clone()}
    kind = "grouped" if isinstance(q, GroupedQuantizer) else "sequential"
    return {"type": kind, "members": [_quantizer_state(m) for m in q]}


def quantizer_state(model: nn.Module) -> dict:
    """Plain dict of every quantizer's config and amax (``torch.save``-able, weights-only loadable)."""
    from .model_quant import iter_quantizers

    cfg = getattr(model, "_quantlib_config", None)
    return {
        "schema": SCHEMA_VERSION,
        "config": cfg.to_dict() if isinstance(cfg, QuantizeConfig) else None,
        "quantizers": {name: _quantizer_state(q) for name, _, _, q in iter_quantizers(model)},
    }


def save(model: nn.Module, path: Union[str, os.PathLike]) -> None:
    """Write :func:`quantizer_state` atomically (temp file in the same folder, fsync, rename)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".quantlib-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(quantizer_state(model), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# ------------------------------------------------------------------------------------ restore


def load_state(path: Union[str, os.PathLike]) -> dict:
    """Read a checkpoint file (weights only), or raise CheckpointError if truncated or corrupt."""
    try:
        state = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # torch raises several types for truncated zip archives
        raise CheckpointError(f"{path}: not a readable quantlib checkpoint (truncated or corrupt?): {exc}") from None
    return state


def migrate(state: dict) -> dict:
    """Bring ``state`` to :data:`SCHEMA_VERSION` through the named migrations, one version at a time."""
    if not isinstance(state, dict) or "schema" not in state or "quantizers" not in state:
        raise CheckpointError("not a quantlib quantizer state: expected a dict with 'schema' and 'quantizers'")
    version = state["schema"]
    if not isinstance(version, int) or version < 1:
        raise CheckpointError(f"invalid schema version {version!r}")
    if version > SCHEMA_VERSION:
        raise CheckpointError(f"checkpoint schema {version} is newer than this quantlib ({SCHEMA_VERSION}): upgrade quantlib")
    while version < SCHEMA_VERSION:
        state = MIGRATIONS[version](state)
        version = state["schema"]
    return state


def _planned_quantizers(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Quantizer names a conversion of ``model`` has (or would have): name -> (module, attribute)."""
    from . import plugins

    plugins.register_available()
    plan = {}
    for mname, module in model.named_modules():
        if isinstance(module, (TensorQuantizer, SequentialQuantizer, GroupedQuantizer)):
            continue
        if isinstance(module, QuantModule) or QuantModuleRegistry.is_registered(type(module)):
            qcls = type(module) if isinstance(module, QuantModule) else QuantModuleRegistry.quantized_class(type(module))
            for qn in qcls.quantizer_names:
                plan[f"{mname}.{qn}" if mname else qn] = (module, qn)
    return plan


def _build(qstate: Any, where: str) -> nn.Module:
    """A quantizer module from its state (validating everything before the model is touched)."""
    if not isinstance(qstate, dict) or qstate.get("type") not in ("tensor", "sequential", "grouped"):
        raise CheckpointError(f"{where}: malformed quantizer state {str(qstate)[:80]!r}")
    if qstate["type"] == "tensor":
        try:
            attrs = QuantizerAttributeConfig.from_dict(qstate["attrs"])
        except (ConfigError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{where}: invalid attribute config: {exc}") from None
        q = TensorQuantizer(attrs)
        amax = qstate.get("_amax")
        if amax is not None:
            if not isinstance(amax, torch.Tensor):
                raise CheckpointError(f"{where}: _amax must be a tensor, got {type(amax).__name__}")
            q.amax = amax
        return q
    members = [_build(m, f"{where}.{i}") for i, m in enumerate(qstate.get("members") or [])]
    if not members:
        raise CheckpointError(f"{where}: a {qstate['type']} quantizer with no members")
    try:
        return SequentialQuantizer(*members) if qstate["type"] == "sequential" else GroupedQuantizer(members)
    except TypeError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def _check_weight_shapes(name: str, q: nn.Module, module: nn.Module, attr: str) -> None:
    """A weight quantizer's static amax must fit the weight it will quantize."""
    qcls = type(module) if isinstance(module, QuantModule) else QuantModuleRegistry.quantized_class(type(module))
    if attr not in qcls.weight_quantizer_names:
        return
    groups = dict(qcls.weight_groups(module))
    tensors = groups.get(attr, [])
    members = list(q) if isinstance(q, GroupedQuantizer) else [q]
    if len(members) != len(tensors):
        raise CheckpointError(f"{name}: checkpoint has {len(members)} weight quantizer member(s), the module has {len(tensors)} weight(s)")
    for i, (m, w) in enumerate(zip(members, tensors)):
        first = m if isinstance(m, TensorQuantizer) else m[0]
        if first.amax is not None:
            expected = first.amax_shape(tuple(w.shape))
            if tuple(first.amax.shape) != expected:
                raise CheckpointError(f"{name}{'.' + str(i) if len(members) > 1 else ''}: amax of shape {tuple(first.amax.shape)} does not fit weight {tuple(w.shape)} (expected {expected})")


def restore_state(model: nn.Module, state: dict, strict: bool = True) -> nn.Module:
    """Restore quantizers from ``state`` into ``model`` (fresh or already quantized). Everything is
    validated first: on any mismatch CheckpointError is raised and the model is unchanged."""
    from .model_quant import convert, iter_quantizers, leaves_of

    state = migrate(state)
    plan = _planned_quantizers(model)
    saved = state["quantizers"]
    if not isinstance(saved, dict):
        raise CheckpointError("'quantizers' must be a dict")
    missing, unexpected = sorted(set(plan) - set(saved)), sorted(set(saved) - set(plan))
    if unexpected or (strict and missing):
        raise CheckpointError(f"checkpoint does not match the model: {len(missing)} quantizer(s) missing from it {missing[:3]}, {len(unexpected)} unknown to the model {unexpected[:3]}")
    built = {name: _build(qs, name) for name, qs in saved.items()}
    for name, q in built.items():
        _check_weight_shapes(name, q, *plan[name])
    config = QuantizeConfig.from_any(state["config"]) if state.get("config") else None

    model = convert(model)
    by_name = {n: (parent, attr) for n, parent, attr, _ in iter_quantizers(model)}
    for name, q in built.items():
        parent, attr = by_name[name]
        device = next((t.device for t in list(parent.parameters(recurse=False)) + list(parent.buffers(recurse=False))), None)
        setattr(parent, attr, q.to(device) if device is not None else q)
        for leaf_name, leaf in leaves_of(name, q):
            leaf._qname = leaf_name
    if config is not None:
        model._quantlib_config = config
    return model


def restore(model: nn.Module, path: Union[str, os.PathLike], strict: bool = True) -> nn.Module:
    """Restore a checkpoint written by :func:`save` into ``model`` (usually fresh and unquantized)."""
    return restore_state(model, load_state(path), strict=strict)
