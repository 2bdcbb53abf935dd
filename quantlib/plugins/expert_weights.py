"""The weights of E fused experts fake-quantized as one stacked (E, out, in) tensor, each expert by its
own member of a :class:`~quantlib.nn.GroupedQuantizer`.

Where the members agree on everything but their amax (same config and switches, a static amax each or a
dynamic format, no affine bias), one kernel call quantizes the whole stack with the members' amax stacked
along a leading expert axis ((E, 1, 1) per tensor, (E, out, 1) per channel, (E, out, blocks) per block;
NVFP4: its global amax (E, 1, 1), which the kernels take one per row, and its static block amax
(E, out, blocks)). Every format's scale is a function of its group's amax alone, so this is bit for bit
the per-expert call. Otherwise each member quantizes its own
slice and the results are stacked. Neither reads anything back to the host. Outside autograd and
torch.compile the result is cached until the parameter or a member's state changes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..formats import Kind
from ..nn.quant_module import _quantizer_token
from ..nn.tensor_quantizer import TensorQuantizer, _raise_named


def quantize_stacked(module: nn.Module, name: str, param: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The (E, out, in) fake-quantized weights of ``param`` ((E, out, in), or (E, in, out) if ``transposed``)
    by the members of grouped quantizer ``name`` of ``module`` (a view of ``param`` where all are disabled)."""
    weights = param.transpose(1, 2) if transposed else param
    group = module._modules[name]
    members = list(group._modules.values())
    leaves = members  # hasattr(m, "leaves") on a TensorQuantizer costs a formatted AttributeError: only for containers
    if any(type(m) is not TensorQuantizer for m in members):
        leaves = [leaf for m in members for leaf in (m.leaves() if hasattr(m, "leaves") else (m,))]
    if all(leaf._disabled for leaf in leaves):
        return weights
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and param.requires_grad):
        return _quantize(module, name, members, weights)
    token = _quantizer_token(leaves)
    if token is None or param.is_inference():
        return _quantize(module, name, members, weights)
    key = (id(param), param.data_ptr(), param._version, param.dtype, param.device, transposed, token)
    # in the module's weight cache, which copies and pickles leave behind (QuantModule.__getstate__)
    cache = module.__dict__.setdefault("_weight_cache", {})
    hit = cache.get(("stacked", name))
    if hit is not None and hit[0] == key:
        return hit[1]
    out = _quantize(module, name, members, weights)
    # the entry keeps the parameter alive, whose id() is in its key (see QuantModule.quantize_weight)
    cache[("stacked", name)] = (key, out, param)
    return out


def _quantize(module: nn.Module, name: str, members: list, weights: torch.Tensor) -> torch.Tensor:
    batched = _batched(members, weights)
    if batched is not None:
        return batched
    # members that differ: each its own slice (the per-expert path, through the module's weight cache)
    return torch.stack([module.quantize_weight(weights[e], name, e) for e in range(len(members))])


def _batched(members: list, weights: torch.Tensor) -> Optional[torch.Tensor]:
    """All members' fake quant in one call, or None where they cannot share one (see the module doc)."""
    first = members[0]
    if type(first) is not TensorQuantizer or first._disabled or first._if_calib or first._attrs.bias is not None:
        return None
    spec = first.spec
    static = first.needs_calibration
    if not static and (spec.kind == Kind.NVFP4 or not (spec.kind == Kind.MX or spec.dynamic)):
        return None  # type "dynamic" on a per-tensor / per-channel format or NVFP4: an amax from each expert's slice
    scales = first.pre_quant_scale is not None
    for m in members:
        if type(m) is not TensorQuantizer or m._disabled != first._disabled or m._if_calib or m._if_quant != first._if_quant:
            return None
        if not (m._attrs is first._attrs or m._attrs == first._attrs):
            return None
        if (m.pre_quant_scale is not None) != scales or (static and m.amax is None):
            return None
    x = weights
    if scales:  # each expert's weight times its own per-input-channel scale, as TensorQuantizer.pre_scale
        pqs = torch.stack([m.pre_quant_scale for m in members])
        if pqs.dim() != 2 or pqs.shape[1] != weights.shape[-1]:
            return None
        x = weights * pqs.unsqueeze(1).to(weights.dtype)
    if not first._if_quant:
        return x
    amax = None
    if static:
        shape = first.amax_shape(tuple(weights.shape[1:]))
        try:
            amax = torch.stack([m.amax.reshape(shape) for m in members])
        except RuntimeError:  # an amax of another size (an error the per-expert path reports by name)
            return None
        amax = amax.reshape(amax.shape + (1,) * (weights.dim() - amax.dim()))
    blocks = [m._block_amax_for() for m in members]
    if any((b is None) != (blocks[0] is None) for b in blocks):
        return None  # static NVFP4 blocks stored for some members only
    try:
        block_amax = None if blocks[0] is None else torch.stack(blocks)
    except RuntimeError:  # block amax of other sizes (an error the per-expert path reports by name)
        return None
    try:
        return first._fake_quant(x, amax, block_amax)
    except Exception as exc:
        _raise_named(exc, first._qname)


__all__ = ["quantize_stacked"]
