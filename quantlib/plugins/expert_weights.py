"""The weights of E fused experts fake-quantized as one stacked (E, out, in) tensor, each expert by its
own member of a :class:`~quantlib.nn.GroupedQuantizer`.

Where the members agree on everything but their amax (same config and switches, a static amax each or a
dynamic format, no affine bias), one kernel call quantizes the whole stack with the members' amax stacked
along a leading expert axis ((E, 1, 1) per tensor, (E, out, 1) per channel, (E, out, blocks) per block;
NVFP4: its global amax (E, 1, 1), which the kernels take one per row, and its static block amax
(E, out, blocks)). Every format's scale is a function of its group's amax alone, so this is bit for bit
the per-expert call. Otherwise each member quantizes its own
slice and the results are stacked. Neither reads anything back to the host. Outside autograd and
torch.compile the result is cached until the parameter or a member's state changes; under autograd (QAT)
the members' stacked scales are kept likewise, and only the weights are fake-quantized each step.
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional

import torch
from torch import nn

from ..nn.quant_module import _quantizer_token
from ..nn.tensor_quantizer import TensorQuantizer, _raise_named


def quantize_stacked(module: nn.Module, name: str, param: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The (E, out, in) fake-quantized weights of ``param`` ((E, out, in), or (E, in, out) if ``transposed``)
    by the members of grouped quantizer ``name`` of ``module`` (a view of ``param`` where all are disabled)."""
    weights = param.transpose(1, 2) if transposed else param
    members = list(module._modules[name]._modules.values())
    return stacked_fake_quant(module, ("stacked", name), members, (param,), lambda: weights, tuple(weights.shape),
                              lambda e: module.quantize_weight(weights[e], name, e), transposed)


def stacked_fake_quant(owner: nn.Module, key: Hashable, members: list, params: tuple[torch.Tensor, ...],
                       stack: Callable[[], torch.Tensor], shape: tuple[int, ...], per_member: Callable[[int], torch.Tensor],
                       extra: Hashable = None) -> torch.Tensor:
    """Member e of ``members`` fake-quantizes slice e of ``stack()`` (the (E, out, in) weights of ``shape``
    made from ``params``): one call where the members agree, else ``per_member(e)`` stacked. Cached in
    ``owner``'s weight cache under ``key`` until a parameter, a member or ``extra`` changes."""
    leaves = members  # hasattr(m, "leaves") on a TensorQuantizer costs a formatted AttributeError: only for containers
    if set(map(type, members)) != {TensorQuantizer}:
        leaves = [leaf for m in members for leaf in (m.leaves() if hasattr(m, "leaves") else (m,))]
    if all(leaf._disabled for leaf in leaves):
        return stack()
    compiling = torch.compiler.is_compiling()
    weight_cache = None if compiling else owner.__dict__.setdefault("_weight_cache", {})
    token = None if compiling else _quantizer_token(leaves, weight_cache.setdefault(("token", key), {}))
    # the members' stacked scales, kept while their states are the same (QAT stacks E amax per step otherwise)
    plans = None if token is None else weight_cache.setdefault(("plan", key), {})
    if compiling or (torch.is_grad_enabled() and any(p.requires_grad for p in params)):
        return _quantize(members, stack, shape, per_member, plans, token)
    if token is None or any(p.is_inference() for p in params):
        return _quantize(members, stack, shape, per_member, plans, token)
    first = params[0]
    cache_key = (tuple((id(p), p.data_ptr(), p._version) for p in params), first.dtype, first.device, extra, token)
    # in the module's weight cache, which copies and pickles leave behind (QuantModule.__getstate__)
    hit = weight_cache.get(key)
    if hit is not None and hit[0] == cache_key:
        return hit[1]
    out = _quantize(members, stack, shape, per_member, plans, token)
    # the entry keeps the parameters alive, whose id() are in its key (see QuantModule.quantize_weight)
    weight_cache[key] = (cache_key, out, params)
    return out


def _quantize(members: list, stack: Callable[[], torch.Tensor], shape: tuple[int, ...], per_member: Callable[[int], torch.Tensor],
              plans: Optional[dict], token: Optional[tuple]) -> torch.Tensor:
    plan = None if plans is None else plans.get(shape)
    if plan is None or plan[0] != token:
        plan = (token, _plan(members, shape))
        if plans is not None and not any(t is not None and t.requires_grad for t in plan[1] or ()):
            plans[shape] = plan
    if plan[1] is not None:
        # (stacking separate parameters copies them: only once the one call is sure)
        return _batched(members[0], stack(), *plan[1])
    # members that differ: each its own slice (the per-expert path, through the module's weight cache)
    return torch.stack([per_member(e) for e in range(len(members))])


def _plan(members: list, shape: tuple) -> Optional[tuple]:
    """(pre_quant_scale (E, in), amax, block amax) stacked over the members, for the one call over (E, out,
    in) weights of ``shape``; None where the members cannot share one call (see the module doc)."""
    first = members[0]
    if type(first) is not TensorQuantizer or first._disabled or first._if_calib or first._attrs.bias is not None:
        return None
    spec = first.spec
    static = first.needs_calibration
    if not static and spec.calibrated_amax:
        return None  # type "dynamic" on a per-tensor / per-channel format or NVFP4: an amax from each expert's slice
    scales = first.pre_quant_scale is not None
    for m in members:
        if type(m) is not TensorQuantizer or m._disabled != first._disabled or m._if_calib or m._if_quant != first._if_quant:
            return None
        if not (m._attrs is first._attrs or m._attrs == first._attrs):
            return None
        if (m.pre_quant_scale is not None) != scales or (static and m.amax is None):
            return None
    pqs = None
    if scales:  # each expert's weight times its own per-input-channel scale, as TensorQuantizer.pre_scale
        pqs = torch.stack([m.pre_quant_scale for m in members])
        if pqs.dim() != 2 or pqs.shape[1] != shape[-1]:
            return None
    if not first._if_quant:
        return pqs, None, None
    amax = None
    if static:
        amax_shape = first.amax_shape(shape[1:])
        try:
            amax = torch.stack([m.amax.reshape(amax_shape) for m in members])
        except RuntimeError:  # an amax of another size (an error the per-expert path reports by name)
            return None
        amax = amax.reshape(amax.shape + (1,) * (len(shape) - amax.dim()))
    blocks = [m._block_amax_for() for m in members]
    if any((b is None) != (blocks[0] is None) for b in blocks):
        return None  # static NVFP4 blocks stored for some members only
    try:
        block_amax = None if blocks[0] is None else torch.stack(blocks)
    except RuntimeError:  # block amax of other sizes (an error the per-expert path reports by name)
        return None
    return pqs, amax, block_amax


def _batched(first: TensorQuantizer, weights: torch.Tensor, pqs: Optional[torch.Tensor], amax: Optional[torch.Tensor],
             block_amax: Optional[torch.Tensor]) -> torch.Tensor:
    """All members' fake quant of the stacked ``weights`` in one call, with the scales of :func:`_plan`."""
    x = weights if pqs is None else weights * pqs.unsqueeze(1).to(weights.dtype)
    if not first._if_quant:
        return x
    try:
        return first._fake_quant(x, amax, block_amax)
    except Exception as exc:
        _raise_named(exc, first._qname)


__all__ = ["quantize_stacked", "stacked_fake_quant"]
