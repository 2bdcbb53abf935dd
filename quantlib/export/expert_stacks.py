"""Stacked experts planned whole for the RL weight sync: one plan item per projection of a fused-experts module
(the (E, out, in) parameter), cast per vLLM shard (w1 / w3 rows of ``gate_up_proj``, w2) from that shard's rows of
the stack, instead of one item, one cast and one stack per expert and shard. The tensors are those of the per-expert
plan, byte for byte: FP8-block and MX blocks never cross experts, and each shard is cast alone as each expert's is.
``iter_packed`` holds one shard's tensors at a time (and a group of experts' codes where the shard's rows are strided).
``sync_pairs``, which joins w1 and w3 into vLLM's w13, casts ``gate_up_proj`` whole where no block spans both shards
(always, for the shapes the FP8-block checks accept): one read of the bf16 stack, one write of its codes and scales,
the shards views of them, and nothing held beyond the w13 tensors it yields.
``serialize_weight(batched_experts=True)`` casts its stack in one call on the same terms (:func:`one_cast`).

A projection is planned whole only where every expert's quantizer is the same enabled FP8-block or MX quantizer
without a chain, a ``pre_quant_scale`` or a bias, and the format packs a 3-D stack as the stack of its 2-D tensors
(``Packer.packs_stacks``); anything else keeps the per-expert items (and their messages).
"""

from __future__ import annotations

import weakref
from typing import Iterator, Optional

import torch
from torch import nn

from ..formats import FormatSpec, Kind
from ..nn.tensor_quantizer import TensorQuantizer
from .items import Item, active_input, has_pqs_slot
from .layouts import ModelLayout
from .plan import fused_name
from .quantize import real_quantize
from .types import ExportError
from .writers import Packer

#: the kinds whose kernels take an (E, out, in) stack whole, every expert's blocks its own
_KINDS = (Kind.FP8_BLOCK, Kind.MX)
#: a shard whose rows are strided in the stack (w1 / w3 of ``gate_up_proj``) is cast in at most this many groups of
#: experts: the kernel's contiguous copy of a group's rows is then at most a sixteenth of the shard
_GROUPS = 16


def stacked_items(module: nn.Module, name: str, layout: ModelLayout, packer: Packer) -> Optional[list[Item]]:
    """One item per projection of the fused-experts ``module`` (its ``parts``: vLLM's shards), or None where a
    projection must be planned per expert."""
    from ..plugins.hf_experts import expert_weight, flag

    if not packer.packs_stacks or getattr(module, "has_bias", False):
        return None
    items = []
    for proj in module.projections:
        amaxes = _alike_cached(getattr(module, f"{proj}_weight_quantizer"), module.num_experts)
        if amaxes is None:
            return None
        first = getattr(module, f"{proj}_weight_quantizer")[0]
        ispec, iamax = active_input(getattr(module, f"{proj}_input_quantizer", None))
        if packer.shares_global(first.spec, ispec):
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


#: a weight-quantizer group -> (its members' generations, what :func:`_alike` answered for them)
_ALIKE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _alike_cached(group: nn.Module, experts: int) -> Optional[list[Optional[torch.Tensor]]]:
    """:func:`_alike` of the group's members, asked again only when one of them changed: every change but in-place
    writes into a buffer (which keep its shape) changes a quantizer's ``generation``, which is never reused."""
    members = list(group)[:experts]  # not group[e]: ModuleList's index is slow
    key = (experts, tuple(getattr(q, "generation", None) for q in members))
    hit = _ALIKE.get(group)
    if hit is not None and hit[0] == key:
        return hit[1]
    amaxes = _alike(members, experts)
    _ALIKE[group] = (key, amaxes)
    return amaxes


def _alike(members: list, experts: int) -> Optional[list[Optional[torch.Tensor]]]:
    """The amax of each of the ``experts`` quantizers ``members`` where they are one enabled FP8-block or MX quantizer
    without a pre_quant_scale, every amax absent or all of one shape; else None. One pass (run at every sync)."""
    first = members[0] if len(members) == experts else None
    if not (isinstance(first, TensorQuantizer) and first.is_enabled and first.spec.kind in _KINDS):
        return None
    kind, spec, amaxes = type(first), first.spec, []
    shape = None if first.amax is None else first.amax.shape
    for q in members:
        a = q.amax
        if type(q) is not kind or not q.is_enabled or (has_pqs_slot(q) and q.pre_quant_scale is not None):
            return None
        if (None if a is None else a.shape) != shape or not (q.spec is spec or q.spec == spec):
            return None
        amaxes.append(a)
    return amaxes


def one_cast(items: list[Item], packer: Packer) -> bool:
    """Whether the per-expert ``items`` of one (E, out, in) tensor pack as one cast of the whole stack: one FP8-block or
    MX spec, every amax absent or all of one shape, no chain, fold or static block amax, a format that packs stacks."""
    first = items[0]
    alike = all(it.spec == first.spec and it.chain is None and it.pre is None and it.post is None and it.block_amax is None for it in items)
    return packer.packs_stacks and first.spec.kind in _KINDS and alike and len({None if it.amax is None else tuple(it.amax.shape)
                                                                                 for it in items}) == 1


