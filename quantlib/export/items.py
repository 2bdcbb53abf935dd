"""One checkpoint module of an export plan (:class:`Item`) and the reads of a quantized module's quantizers that
every planner (transformers models, Megatron models, one weight's serialization) shares (docs/design.md §8)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from ..formats import FormatSpec, QuantizedTensor
from ..nn.containers import QuantizerContainer
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import TensorQuantizer
from .layouts import Shard
from .types import ExportError


@dataclass
class Item:
    """One checkpoint module: a quantized weight (``spec`` set) or tensors passed through."""

    name: str
    role: str
    where: str  # the quantizer, for messages: "model.layers.0.mlp.experts.gate_up_proj_weight_quantizer[3]"
    weight: Optional[Callable[[], torch.Tensor]] = None
    spec: Optional[FormatSpec] = None
    amax: Optional[torch.Tensor] = None
    input_spec: Optional[FormatSpec] = None
    input_amax: Optional[torch.Tensor] = None
    extras: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    expert: Optional[int] = None
    shard: Shard = None
    parent: str = ""
    leaf: str = ""
    tp_axis: Optional[int] = None
    shape: tuple[int, ...] = ()
    rows: Optional[tuple[int, int, int]] = None  # (r0, r1, rows) of a split fused-expert weight
    group: Optional[tuple[str, ...]] = None  # sibling group sharing a global amax in this format
    fused: str = ""  # checkpoint name of the fused-experts module an expert item comes from
    input_where: str = ""  # the input quantizer, for messages
    block_amax: Optional[torch.Tensor] = None  # NVFP4 static blocks: the stored block amax (amax: the global one)
    pre: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # applied to the weight before packing (pre_quant_scale, 3-D as 2-D)
    post: Optional[Callable[[QuantizedTensor], QuantizedTensor]] = None  # applied to the packed weight (a fold; 3-D experts' shape)
    chain: Optional[tuple[FormatSpec, Optional[torch.Tensor]]] = None  # a chained weight quantizer's second member (spec, amax): W4A8's FP8
    part: str = ""  # an expert item's quantlib name, "<experts>.{e}.gate_proj" (fold_experts.part_name): its folds' key
    transposed: bool = False  # the checkpoint stores the weight (in, out) (GPT-2's Conv1D): packed as (out, in), ``weight`` swapped
    # a stacked projection of ``experts`` experts (:mod:`~quantlib.export.expert_stacks`): its vLLM shards (leaf, shard id, r0, r1)
    parts: tuple[tuple[str, Shard, int, int], ...] = ()
    experts: int = 0
    members: tuple[str, ...] = ()  # the quantized modules whose weights the checkpoint saves as this key's rows (:mod:`.built_rows`)


def live(module: nn.Module, key: str) -> Callable[[], torch.Tensor]:
    """The module's tensor ``key`` as it is when called, not when planned: a layer read back from an offload
    folder gets new parameter objects (:mod:`~quantlib.export.offload`)."""
    return lambda: (module._parameters[key] if key in module._parameters else module._buffers[key]).detach()


def active_input(q: Optional[nn.Module]) -> tuple[Optional[FormatSpec], Optional[torch.Tensor]]:
    if not (type(q) is TensorQuantizer or isinstance(q, TensorQuantizer)) or not q.is_enabled:
        return None, None
    return q.spec, q.amax


_PQS = "_pre_quant_scale"  # TensorQuantizer's buffer behind pre_quant_scale


def has_pqs_slot(leaf: TensorQuantizer) -> bool:
    # an unset pre_quant_scale is in neither dict: this skips the attribute lookup, whose miss raises
    # inside nn.Module
    return _PQS in leaf._buffers or _PQS in leaf.__dict__


def pre_quant_scale_of(q: Optional[nn.Module]) -> Optional[torch.Tensor]:
    """The ``pre_quant_scale`` (SmoothQuant / AWQ) that ``q`` holds; None for anything but a quantizer holding one."""
    return q.pre_quant_scale if isinstance(q, TensorQuantizer) and has_pqs_slot(q) else None


def refuse_pre_quant_scale(quantizers: list[tuple[str, Optional[nn.Module]]]) -> None:
    """Raise ExportError naming the first of ``quantizers`` ((name, quantizer or container)) that holds a
    ``pre_quant_scale`` (SmoothQuant / AWQ), for the paths that see no model graph to fold it into (one
    weight's serialization, Megatron's export): packed without it, the weights would not compute what the
    calibrated model computes."""
    for name, q in quantizers:
        for leaf in [q] if isinstance(q, TensorQuantizer) else list(q.leaves()) if isinstance(q, QuantizerContainer) else []:
            if pre_quant_scale_of(leaf) is not None:
                raise ExportError(
                    f"{name}: pre_quant_scale is set (SmoothQuant / AWQ calibration), which this path cannot fold into the op before it "
                    "(it sees no model graph); export the whole transformers model (export_checkpoint / iter_packed), or calibrate with "
                    "'max' or 'mse'"
                )


def child(module: nn.Module, name: str) -> Optional[nn.Module]:
    # quantizers are submodules: nn.Module.__getattr__ finds them only after missing three dicts
    sub = module._modules
    return sub[name] if name in sub else getattr(module, name, None)


def module_quantizers(module: QuantModule, name: str) -> list[tuple[str, Optional[nn.Module]]]:
    """(full name, quantizer) of every quantizer of the quantized module ``name``."""
    return [(f"{name}.{qn}", child(module, qn)) for qn in module.quantizer_names]


def row_part(amax: Optional[torch.Tensor], spec: FormatSpec, rows: int, r0: int, r1: int) -> Optional[torch.Tensor]:
    """The amax of rows ``r0:r1`` of a weight of ``rows`` rows."""
    if amax is None or amax.dim() == 0 or amax.shape[0] == 1:
        return amax
    if spec.block is not None and len(spec.block) == 2:
        return amax[r0 // spec.block[0] : -(-r1 // spec.block[0])]
    return amax[r0:r1] if amax.shape[0] == rows else amax
