"""Stacked experts planned whole for the RL weight sync: one plan item per projection of a fused-experts module
(the (E, out, in) parameter), cast in one kernel call and split into vLLM's shards (w1 / w3 rows of ``gate_up_proj``,
w2), instead of one item, one cast and one stack per expert and shard. The tensors are those of the per-expert
plan, byte for byte: FP8-block and MX blocks never cross experts (rows of whole blocks are checked per shard).
``serialize_weight(batched_experts=True)`` casts its stack in one call on the same terms (:func:`one_cast`).

A projection is planned whole only where every expert's quantizer is the same enabled FP8-block or MX quantizer
without a chain, a ``pre_quant_scale`` or a bias, and the format packs a 3-D stack as the stack of its 2-D tensors
(``Packer.packs_stacks``); anything else keeps the per-expert items (and their messages).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..formats import Kind
from ..nn.tensor_quantizer import TensorQuantizer
from .items import Item, active_input, has_pqs_slot
from .layouts import ModelLayout
from .plan import fused_name
from .writers import Packer

#: the kinds whose kernels take an (E, out, in) stack whole, every expert's blocks its own
_KINDS = (Kind.FP8_BLOCK, Kind.MX)


def stacked_items(module: nn.Module, name: str, layout: ModelLayout, packer: Packer) -> Optional[list[Item]]:
    """One item per projection of the fused-experts ``module`` (its ``parts``: vLLM's shards), or None where a
    projection must be planned per expert."""
    from ..plugins.hf_experts import expert_weight, flag

    if not packer.packs_stacks or getattr(module, "has_bias", False):
        return None
    items = []
    for proj in module.projections:
        group = getattr(module, f"{proj}_weight_quantizer")
        members = [group[e] for e in range(module.num_experts)]
        first = members[0]
        if not (isinstance(first, TensorQuantizer) and first.is_enabled and first.spec.kind in _KINDS):
            return None
        if not all(type(q) is type(first) and q.is_enabled and (q.spec is first.spec or q.spec == first.spec) for q in members):
            return None
        if any(has_pqs_slot(q) and q.pre_quant_scale is not None for q in members):
            return None
        ispec, iamax = active_input(getattr(module, f"{proj}_input_quantizer", None))
        if packer.shares_global(first.spec, ispec):
            return None
        amaxes = [q.amax for q in members]
        if len({None if a is None else tuple(a.shape) for a in amaxes}) > 1:
            return None
        rows, cols = expert_weight(module, proj, 0).shape
        parts, last = (layout.expert_parts(name, proj, e, rows) for e in (0, module.num_experts - 1))
        fused = fused_name(parts[0][0], 0, name, layout)
        if [p[1:] for p in last] != [p[1:] for p in parts] or fused_name(last[0][0], module.num_experts - 1, name, layout) != fused:
            return None  # the checkpoint names some expert's shards otherwise
        swap = flag(module, "is_transposed")
        get = (lambda proj=proj, swap=swap: getattr(module, proj).detach().transpose(1, 2) if swap else getattr(module, proj).detach())  # noqa: E731
        amax = None if amaxes[0] is None else torch.stack(amaxes)
        items.append(Item(fused, "expert", f"{name}.{proj}_weight_quantizer", get, first.spec, amax, ispec, iamax, parent=name, leaf=proj,
                          shape=(rows, cols), fused=fused, input_where=f"{name}.{proj}_input_quantizer",
                          parts=tuple((leaf, shard, r0, r1) for _, leaf, shard, r0, r1 in parts), experts=module.num_experts))
    return items


def one_cast(items: list[Item], packer: Packer) -> bool:
    """Whether the per-expert ``items`` of one (E, out, in) tensor pack as one cast of the whole stack: one FP8-block or
    MX spec, every amax absent or all of one shape, no chain, fold or static block amax, a format that packs stacks."""
    first = items[0]
    alike = all(it.spec == first.spec and it.chain is None and it.pre is None and it.post is None and it.block_amax is None for it in items)
    return packer.packs_stacks and first.spec.kind in _KINDS and alike and len({None if it.amax is None else tuple(it.amax.shape)
                                                                                 for it in items}) == 1
