"""Quantized Transformer Engine modules: ``te.pytorch.Linear``, ``LayerNormLinear`` and ``GroupedLinear``.

Imported by :func:`quantlib.plugins.register_available` only when ``transformer_engine.pytorch``
imports (it needs TE's compiled binding). The TE-version-specific part is one adapter per API
generation of ``_GroupedLinear.forward`` (:mod:`quantlib.plugins.te_adapters`), chosen here by TE's
version and checked against the installed signature; a mismatch makes converting a GroupedLinear raise
a clear error instead of quantizing it wrongly.
"""

from __future__ import annotations

import inspect
import logging
from importlib import metadata

import transformer_engine.pytorch as te
from transformer_engine.pytorch.module import (
    grouped_linear as _te_grouped_linear,
    layernorm_linear as _te_layernorm_linear,
    linear as _te_linear,
)

from ..nn.quant_module import QuantModuleRegistry
from .te_adapters import (
    AdapterError,
    QuantTEGroupedLinearBase,
    QuantTELayerNormLinearBase,
    QuantTELinearBase,
    TensorArgs,
    grouped_linear_adapter,
)

_log = logging.getLogger("quantlib")


def te_version() -> str:
    """The installed Transformer Engine version."""
    version = getattr(__import__("transformer_engine"), "__version__", None)
    if version:
        return str(version)
    for dist in ("transformer_engine", "transformer-engine"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    raise AdapterError("cannot tell the installed Transformer Engine version")


def _unsupported(base: type, reason: str) -> type:
    """A mixin that refuses conversion with ``reason`` (so a model is never half-quantized silently)."""

    def _setup(self) -> None:
        name = QuantModuleRegistry.original_class_of(self).__name__
        raise NotImplementedError(f"quantlib cannot quantize {name} with this Transformer Engine: {reason}")

    return type(f"_Unsupported{base.__name__}", (base,), {"_setup": _setup})


def _register_linear() -> None:
    try:
        args = TensorArgs.from_signature(inspect.signature(_te_linear._Linear.forward))
    except AdapterError as exc:
        QuantModuleRegistry.register(te.Linear, "te.Linear")(_unsupported(QuantTELinearBase, str(exc)))
        return
    mixin = type("_QuantTELinear", (QuantTELinearBase,), {"te_namespace": _te_linear, "te_args": args})
    QuantModuleRegistry.register(te.Linear, "te.Linear")(mixin)


def _register_layernorm_linear() -> None:
    norm_name = next((n for n in ("apply_normalization", "_apply_normalization") if hasattr(_te_layernorm_linear, n)), None)
    try:
        if norm_name is None:
            raise AdapterError("layernorm_linear has no apply_normalization function")
        args = TensorArgs.from_signature(inspect.signature(_te_layernorm_linear._LayerNormLinear.forward))
    except AdapterError as exc:
        QuantModuleRegistry.register(te.LayerNormLinear, "te.LayerNormLinear")(_unsupported(QuantTELayerNormLinearBase, str(exc)))
        return
    attrs = {"te_namespace": _te_layernorm_linear, "te_args": args, "te_norm_name": norm_name}
    mixin = type("_QuantTELayerNormLinear", (QuantTELayerNormLinearBase,), attrs)
    QuantModuleRegistry.register(te.LayerNormLinear, "te.LayerNormLinear")(mixin)


def _register_grouped_linear() -> None:
    version = te_version()
    try:
        adapter = grouped_linear_adapter(version)
        adapter.check_signature(inspect.signature(_te_grouped_linear._GroupedLinear.forward))
    except AdapterError as exc:
        _log.warning("quantlib: te.GroupedLinear of TE %s is not supported: %s", version, exc)
        QuantModuleRegistry.register(te.GroupedLinear, "te.GroupedLinear")(_unsupported(QuantTEGroupedLinearBase, str(exc)))
        return
    attrs = {"te_namespace": _te_grouped_linear, "te_adapter": adapter}
    QuantModuleRegistry.register(te.GroupedLinear, "te.GroupedLinear")(type("_QuantTEGroupedLinear", (QuantTEGroupedLinearBase,), attrs))


_register_linear()
_register_layernorm_linear()
_register_grouped_linear()
