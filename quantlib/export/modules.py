"""The module walk every export plan shares: a model's modules without its quantizers, and each module's
own persistent tensors."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..kv.presets import ATTENTION_QUANTIZER_NAMES
from ..nn.containers import QuantizerContainer
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import TensorQuantizer

_QUANTIZERS = (TensorQuantizer, QuantizerContainer)
_ATTENTION = frozenset(ATTENTION_QUANTIZER_NAMES)
_QUANTIZER, _QUANT, _LINEAR = 1, 2, 4
#: module class -> its _QUANTIZER / _QUANT / _LINEAR bits: a model has a handful of classes, and a
#: lookup per module is cheaper than isinstance chains per module and pass
_KINDS: dict[type, int] = {}


def _kind(cls: type) -> int:
    k = _KINDS.get(cls)
    if k is None:
        k = _QUANTIZER * issubclass(cls, _QUANTIZERS) | _QUANT * issubclass(cls, QuantModule) | _LINEAR * issubclass(cls, nn.Linear)
        _KINDS[cls] = k
    return k


def named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()`` without the quantizers, in its order and with its names (one traversal,
    shared by the plan's walks). It does not descend into quantizers: ``named_modules`` would visit every
    quantizer's own submodules (a generator each), a third of a GPU export's host time."""
    return ModuleWalk(model).modules


class ModuleWalk:
    """One traversal of a model shared by every pass of an export plan: ``modules`` (:func:`named_modules`);
    ``owners`` ((name, module, its own persistent tensors by name) of each module holding any, a tied tensor
    under its first owner's name only, as the checkpoint holds it); ``tied`` (some tensor has two owners);
    ``entries`` ((name, module, its tensors, is a QuantModule) of the owners and the quantized modules);
    ``linears`` ((name, module, is a QuantModule) of the quantized modules and plain ``nn.Linear``);
    ``attention`` (modules with a child of an attention quantizer's name); all in module order. ``names``: the
    transformers checkpoint names found for this walk (:mod:`.hf_names`), once asked."""

    __slots__ = ("modules", "owners", "tied", "entries", "linears", "attention", "names")

    def __init__(self, model: nn.Module) -> None:
        self.names: Optional[tuple] = None
        self.modules = modules = []
        self.owners: list[tuple[str, nn.Module, dict[str, torch.Tensor]]] = []
        self.entries: list[tuple[str, nn.Module, dict[str, torch.Tensor], bool]] = []
        self.linears: list[tuple[str, nn.Module, bool]] = []
        self.attention: list[tuple[str, nn.Module]] = []
        kinds = _KINDS
        visited: set[int] = set()  # modules
        seen: set[int] = set()  # tensors
        tied = False
        stack = [("", model)]
        while stack:
            name, module = stack.pop()
            if id(module) in visited:
                continue  # a module reachable twice keeps its first name, as in named_modules
            visited.add(id(module))
            modules.append((name, module))
            cls = type(module)
            kind = kinds[cls] if cls in kinds else _kind(cls)
            children = module._modules
            if children:
                prefix = name + "." if name else ""
                attention = False
                for k, c in reversed(children.items()):
                    if k in _ATTENTION:
                        attention = True
                    if c is None:
                        continue
                    ck = type(c)
                    if not (kinds[ck] if ck in kinds else _kind(ck)) & _QUANTIZER:
                        stack.append((prefix + k, c))
                if attention:
                    self.attention.append((name, module))
            quant = bool(kind & _QUANT)
            if kind & (_QUANT | _LINEAR):
                self.linears.append((name, module, quant))
            params, buffers = module._parameters, module._buffers
            direct = {}
            if params or buffers:
                for k, p in params.items():
                    if p is not None:
                        if id(p) in seen:
                            tied = True
                        else:
                            direct[k] = p
                if buffers:
                    skip = module._non_persistent_buffers_set
                    for k, b in buffers.items():
                        if b is not None and k not in skip:
                            if id(b) in seen:
                                tied = True
                            else:
                                direct[k] = b
                if direct:
                    seen.update(map(id, direct.values()))
                    self.owners.append((name, module, direct))
            if direct or quant:
                self.entries.append((name, module, direct, quant))
        self.tied = tied
