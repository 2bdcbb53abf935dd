"""Export of AWQ / SmoothQuant on fused MoE experts: each expert's own ``pre_quant_scale`` (row ``e`` of the
projection's 2-D input scale, the inverse in weight member ``e``), planned per expert part as checkpoints
hold them (``<experts>.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, quantlib's module-space names).

- ModelOpt's AWQ formats carry every part's scale as its ``pre_quant_scale`` (gate and up of one expert read
  one input: one row, written twice). ModelOpt's own exporter first averages the experts' scales into one per
  layer (its "resmooth", which changes the weights); TensorRT-LLM's MoE loaders read the per-expert tensors,
  so each expert keeps its own and the export computes what the calibrated model computes.
- Elsewhere down_proj's row folds into the same expert's up rows (``act(gate) * up`` is linear in up) where
  they can take it exactly; gate/up's rows differ per expert and the post-attention norm feeds the router and
  every expert: no op takes them, so they are refused by name.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn

from ..formats import Kind
from ..nn.containers import QuantizerContainer, SequentialQuantizer
from ..nn.tensor_quantizer import TensorQuantizer
from .items import pre_quant_scale_of
from .types import ExportError

#: the formats that carry a pre_quant_scale per expert part
CARRYING = "modelopt_int4_awq, modelopt_nvfp4 (NVFP4_AWQ), modelopt_w4a8_awq"


def fused_experts_class() -> type:
    """quantlib's quantized fused-experts class (the HF plugin owns it and imports no transformers code)."""
    from ..plugins.hf_experts import QuantFusedExperts

    return QuantFusedExperts


def part_name(module: str, proj: str, e: int, r0: int) -> str:
    """quantlib's name of expert ``e``'s part of projection ``proj`` whose rows start at ``r0`` (gate rows first)."""
    if proj == "gate_up_proj":
        return f"{module}.{e}.{'gate_proj' if r0 == 0 else 'up_proj'}"
    return f"{module}.{e}.{proj}"


def _parts(module: str, proj: str, e: int) -> list[str]:
    return [part_name(module, proj, e, r0) for r0 in ((0, 1) if proj == "gate_up_proj" else (0,))]


def plan_experts(name: str, module: nn.Module, carries: bool, fmt: str) -> tuple[dict, dict, dict]:
    """(weight, out, carried) scales by part name of fused-experts module ``name`` (the meaning of
    :class:`~quantlib.export.fold.Folds`' dicts); raises ExportError naming what neither can express."""
    from ..plugins.hf_experts import _default_apply_gate, expert_weight, flag

    weight: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    carried: dict[str, torch.Tensor] = {}
    if module.quantizers_off():
        return weight, out, carried  # the original forward: no scale applies
    up, down = module.projections
    num = module.num_experts
    for proj in (up, down):
        group = module._modules[f"{proj}_weight_quantizer"]
        for e in range(num):
            member = group[e]
            first = member[0] if isinstance(member, SequentialQuantizer) else member
            for leaf in list(member.leaves()) if isinstance(member, QuantizerContainer) else [member]:
                p = pre_quant_scale_of(leaf)
                if p is not None and leaf is not first:
                    raise ExportError(f"{name}.{proj}_weight_quantizer[{e}]: a pre_quant_scale of shape {tuple(p.shape)} on a chain's "
                                      "second member, which no format carries")
            p = pre_quant_scale_of(first)
            if p is not None and member.is_enabled:  # a disabled member returns the weight untouched
                for part in _parts(name, proj, e):
                    weight[part] = p
        iq = module._modules[f"{proj}_input_quantizer"]
        p = pre_quant_scale_of(iq)
        if p is None:
            continue
        where = f"{name}.{proj}_input_quantizer"
        cols = expert_weight(module, proj, 0).shape[1]
        if p.shape[-1] != cols or (p.dim() == 2 and p.shape[0] != num) or p.dim() > 2:
            raise ExportError(f"{where}: pre_quant_scale of shape {tuple(p.shape)} on a {type(module).__name__} fits neither ({cols},) nor "
                              f"({num}, {cols})")
        rows = p.expand(num, cols) if p.dim() == 1 else p
        if carries:
            off = [e for e in range(num) if not group[e].is_enabled]
            if off:  # an unquantized expert's extra tensor would be ignored
                raise ExportError(f"{where}: pre_quant_scale of shape {tuple(p.shape)} is set and expert {off[0]} of {proj} is left "
                                  f"unquantized, where format {fmt} carries a pre_quant_scale on quantized modules only")
            for e in range(num):
                for part in _parts(name, proj, e):
                    carried[part] = rows[e].detach().clone()
            continue
        why = "the norm before it feeds the router and every expert, each expert with its own scale"
        if proj == down:
            gated = flag(module, "has_gate") and _gates_linearly(module, _default_apply_gate)
            why = (_up_rows_why(name, module, up, expert_weight(module, up, 0).shape[0]) if gated
                   else f"{type(module).__name__}'s activation is not act(gate) * up")
            if why is None:
                for e in range(num):
                    out[part_name(name, up, e, 1)] = rows[e].detach().clone()  # up: the second half of gate_up
                continue
        raise ExportError(f"{where}: pre_quant_scale of shape {tuple(p.shape)} (one row per expert, SmoothQuant / AWQ) on a "
                          f"{type(module).__name__} folds nowhere ({why}); format {fmt} has no pre_quant_scale tensor: export to a "
                          f"ModelOpt AWQ format ({CARRYING}), which carry one per expert, or calibrate the experts with 'max'")
    return weight, out, carried


def _gates_linearly(module: nn.Module, mine: object) -> bool:
    """Whether the experts compute ``act(gate) * up`` (quantlib's default gate or transformers' own), not a clamped or
    interleaved gate (GPT-OSS), so that a scale on up's rows comes out on the product."""
    gate = getattr(type(module), "_apply_gate", None)
    moe = sys.modules.get("transformers.integrations.moe")  # loaded wherever a transformers MoE class was built
    return gate is mine or (moe is not None and gate is getattr(moe, "_default_apply_gate", None))


def _up_rows_why(name: str, module: nn.Module, up: str, rows: int) -> Optional[str]:
    """Why the up rows of some expert's ``rows``-row gate_up slice cannot take a scale exactly (None: every expert's can):
    an enabled weight member must be INT with one scale per output row (per channel, or groups along the input)."""
    group = module._modules[f"{up}_weight_quantizer"]
    for e in range(module.num_experts):
        q = group[e]
        if not q.is_enabled:
            continue  # unquantized rows take the scale as they are
        if not isinstance(q, TensorQuantizer):
            return f"{name}.{up}_weight_quantizer[{e}] is a chain"
        spec, amax = q.spec, q.amax
        per_row = (spec.kind == Kind.INT and (spec.block is None or len(spec.block) == 1) and amax is not None and amax.numel() > 1
                   and amax.shape[0] == rows)
        if not per_row:
            return f"{name}.{up}_weight_quantizer[{e}] ({spec.kind.value}) has no scale per output row to take the scale"
    return None