def input_stacks(packer: Packer, spec: Optional[FormatSpec], amax: Optional[torch.Tensor], experts: int) -> dict[str, torch.Tensor]:
    """The input quantizer's packed tensors, one row per expert (a fused-experts module has one input quantizer for
    every expert), as the per-expert tensors stacked; none without an input quantizer."""
    if spec is None:
        return {}
    return {k: torch.stack([t] * experts) for k, t in packer.pack_input(spec, amax).items()}


def shard_tensors(it: Item, packer: Packer, joined: bool = False) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Each vLLM shard of the stacked item ``it`` and its packed tensors (every expert on dim 0), cast from the shard's
    own rows of the stack one shard at a time (as each expert's shard is cast alone), so the sync holds one shard's
    tensors, not the projection's.

    ``joined``: where no block spans two shards (:func:`rows_apart`), one cast of the whole contiguous stack, each
    shard's tensors views of its rows: the stack is read once and its codes written once, and a consumer that
    concatenates the shards again (vLLM's ``w13``, :func:`~quantlib.export.vllm_names.named_pairs`) gets the cast's
    tensors back without a copy; the views are not contiguous where the stack has several shards."""
    w = it.weight()
    if joined and rows_apart(it):
        packed = packer.pack(real_quantize(w, it.spec, _static_amax(it, 0, it.experts, 0, it.shape[0]), backend="auto"))
        for _, shard, r0, r1 in it.parts:
            yield shard, {k: _row_part(it, k, t, r0, r1) for k, t in packed.items()}
        return
    for _, shard, r0, r1 in it.parts:
        yield shard, _cast_rows(it, packer, w, r0, r1)


def _row_block(it: Item) -> int:
    """Rows of the stacked item's weight blocks: 2-D FP8 blocks' first side, 1 where every row has its own scales."""
    block = it.spec.block or ()
    return block[0] if it.spec.kind == Kind.FP8_BLOCK and len(block) == 2 else 1


def rows_apart(it: Item) -> bool:
    """Whether every shard of the stacked item ``it`` starts on a block row, so that casting the whole stack gives each
    shard the bytes its own cast gives (MX and 1xN blocks: always; 128x128: shards of whole 128-row blocks)."""
    br = _row_block(it)
    return all(r0 % br == 0 for _, _, r0, _ in it.parts)


def _row_part(it: Item, key: str, t: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of the stack's packed tensor ``t`` (codes: one row each; scales: one per row or per block row)."""
    rows, br = it.shape[0], _row_block(it)
    if r0 == 0 and r1 == rows:
        return t
    if t.dim() >= 2 and t.shape[0] == it.experts and t.shape[1] == rows:
        return t.narrow(1, r0, r1 - r0)
    if t.dim() >= 2 and t.shape[0] == it.experts and t.shape[1] == -(-rows // br) and r0 % br == 0:
        return t.narrow(1, r0 // br, -(-(r1 - r0) // br))
    raise ExportError(f"{it.where}: packed {key} {tuple(t.shape)} of the stack {(it.experts, *it.shape)} has no rows [{r0}, {r1}) "
                      f"on dim 1 (one per row or per {br} rows)")


def _cast_rows(it: Item, packer: Packer, w: torch.Tensor, r0: int, r1: int) -> dict[str, torch.Tensor]:
    """The packed tensors of rows [r0, r1) of every expert of the stack ``w``: one cast where those rows are contiguous,
    else a cast per group of experts written into the shard's tensors (the pack of a stack is the stack of its packs)."""
    x, n = w.narrow(1, r0, r1 - r0), it.experts
    step = n if x.is_contiguous() else -(-n // _GROUPS)
    out: dict[str, torch.Tensor] = {}
    for e0 in range(0, n, step):
        k = min(step, n - e0)
        packed = packer.pack(real_quantize(x.narrow(0, e0, k), it.spec, _static_amax(it, e0, k, r0, r1), backend="auto"))
        if k == n:
            return packed
        for key, t in packed.items():
            if t.dim() == 0 or t.shape[0] != k:
                raise ExportError(f"{it.where}: packed {key} {tuple(t.shape)} of experts [{e0}, {e0 + k}) does not stack them on dim 0")
            if key not in out:
                out[key] = t.new_empty((n, *t.shape[1:]))
            out[key][e0:e0 + k] = t
        del packed  # before the next group's cast
    return out


def _static_amax(it: Item, e0: int, k: int, r0: int, r1: int) -> Optional[torch.Tensor]:
    """The static FP8-block amax of experts [e0, e0 + k) and rows [r0, r1) of the stack (None: the cast takes none);
    refused where those rows are not whole blocks of an amax given per block row."""
    a = it.amax
    if a is None or it.spec.kind != Kind.FP8_BLOCK or it.spec.dynamic:
        return None  # MX and dynamic blocks take their scales from the weight
    br, rows = (it.spec.block[0] if len(it.spec.block) == 2 else 1), it.shape[0]
    if a.dim() != 3 or a.shape[1] not in (1, -(-rows // br)) or (a.shape[1] > 1 and (r0 % br or (r1 % br and r1 != rows))):
        raise ExportError(f"{it.where}: static block amax {tuple(a.shape)} of block {tuple(it.spec.block)} does not split at the shard "
                          f"rows [{r0}, {r1}) of the stack {(it.experts, *it.shape)}")
    a = a.narrow(0, e0, k)
    return a if a.shape[1] == 1 else a.narrow(1, r0 // br, -(-(r1 - r0) // br))
