"""Walking a converted model's quantizers: the traversal that quantize(), the amax sync, checkpoints and
plugins share (below all of them, so none has to import another for it)."""

from __future__ import annotations

from typing import Any, Iterator, Optional

from torch import nn

from .nn.containers import QuantizerContainer
from .nn.quant_module import QuantModule, QuantModuleRegistry
from .nn.tensor_quantizer import TensorQuantizer


def iter_quantizers(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
    """(full name, parent module, attribute name, quantizer) of every top-level quantizer; the members
    of a container are not listed separately (see :func:`iter_leaf_quantizers`)."""

    def walk(module: nn.Module, prefix: str):
        for attr, child in module.named_children():
            full = f"{prefix}.{attr}" if prefix else attr
            if isinstance(child, (TensorQuantizer, QuantizerContainer)):
                yield full, module, attr, child
            else:
                yield from walk(child, full)

    yield from walk(model, "")


def leaves_of(name: str, q: nn.Module) -> Iterator[tuple[str, TensorQuantizer]]:
    """(name, TensorQuantizer) of ``q`` itself or of each member (``name.i``, depth first)."""
    if isinstance(q, TensorQuantizer):
        yield name, q
        return
    for i, m in enumerate(q):
        yield from leaves_of(f"{name}.{i}", m)


def iter_leaf_quantizers(model: nn.Module) -> Iterator[tuple[str, TensorQuantizer]]:
    """(name, TensorQuantizer) of every leaf quantizer, members of containers included, in model order."""
    for name, _, _, q in iter_quantizers(model):
        yield from leaves_of(name, q)


def quant_modules(model: nn.Module) -> Iterator[tuple[str, QuantModule]]:
    """(name, module) of every converted (QuantModule) submodule."""
    for name, m in model.named_modules():
        if isinstance(m, QuantModule):
            yield name, m


def applied_config(model: nn.Module) -> Any:
    """The parsed QuantizeConfig last applied to ``model``'s converted modules (see
    ``QuantModule.applied_config``), or None where none was."""
    return next((m.applied_config for _, m in quant_modules(model) if m.applied_config is not None), None)


def set_applied_config(model: nn.Module, config: Any) -> None:
    """Record the parsed ``config`` on every converted module of ``model`` (one shared object)."""
    for _, m in quant_modules(model):
        m.applied_config = config


def class_names(module: nn.Module) -> tuple[str, ...]:
    """Names of the nn.Module classes of ``module``'s original (unquantized) class and its bases: what a
    config rule's ``module_class`` is matched against."""
    return tuple(c.__name__ for c in QuantModuleRegistry.original_class_of(module).__mro__ if issubclass(c, nn.Module))


def expert_group_key(name: str) -> Optional[str]:
    """Name with the expert index replaced by ``*`` (the last numeric path component), or None."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].isdigit():
            return ".".join(parts[:i] + ["*"] + parts[i + 1 :])
    return None


__all__ = ["class_names", "expert_group_key", "iter_leaf_quantizers", "iter_quantizers", "leaves_of", "quant_modules"]


def weight_quantizer_ids(model: nn.Module) -> set[int]:
    """ids of every weight quantizer leaf (members of containers included): what is not one quantizes activations."""
    ids = set()
    for _, m in quant_modules(model):
        for qname in m.weight_quantizer_names:
            for _, leaf in leaves_of(qname, getattr(m, qname)):
                ids.add(id(leaf))
    return ids


def clear_weight_cache(model: nn.Module) -> int:
    """Drop every cached fake-quantized weight; returns how many. Needed only after writes that bypass
    the version counter the cache keys on (``weight.data.mul_(...)``); ordinary in-place writes,
    optimizer steps and ``load_state_dict`` invalidate it by themselves."""
    n = 0
    for _, m in quant_modules(model):
        cache = m.__dict__.get("_weight_cache")
        if cache:
            n += len(cache)
            cache.clear()
    return n
