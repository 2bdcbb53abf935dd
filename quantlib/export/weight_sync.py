"""RL weight sync: a per-tensor hook over the export packers (the ``serialize_weight`` of SkyRL-style
quantization strategies) and byte-budget chunking of any stream of packed tensors."""

from __future__ import annotations

from typing import Iterable, Iterator, Union

import torch
from torch import nn

from ..nn.containers import GroupedQuantizer
from ..nn.tensor_quantizer import TensorQuantizer
from .formats import as_format, packer as get_packer
from .iterate import chunked, pack_item
from .plan import Item, _check_item, refuse_pre_quant_scale
from .types import ExportError, ExportFormat


def serialize_weight(name: str, tensor: torch.Tensor, quantizer: nn.Module, format: Union[ExportFormat, str], *, batched_experts: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` pairs of one weight packed in ``format`` with ``quantizer``'s amax, e.g.
    ``layers.0.q_proj.weight`` -> ``layers.0.q_proj.weight`` (codes) and ``...weight_scale_inv``.

    ``batched_experts``: ``tensor`` is [E, out, in] and ``quantizer`` a GroupedQuantizer of E members;
    each expert is packed with its own member and the results are stacked on dim 0 (vLLM's 3-D load).
    """
    fmt = as_format(format)
    prefix = name[: -len(".weight")] if name.endswith(".weight") else name
    if batched_experts:
        if not isinstance(quantizer, GroupedQuantizer) or tensor.dim() != 3 or len(quantizer) != tensor.shape[0]:
            raise ExportError(f"{name}: batched_experts needs a [E, out, in] tensor and a GroupedQuantizer of E members, got {tuple(tensor.shape)} and {type(quantizer).__name__}")
        packed = [_pack_one(prefix, tensor[e], quantizer[e], fmt, f"{prefix}.weight_quantizer[{e}]") for e in range(tensor.shape[0])]
        for k in packed[0]:
            yield f"{prefix}.{k}", torch.stack([p[k] for p in packed])
        return
    for k, t in _pack_one(prefix, tensor, quantizer, fmt, f"{prefix}.weight_quantizer").items():
        yield f"{prefix}.{k}", t


def _pack_one(prefix: str, w: torch.Tensor, q: nn.Module, fmt: ExportFormat, where: str) -> dict[str, torch.Tensor]:
    if not isinstance(q, TensorQuantizer) or not q.is_enabled:
        raise ExportError(f"{where}: {type(q).__name__} {'disabled' if isinstance(q, TensorQuantizer) else ''}: serialize_weight packs enabled TensorQuantizers")
    refuse_pre_quant_scale([(where, q)])
    item = Item(prefix, "linear", where, lambda: w.detach(), q.spec, q.amax, shape=tuple(w.shape))
    _check_item(item, get_packer(fmt), 1)
    with torch.no_grad():
        return pack_item(item, fmt).tensors


def chunk_by_bytes(pairs: Iterable[tuple[str, torch.Tensor]], chunk_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(key, tensor)`` pairs into lists of at most ``chunk_bytes`` bytes (a larger tensor alone)."""
    return chunked(pairs, lambda kv: kv[1].numel() * kv[1].element_size(), chunk_bytes)
