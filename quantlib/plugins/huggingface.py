"""Quantized HF transformers fused MoE experts (3-D parameters, one slice per expert).

Modules such as Qwen3-MoE's ``Qwen3MoeExperts`` keep every expert in two parameters:
``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) (``up_proj`` instead of ``gate_up_proj`` for
ungated experts; the slices transposed where the class says ``is_transposed``). The quantized module has,
per projection, a :class:`~quantlib.nn.GroupedQuantizer` of E weight quantizers (member e quantizes
slice e, seen as an (out, in) matrix like an ``nn.Linear`` weight, and is calibrated from slice e
alone) and one input quantizer shared by the experts (one activation scale per layer, as the fused
kernels of inference engines take it). ``tokens_per_expert`` counts the tokens routed to each expert
during the last calibration; :func:`tokens_per_expert_report` collects them.

Registration is cheap and explicit: :data:`FUSED_EXPERTS` lists the classes with this layout; they
are registered when their modeling module is already imported (importing transformers' modeling code
costs seconds, so this plugin never does it for models that do not use it). Call :func:`refresh`
after importing a model class later, or :func:`register_fused_experts` for another class.
"""

from __future__ import annotations

import logging
import sys
from typing import ClassVar, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..config import QuantizerAttributeConfig
from ..model_quant import tokens_per_expert_report  # noqa: F401  (re-exported)
from ..nn.containers import GroupedQuantizer
from ..nn.quant_module import QuantModule, QuantModuleRegistry
from ..nn.tensor_quantizer import TensorQuantizer
from .te_adapters import record_tokens

_log = logging.getLogger("quantlib")

#: (modeling module, class) of fused-experts classes with gate_up_proj (E, 2I, H) and down_proj (E, H, I).
FUSED_EXPERTS: tuple[tuple[str, str], ...] = (
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeExperts"),
    ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeExperts"),
    ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextExperts"),
    ("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeTextExperts"),
    ("transformers.models.mixtral.modeling_mixtral", "MixtralExperts"),
    ("transformers.models.olmoe.modeling_olmoe", "OlmoeExperts"),
    ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3Experts"),
    ("transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeExperts"),
)


def _projections(module: nn.Module) -> tuple[str, str]:
    return ("gate_up_proj" if hasattr(module, "gate_up_proj") else "up_proj", "down_proj")


def expert_weight(module: nn.Module, proj: str, e: int) -> torch.Tensor:
    """Expert ``e``'s slice of projection ``proj`` of a fused-experts module, as an (out, in) matrix (a view)."""
    w = getattr(module, proj)[e]
    return w.transpose(0, 1) if getattr(module, "is_transposed", False) else w


