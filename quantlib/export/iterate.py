"""``iter_packed``: the streaming iterator under every export path (checkpoints, RL weight sync)."""

from __future__ import annotations

from typing import Iterator, Literal, Optional, Union

import torch
from torch import nn

from .formats import as_format, packer as get_packer
from .layouts import ModelLayout, layout_for
from .plan import Item, Plan, make_plan
from .quantize import real_quantize
from .types import ExportFormat, PackedWeight


def pack_item(it: Item, fmt: ExportFormat) -> PackedWeight:
    """The packed tensors of one planned checkpoint module."""
    p = get_packer(fmt)
    tensors: dict[str, torch.Tensor] = {}
    if it.spec is not None:
        w = it.weight()
        tensors.update(p.pack(real_quantize(w, it.spec, it.amax, backend="auto")))
        if it.input_spec is not None:
            tensors.update(p.pack_input(it.input_spec, it.input_amax))
    for k, get in it.extras.items():
        tensors[k] = get()
    return PackedWeight(it.name, tensors, it.role, it.expert, it.shard)


def iter_plan(plan: Plan, fmt: ExportFormat) -> Iterator[PackedWeight]:
    with torch.no_grad():
        for it in plan.items:
            yield pack_item(it, fmt)


def iter_packed(
    model: nn.Module,
    format: Union[ExportFormat, str],
    *,
    layout: Optional[ModelLayout] = None,
    experts: Literal["per_expert"] = "per_expert",
    chunk_bytes: Optional[int] = None,
    unify_siblings: bool = False,
    tp: int = 1,
) -> Iterator[Union[PackedWeight, list[PackedWeight]]]:
    """Yield each checkpoint module's packed tensors, module by module, on the model's device.

    Everything is checked first (:class:`ExportError`). With ``chunk_bytes``, yields lists of
    PackedWeights of at most that many bytes each (a single larger weight makes a list of one).
    """
    fmt = as_format(format)
    if experts != "per_expert":
        raise ValueError(f"experts={experts!r}: only 'per_expert' is available (2-D tensors per expert)")
    plan = make_plan(model, get_packer(fmt), layout or layout_for(model), unify_siblings=unify_siblings, tp=tp)
    stream = iter_plan(plan, fmt)
    if chunk_bytes is None:
        yield from stream
        return
    chunk: list[PackedWeight] = []
    size = 0
    for pw in stream:
        if chunk and size + pw.nbytes > chunk_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(pw)
        size += pw.nbytes
    if chunk:
        yield chunk
