"""Where the weight scales of an export come from: the calibrated amax (a checkpoint of the evaluated
model) or the weight being sent (RL weight sync, after the optimizer moved the weights).

RL trainers cast at sync time from the current weight: one scale per block from that block's amax (FP8
128x128 with its eps floor, so an all-zero block stays finite), per row / per tensor likewise. A
calibrated amax that the weight has outgrown clips it without a sound, so the static mode compares
first and refuses by name.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Union

import torch

from ..formats import FormatSpec, Kind
from ..kernels import block_amax
from ..nn.max_collector import abs_max
from .items import Item
from .types import ExportError


class Scales(str, enum.Enum):
    """Source of the weight scales (activation scales always come from the calibrated input quantizers)."""

    CALIBRATED = "calibrated"  # the quantizer's stored amax, as evaluated (checkpoint export)
    DYNAMIC = "dynamic"  # from the weight being sent, computed on its device (RL weight sync)
    STATIC = "static"  # the stored amax, refusing by name a weight that exceeds it


def as_scales(value: Union[Scales, str]) -> Scales:
    """``value`` as a :class:`Scales`, or ExportError naming the choices."""
    try:
        return Scales(value)
    except ValueError:
        raise ExportError(f"scales={value!r}: expected one of {[s.value for s in Scales]}") from None


def current_amax(w: torch.Tensor, spec: FormatSpec, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 amax of ``w`` in the stored ``shape`` of its quantizer's amax: one value, one per row
    (``[out, 1]``) or one per block; on ``w``'s device, nothing read back."""
    if spec.two_level or len(shape) == 0 or all(s == 1 for s in shape):
        return abs_max(w).reshape(shape)
    if spec.block is not None:
        return block_amax(w, spec.block).reshape(shape)
    return abs_max(w, tuple(d for d, s in enumerate(shape) if s == 1)).reshape(shape)


def _share_key(it: Item, experts: bool) -> Optional[tuple]:
    """Items of one key share one amax for the whole tensor (NVFP4 global, FP8 per tensor): siblings
    that the consumer fuses, and with ``experts`` every expert of a fused-experts module per projection."""
    if it.spec is None or it.amax is None or it.amax.numel() != 1:
        return None
    if experts and it.fused:
        return it.fused, it.group or it.leaf
    return None if it.group is None else (it.parent, it.group)


def dynamic_items(items: list[Item], global_amax: Optional[dict[int, torch.Tensor]] = None, share_experts: bool = False) -> list[Item]:
    """Copies of ``items`` whose weights pack with scales from the weights themselves: amax None where
    the cast computes it in its own pass (FP8 blocks, MX, NVFP4 with its dynamic global amax); the weight's
    amax where a formula needs it first (FP8 per tensor / per row, INT); for siblings that consumers fuse,
    the max of their weights' amax (one global scale per fused GEMM), and with ``share_experts`` (the
    config's ``sync_expert_weight_amax``) the max over a layer's experts. ``global_amax``: id(item) -> an
    amax the caller chose for that item. Queued on the device; nothing is read back."""
    groups: dict[tuple, list[Item]] = {}
    for it in items:
        key = _share_key(it, share_experts)
        if key is not None:
            groups.setdefault(key, []).append(it)
    shared: dict[int, torch.Tensor] = dict(global_amax or {})
    for members in groups.values():
        todo = [m for m in members if id(m) not in shared]
        if len(members) > 1 and todo:
            top = torch.stack([abs_max(m.weight()) for m in members]).amax()
            shared.update((id(m), top) for m in members)
    return [_dynamic(it, shared.get(id(it))) for it in items]


#: the kinds whose cast takes its scales from the weight in its own pass
_IN_CAST = (Kind.MX, Kind.NVFP4, Kind.FP8_BLOCK)


def weight_free(items: list[Item], share_experts: bool = False) -> bool:
    """Whether :func:`dynamic_items` of ``items`` reads no weight (every scale made in the cast kernel, no amax shared
    between items): then its items pack every step's weights, and an RL sync computes them once."""
    return all(it.spec is None or (it.spec.kind in _IN_CAST and _share_key(it, share_experts) is None) for it in items)


def _dynamic(it: Item, shared: Optional[torch.Tensor]) -> Item:
    spec = it.spec
    if spec is None:
        return it
    if shared is not None:
        amax = shared.reshape(it.amax.shape if it.amax is not None else ())
    elif spec.kind in _IN_CAST:
        amax = None  # the cast kernel takes each block's (and NVFP4's global) amax from the weight
    else:
        shape = tuple(it.amax.shape) if it.amax is not None else ()
        amax = current_amax(it.weight(), spec, shape)
    return dataclasses.replace(it, amax=amax, block_amax=None)


def refuse_clipped(items: list[Item]) -> None:
    """Static scales: raise ExportError naming the first weight whose amax exceeds its quantizer's stored
    amax (global or per block / row), with both values; one device read for all items."""
    checked, rows = [], []
    for it in items:
        if it.spec is None or it.spec.kind == Kind.MX or it.amax is None or it.amax.is_meta:
            continue  # MX scales always come from the weight
        w = it.weight()
        pairs = [(current_amax(w, it.spec, tuple(it.amax.shape)), it.amax)]
        if it.block_amax is not None:
            pairs.append((block_amax(w, it.spec.block).reshape(it.block_amax.shape), it.block_amax))
        for cur, stored in pairs:
            cur, stored = cur.reshape(-1), stored.reshape(-1).to(device=cur.device, dtype=torch.float32)
            over = cur > stored
            i = torch.argmax(torch.where(over, cur / stored, torch.zeros_like(cur)))
            rows.append(torch.stack([over.sum().float(), cur[i], stored[i], torch.tensor(float(cur.numel()), device=cur.device)]))
            checked.append(it)
    if not rows:
        return
    by_device: dict[torch.device, list[int]] = {}
    for i, r in enumerate(rows):
        by_device.setdefault(r.device, []).append(i)
    values: list = [None] * len(rows)
    for idx in by_device.values():  # one read per device
        for i, v in zip(idx, torch.stack([rows[i] for i in idx]).tolist()):
            values[i] = v
    for it, (n, cur, stored, total) in zip(checked, values):
        if n:
            where = "its amax" if total == 1 else f"{int(n)} of {int(total)} amax groups; the worst"
            raise ExportError(
                f"{it.where}: the weight {it.name} has outgrown its calibrated scale "
                f"({where}: weight amax {cur:g} > stored amax {stored:g}); "
                "static scales would clip it: sync with scales='dynamic' (scales from the weight being sent) or recalibrate"
            )


def apply_scales(items: list[Item], scales: Scales, share_experts: bool = False) -> list[Item]:
    """``items`` ready to pack with ``scales``: unchanged (calibrated), checked (static) or with dynamic amax
    (``share_experts``: one per-tensor amax for all experts of a layer, see :func:`dynamic_items`)."""
    if scales is not Scales.CALIBRATED:
        chained = next((it for it in items if it.chain is not None), None)
        if chained is not None:  # the chain's second amax was calibrated on the first member's output
            raise ExportError(f"{chained.where}: a chained weight quantizer (W4A8) packs with its calibrated scales only; use "
                              "scales='calibrated'")
    if scales is Scales.DYNAMIC:
        return dynamic_items(items, share_experts=share_experts)
    if scales is Scales.STATIC:
        refuse_clipped(items)
    return items
