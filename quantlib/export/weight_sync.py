"""RL weight sync: a per-tensor hook over the export packers (the ``serialize_weight`` of SkyRL-style
quantization strategies), the whole model as named pairs (:func:`sync_pairs`), and the sender's
chunks of one dtype.

Weight scales come from the weight being sent by default (``scales="dynamic"``): after optimizer steps
the calibrated amax no longer bounds the weight. Activation scales come from the calibrated input
quantizers (W8A8 FP8, W4A4 NVFP4) and travel with the weights.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Union

import torch
from torch import nn

from ..nn.containers import GroupedQuantizer, QuantizerContainer
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import TensorQuantizer
from .buckets import chunks_by_dtype
from .expert_stacks import input_stacks, one_cast
from .items import Item, active_input, refuse_pre_quant_scale
from .iterate import pack_item, packed_stream
from .layouts import ModelLayout
from .plan import _check_item, read_amax
from .quantize import real_quantize
from .sync_scales import Scales, as_scales, dynamic_items, refuse_clipped
from .types import ExportError, ExportFormat
from .vllm_names import ExpertNames, named_pairs
from .writers import as_format, packer as get_packer


def _quantizers(module: nn.Module, prefix: str, input_quantizer: Optional[nn.Module]) -> tuple[nn.Module, Optional[nn.Module], str]:
    """(weight quantizer, input quantizer, the weight quantizer's name) of what the caller passed: a
    quantizer (with ``input_quantizer``), a quantized linear, or a fused-experts module (the projection
    is the last part of the weight's name, e.g. ``...experts.gate_up_proj``)."""
    if isinstance(module, (TensorQuantizer, QuantizerContainer)):
        return module, input_quantizer, f"{prefix}.weight_quantizer"
    if not isinstance(module, QuantModule):
        raise ExportError(f"{prefix}: serialize_weight takes a quantized module or its weight quantizer, got {type(module).__name__}")
    owner, proj = prefix, ""
    if "weight_quantizer" not in module._modules:  # fused experts: the parameter's name ends in the projection
        owner, _, proj = prefix.rpartition(".")
        proj += "_"
    wname, iname = f"{proj}weight_quantizer", f"{proj}input_quantizer"
    if wname not in module._modules:
        raise ExportError(f"{prefix}: {type(module).__name__} has no {wname} (its quantizers: {list(module.quantizer_names)})")
    inp = input_quantizer if input_quantizer is not None else module._modules.get(iname)
    return module._modules[wname], inp, f"{owner}.{wname}"


def serialize_weight(
    name: str,
    tensor: torch.Tensor,
    module: nn.Module,
    format: Union[ExportFormat, str],
    *,
    input_quantizer: Optional[nn.Module] = None,
    batched_experts: bool = False,
    scales: Union[Scales, str] = Scales.DYNAMIC,
    global_amax: Optional[torch.Tensor] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` pairs of one weight packed in ``format``, e.g. ``layers.0.q_proj.weight`` ->
    ``layers.0.q_proj.weight`` (codes), ``...weight_scale_inv`` and, with a static input quantizer,
    its activation scale.

    ``module``: the quantized module (its weight and input quantizers are used) or its weight quantizer
    (then ``input_quantizer`` for W8A8 / W4A4 formats). ``scales``: "dynamic" (from ``tensor``),
    "static" (the calibrated amax, refusing a tensor that exceeds it) or "calibrated" (unchecked).
    ``global_amax``: dynamic per-tensor formats (NVFP4 global, FP8 per tensor) take it instead of
    ``tensor``'s own amax: the max over the siblings a consumer fuses (q/k/v); one value, or one per
    expert. ``batched_experts``: ``tensor`` is [E, out, in] and the weight quantizer a GroupedQuantizer
    of E members; each expert is packed with its own member and the results are stacked on dim 0
    (vLLM's 3-D load). Nothing is read back to the host in the dynamic mode; one batched read otherwise.
    """
    fmt, source = as_format(format), as_scales(scales)
    prefix = name[: -len(".weight")] if name.endswith(".weight") else name
    wq, iq, where = _quantizers(module, prefix, input_quantizer)
    input_where = where[: -len("weight_quantizer")] + "input_quantizer"
    refuse_pre_quant_scale([(input_where, iq)])  # a smoothing scale on the input changes what the weight must be
    ispec, iamax = active_input(iq)
    if batched_experts:
        if not isinstance(wq, GroupedQuantizer) or tensor.dim() != 3 or len(wq) != tensor.shape[0]:
            raise ExportError(
                f"{name}: batched_experts needs a [E, out, in] tensor and a GroupedQuantizer of E members, "
                f"got {tuple(tensor.shape)} and {type(wq).__name__}"
            )
        pairs = [(f"{where}[{e}]", tensor[e], wq[e]) for e in range(tensor.shape[0])]
    else:
        pairs = [(where, tensor, wq)]
    items = [_item(prefix, w, q, at, ispec, iamax, input_where) for at, w, q in pairs]
    p = get_packer(fmt)
    # the finiteness of the stored amax matters where it makes the scales: one read for all experts
    finite = True if source is Scales.DYNAMIC else read_amax(items)[0]
    for it in items:
        _check_item(it, p, 1, finite_known=finite)
    if source is Scales.DYNAMIC:
        items = dynamic_items(items, None if global_amax is None else _given(global_amax, items, name))
    elif source is Scales.STATIC:
        refuse_clipped(items)
    with torch.no_grad():
        if batched_experts and one_cast(items, p):  # every expert in one kernel call: the stack of the per-expert tensors
            q = real_quantize(tensor.detach(), items[0].spec, None if items[0].amax is None else torch.stack([it.amax for it in items]))
            tensors = {**p.pack(q), **input_stacks(p, ispec, iamax, len(items))}
            for k, t in tensors.items():
                yield f"{prefix}.{k}", t
            return
        packed = [pack_item(it, p).tensors for it in items]
    if batched_experts:
        for k in packed[0]:
            yield f"{prefix}.{k}", torch.stack([t[k] for t in packed])
        return
    for k, t in packed[0].items():
        yield f"{prefix}.{k}", t


def _given(global_amax: torch.Tensor, items: list[Item], name: str) -> dict[int, torch.Tensor]:
    if not isinstance(global_amax, torch.Tensor):
        raise ExportError(f"{name}: global_amax={global_amax!r} ({type(global_amax).__name__}): expected a tensor of one amax, or one per "
                          "expert")
    flat = global_amax.detach().float().reshape(-1)
    if flat.numel() not in (1, len(items)):
        raise ExportError(f"{name}: global_amax has {flat.numel()} values; expected one, or one per expert ({len(items)})")
    return {id(it): flat[i if flat.numel() > 1 else 0] for i, it in enumerate(items)}


def _item(prefix: str, w: torch.Tensor, q: nn.Module, where: str, ispec, iamax, input_where: str) -> Item:
    if not isinstance(q, TensorQuantizer) or not q.is_enabled:
        state = "disabled" if isinstance(q, TensorQuantizer) else ""
        raise ExportError(f"{where}: {type(q).__name__} {state}: serialize_weight packs enabled TensorQuantizers")
    refuse_pre_quant_scale([(where, q)])
    block_amax = q.block_amax if q.spec.two_level else None
    return Item(prefix, "linear", where, lambda: w.detach(), q.spec, q.amax, ispec, iamax, shape=tuple(w.shape), input_where=input_where,
                block_amax=block_amax)


def sync_pairs(
    model: nn.Module,
    format: Union[ExportFormat, str],
    *,
    scales: Union[Scales, str] = Scales.DYNAMIC,
    experts: str = "stacked",
    expert_names: Union[ExpertNames, str] = ExpertNames.FLAT,
    layout: Optional[ModelLayout] = None,
    tp: int = 1,
    tp_rank: Optional[int] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``model`` to send to an inference engine, as ``(key, tensor)`` on the model's
    device: :func:`~quantlib.export.iter_packed` with dynamic weight scales by default, stacked experts
    in vLLM's fused-MoE parameters named in ``expert_names`` style ("flat" or "nested", see
    :mod:`quantlib.export.vllm_names`; check them with :func:`check_receiver`). The checked plan is kept between calls
    while the quantizers and the module tree are unchanged (:mod:`~quantlib.export.plan_cache`): a step's sync packs."""
    # the w1 / w3 shards of a stacked projection come as views of one cast, which named_pairs joins into w13 without a copy
    stream = packed_stream(model, format, layout=layout, experts=experts, tp=tp, tp_rank=tp_rank, scales=scales, joined=True)
    yield from named_pairs(stream, expert_names)


def chunk_by_bytes(pairs: Iterable[tuple[str, torch.Tensor]], chunk_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(key, tensor)`` pairs into lists of ONE dtype (and device) of at most ``chunk_bytes``
    bytes (a larger tensor alone): what a CUDA-IPC or broadcast sender puts in one typed buffer (see
    :func:`~quantlib.export.buckets.bucket_by_dtype` for the buffers themselves)."""
    return chunks_by_dtype(pairs, chunk_bytes)
