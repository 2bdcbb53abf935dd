"""Quantized linears that the checkpoint saves as the rows of one key (Param2 / Sarvam's q / k / v as one
``query_key_value``, HRM-Text's ``gqkv_proj``): transformers' save concatenates the weights along their output rows,
and its load splits them by each module's size, scales included. One item is planned for the key, quantized as the
members are, when the rows of every member quantize alone as they do in the key: scales per row or per block of
rows that start with the member (one per tensor only where the members share it). Anything else is refused by name.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from torch import nn

from ..formats.spec import describe
from .items import Item
from .types import ExportError


def row_order(model: nn.Module, key: str, srcs: tuple[str, ...], rows: dict[str, int]) -> Optional[tuple[str, ...]]:
    """The sources of ``key`` in the order its rows hold them, where transformers' save makes ``key`` of their whole rows
    concatenated (else None); ``rows``: each source's row count. Run on one id per row, not on the tensors."""
    from transformers.core_model_loading import revert_weight_conversion

    ids, start = {}, 0
    for s in srcs:
        ids[s] = torch.arange(start, start + rows[s], dtype=torch.float64)[:, None]
        start += rows[s]
    try:
        with torch.no_grad():
            out = revert_weight_conversion(model, dict(ids)).get(key)
    except Exception:  # noqa: BLE001 - a conversion that needs real shapes: not a plain concatenation as far as we can tell
        return None
    if out is None or tuple(out.shape) != (start, 1):
        return None
    order, at, got = [], 0, out.reshape(-1)
    while at < start:
        s = next((s for s in srcs if s not in order and got[at] == ids[s][0, 0]), None)
        if s is None or not torch.equal(got[at : at + rows[s]], ids[s].reshape(-1)):
            return None
        order.append(s)
        at += rows[s]
    return tuple(order)


def _amax(members: list[Item], spec, key: str) -> Optional[torch.Tensor]:
    """The key's amax: the members' along rows (per row, or per block of rows each member starts), or their one shared value."""
    amaxes = [m.amax for m in members]
    if all(a is None for a in amaxes):
        return None
    if any(a is None for a in amaxes):
        raise ExportError(f"{key}: {[m.where for m in members if m.amax is None]} hold no amax and the others do; calibrate them alike")
    if spec.two_level or (spec.block is None and all(a.numel() == 1 for a in amaxes)):  # one per tensor (NVFP4's global)
        if any(not torch.equal(a.reshape(()), amaxes[0].reshape(())) for a in amaxes):
            raise ExportError(f"{key}: {', '.join(m.where for m in members)} are saved as one tensor with one scale, but their amax differ "
                              f"({[float(a.reshape(())) for a in amaxes]}); call quantlib.export.share_sibling_amax(model) first")
        return amaxes[0]
    b0 = spec.block[0] if spec.block is not None and len(spec.block) == 2 else 1
    for m, a in zip(members, amaxes):
        if a.dim() == 0 or a.shape[0] != -(-m.shape[0] // b0) or (m is not members[-1] and m.shape[0] % b0):
            raise ExportError(f"{m.where} = {describe(spec)}: its scales do not tile its {m.shape[0]} rows of {key} alone (amax of shape "
                              f"{tuple(a.shape)}); a key saved of several modules takes scales per row, or per block of rows each starts")
    return torch.cat(amaxes)


def fused_item(key: str, members: list[Item], weight, extras: dict) -> Item:
    """One item for checkpoint module ``key`` (its weight ``weight``: transformers' conversion of the members' weights) of the
    quantized ``members`` in row order; refuses, naming the quantizers, members quantized apart."""
    first = members[0]
    for m in members[1:]:
        a, b = m.input_amax, first.input_amax
        same_input = (a is None) == (b is None) and (a is None or torch.equal(a, b))
        if m.spec != first.spec or m.input_spec != first.input_spec or not same_input:
            raise ExportError(f"{m.where} = {describe(m.spec)} / {describe(m.input_spec)} and {first.where} = {describe(first.spec)} / "
                              f"{describe(first.input_spec)}: transformers saves them as one tensor ({key}), so they need one scheme and "
                              "one input scale")
    for m in members:
        if m.chain is not None or m.transposed or m.shape[1:] != first.shape[1:]:
            raise ExportError(f"{m.where}: saved within {key} of several modules, which quantlib writes for one plain 2-D weight quantizer "
                              "per member only")
    block = None
    if first.block_amax is not None:  # NVFP4 static blocks: one row of blocks per weight row
        block = torch.cat([m.block_amax for m in members])
    parent, _, leaf = key.rpartition(".")
    return replace(first, name=key, where=f"{key} ({', '.join(m.where for m in members)})", weight=weight,
                   amax=_amax(members, first.spec, key), extras=extras, shard=None, parent=parent, leaf=leaf, tp_axis=None,
                   shape=(sum(m.shape[0] for m in members), *first.shape[1:]), block_amax=block,
                   input_where=", ".join(m.input_where for m in members), members=tuple(f"{m.parent}.{m.leaf}" if m.parent else m.leaf
                                                                                      for m in members))


def refuse_unread_rows(items: list[Item], packer) -> None:
    """Refuses, by name, a key of several quantized modules where no consumer of ``packer``'s format reads it (transformers)."""
    for it in items:
        why = packer.member_for(it.spec).rows_within_why if it.members else None
        if why is not None:
            raise ExportError(f"{it.where}: transformers saves these weights as one key, {it.name}.weight, and format "
                              f"{packer.fmt.value} has no consumer that reads it quantized ({why}); export to a modelopt_* format, which "
                              "vLLM reads, or disable these quantizers")
