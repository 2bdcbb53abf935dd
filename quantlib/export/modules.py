"""The module walk every export plan shares: a model's modules without its quantizers, and each module's
own persistent tensors."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..nn.containers import QuantizerContainer
from ..nn.tensor_quantizer import TensorQuantizer


def _direct(module: nn.Module, seen: frozenset | set = frozenset()) -> dict[str, torch.Tensor]:
    """The module's own persistent tensors not in ``seen`` (ids): read from its dicts, since
    named_parameters(recurse=False) costs a generator and a memo per module."""
    params, buffers = module._parameters, module._buffers
    if not params and not buffers:
        return {}
    out = {k: p for k, p in params.items() if p is not None and id(p) not in seen}
    for k, b in buffers.items():
        if b is not None and k not in module._non_persistent_buffers_set and id(b) not in seen:
            out[k] = b
    return out


_QUANTIZERS = (TensorQuantizer, QuantizerContainer)


def named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()`` without the quantizers, in its order and with its names (one traversal,
    shared by the plan's walks). It does not descend into quantizers: ``named_modules`` would visit every
    quantizer's own submodules (a generator each), a third of a GPU export's host time."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    stack = [("", model)]
    while stack:
        name, module = stack.pop()
        if id(module) in seen:
            continue  # a module reachable twice keeps its first name, as in named_modules
        seen.add(id(module))
        out.append((name, module))
        if not module._modules:
            continue  # a leaf: most modules
        prefix = name + "." if name else ""
        children = [(prefix + k, c) for k, c in module._modules.items() if c is not None and not isinstance(c, _QUANTIZERS)]
        stack.extend(reversed(children))
    return out


class ModuleWalk:
    """One traversal of a model shared by every pass of an export plan: ``modules`` (:func:`named_modules`),
    ``owners`` ((name, module, :func:`_direct`) of each module holding tensors of its own, a tied tensor
    under its first owner's name only, as the checkpoint holds it) and ``tied`` (some tensor has two owners).
    ``names``: the transformers checkpoint names found for this walk (:mod:`.hf_names`), once asked."""

    __slots__ = ("modules", "owners", "tied", "names")

    def __init__(self, model: nn.Module) -> None:
        self.names: Optional[tuple] = None
        self.modules = modules = named_modules(model)
        self.owners: list[tuple[str, nn.Module, dict[str, torch.Tensor]]] = []
        seen: set[int] = set()
        tied = False
        for name, module in modules:
            params, buffers = module._parameters, module._buffers
            if not params and not buffers:
                continue  # a container: most modules besides the linears and norms
            direct = {}
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
        self.tied = tied