class QuantFusedExperts(QuantModule):
    """Mixin for a fused-experts module; subclasses set ``projections`` (first: the up or gate-up
    projection, second: the down projection) and the quantizer names that follow from them."""

    projections: ClassVar[tuple[str, str]] = ("gate_up_proj", "down_proj")
    quantizer_names: ClassVar[tuple[str, ...]] = ("gate_up_proj_input_quantizer", "gate_up_proj_weight_quantizer", "down_proj_input_quantizer", "down_proj_weight_quantizer")
    weight_quantizer_names: ClassVar[tuple[str, ...]] = ("gate_up_proj_weight_quantizer", "down_proj_weight_quantizer")
    grouped_quantizer_names: ClassVar[tuple[str, ...]] = weight_quantizer_names
    is_expert = True

    def _setup(self) -> None:
        if _projections(self) != self.projections or getattr(self, "has_gate", True) != (self.projections[0] == "gate_up_proj"):
            raise ValueError(f"{type(self).__name__}: has_gate={getattr(self, 'has_gate', True)} does not match its quantized projections {self.projections}")
        for proj in self.projections:
            num = getattr(self, proj).shape[0]
            setattr(self, f"{proj}_input_quantizer", TensorQuantizer(QuantizerAttributeConfig()))
            setattr(self, f"{proj}_weight_quantizer", GroupedQuantizer([TensorQuantizer(QuantizerAttributeConfig(axis=0)) for _ in range(num)]))
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.int64), persistent=False)
        self._was_calibrating = False

    def weight_groups(self) -> Iterator[tuple[str, list[torch.Tensor]]]:
        # Also called unbound on the original (unconverted) module by checkpoint validation: module
        # attributes only.
        for proj in _projections(self):
            yield f"{proj}_weight_quantizer", [expert_weight(self, proj, e) for e in range(getattr(self, proj).shape[0])]

    def _expert_view(self, proj: str, e: int) -> torch.Tensor:
        """:func:`expert_weight`, the same view object from call to call (the fake-quantized weight cache
        of :meth:`quantize_weight` keys on it) unless autograd has to see the slicing (QAT)."""
        param = getattr(self, proj)
        if torch.is_grad_enabled() and param.requires_grad:
            return expert_weight(self, proj, e)
        views = self.__dict__.setdefault("_expert_views", {})
        hit = views.get((proj, e))
        if hit is None or hit[0] is not param or hit[1] != param.data_ptr():
            with torch.no_grad():
                hit = (param, param.data_ptr(), expert_weight(self, proj, e))
            views[(proj, e)] = hit
        return hit[2]

    def _linear(self, proj: str, e: int, x: torch.Tensor) -> torch.Tensor:
        w = self.quantize_weight(self._expert_view(proj, e), f"{proj}_weight_quantizer", e)
        bias = getattr(self, f"{proj}_bias")[e] if getattr(self, "has_bias", False) else None
        return F.linear(x, w, bias)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        up, down = self.projections
        num_experts = self.num_experts
        with torch.no_grad():
            # (E + 1, k, tokens): the extra row takes expert-parallel sentinels (index == num_experts)
            expert_mask = F.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
            counts = expert_mask[:num_experts].sum(dim=(-1, -2))
        record_tokens(self, counts, getattr(self, f"{up}_input_quantizer"))
        x = getattr(self, f"{up}_input_quantizer")(hidden_states)
        out = torch.zeros_like(hidden_states)
        for e in torch.nonzero(counts > 0).flatten().tolist():
            top_k_pos, token_idx = torch.where(expert_mask[e])
            h = self._linear(up, e, x[token_idx])
            h = self._apply_gate(h) if getattr(self, "has_gate", True) else self.act_fn(h)
            h = self._linear(down, e, getattr(self, f"{down}_input_quantizer")(h))
            if getattr(self, "has_post_expert_norm", False):
                h = self.post_expert_norm(h)
            h = h * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out


def _default_apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up over the concatenated [gate; up] output (for classes without their own gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate) * up


def _mixin_for(cls: type, projections: tuple[str, str]) -> type:
    up, down = projections
    attrs: dict = {
        "projections": projections,
        "quantizer_names": (f"{up}_input_quantizer", f"{up}_weight_quantizer", f"{down}_input_quantizer", f"{down}_weight_quantizer"),
        "weight_quantizer_names": (f"{up}_weight_quantizer", f"{down}_weight_quantizer"),
        "grouped_quantizer_names": (f"{up}_weight_quantizer", f"{down}_weight_quantizer"),
    }
    if not hasattr(cls, "_apply_gate"):
        attrs["_apply_gate"] = _default_apply_gate
    return type(f"_QuantFused{cls.__name__}", (QuantFusedExperts,), attrs)


def register_fused_experts(cls: type, gated: bool = True) -> None:
    """Quantize modules of ``cls`` (a fused-experts class: ``forward(hidden_states, top_k_index,
    top_k_weights)``, ``gate_up_proj`` — or ``up_proj`` if not ``gated`` — and ``down_proj`` with one
    slice per expert along dim 0)."""
    if QuantModuleRegistry.is_registered(cls):
        return
    projections = ("gate_up_proj", "down_proj") if gated else ("up_proj", "down_proj")
    QuantModuleRegistry.register(cls, cls.__name__)(_mixin_for(cls, projections))


def refresh() -> list[str]:
    """Register the :data:`FUSED_EXPERTS` classes, if transformers' modeling code is loaded (else
    nothing: no model here uses them). Cheap, so ``convert`` calls it every time; returns the class names
    registered."""
    done = []
    for module_name, class_name in FUSED_EXPERTS:
        module = sys.modules.get(module_name)  # a model built from it has imported it: never import here
        if module is None:
            continue
        cls = getattr(module, class_name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            register_fused_experts(cls)
            done.append(class_name)
    return done


refresh()

__all__ = ["FUSED_EXPERTS", "QuantFusedExperts", "expert_weight", "refresh", "register_fused_experts", "tokens_per_expert_report"]

