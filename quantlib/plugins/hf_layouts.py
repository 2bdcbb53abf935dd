"""Quantized HF transformers modules whose layout is their own: GPT-2's ``Conv1D`` (a linear with its
weight stored (in, out)) and Llama-4's ``Llama4TextExperts`` (experts stored (E, in, out), computed by
``bmm`` over inputs already laid out per expert).

Both present each weight to its quantizer as an (out, in) matrix, like an ``nn.Linear`` weight, so a
config's ``axis: 0`` is the output channel and blocks run along the input dim, then compute with the
original's own operation on the transposed back result (bit for bit the original forward on
fake-quantized weights).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import nn

from ..config import QuantizerAttributeConfig
from ..nn.containers import GroupedQuantizer
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import TensorQuantizer


def _cached_transpose(module: nn.Module, name: str, index: Optional[int] = None) -> torch.Tensor:
    """``param.t()`` (or ``param[index].t()``) of parameter ``name``, the same view object from call to
    call (the weight cache keys on it) unless autograd has to see it (QAT)."""
    param = getattr(module, name)
    key = (name, index)
    if torch.is_grad_enabled() and param.requires_grad:
        return (param if index is None else param[index]).transpose(0, 1)
    views = module.__dict__.setdefault("_expert_views", {})
    hit = views.get(key)
    if hit is None or hit[0] is not param or hit[1] != param.data_ptr():
        with torch.no_grad():
            hit = (param, param.data_ptr(), (param if index is None else param[index]).transpose(0, 1))
        views[key] = hit
    return hit[2]


class QuantConv1D(QuantModule):
    """Mixin for ``transformers.pytorch_utils.Conv1D``: ``y = x @ W + b`` with ``W`` (in, out)."""

    def weight_groups(self) -> Iterator[tuple[str, list[torch.Tensor]]]:
        yield "weight_quantizer", [self.weight.transpose(0, 1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantizers_off():
            return self._original_class.forward(self, x)
        w = self.quantize_weight(_cached_transpose(self, "weight"))
        size_out = x.size()[:-1] + (self.nf,)
        x = self.input_quantizer(x)
        out = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), w.transpose(0, 1)).view(size_out)
        return self.output_quantizer(out)


class QuantLlama4TextExperts(QuantModule):
    """Mixin for Llama-4's experts: ``gate_up_proj`` (E, H, 2I) and ``down_proj`` (E, I, H), inputs
    (E * tokens, H) already routed (every expert sees every token, scaled by its router score)."""

    quantizer_names = ("gate_up_proj_input_quantizer", "gate_up_proj_weight_quantizer", "down_proj_input_quantizer",
                       "down_proj_weight_quantizer")
    weight_quantizer_names = ("gate_up_proj_weight_quantizer", "down_proj_weight_quantizer")
    grouped_quantizer_names = weight_quantizer_names
    is_expert = True

    def _setup(self) -> None:
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(self, proj)
            if param.dim() != 3 or param.shape[0] != self.num_experts:
                raise ValueError(f"{type(self).__name__}.{proj}: expected (num_experts={self.num_experts}, in, out), got "
                                 f"{tuple(param.shape)}")
            setattr(self, f"{proj}_input_quantizer", TensorQuantizer(QuantizerAttributeConfig()))
            setattr(self, f"{proj}_weight_quantizer", GroupedQuantizer([TensorQuantizer(QuantizerAttributeConfig(axis=0))
                                                                        for _ in range(param.shape[0])]))

    def weight_groups(self) -> Iterator[tuple[str, list[torch.Tensor]]]:
        # also called unbound on the unconverted module (checkpoint validation): module attributes only
        for proj in ("gate_up_proj", "down_proj"):
            param = getattr(self, proj)
            yield f"{proj}_weight_quantizer", [param[e].transpose(0, 1) for e in range(param.shape[0])]

    def _stacked(self, proj: str) -> torch.Tensor:
        """The (E, in, out) parameter with each expert's slice fake-quantized by its own member."""
        param = getattr(self, proj)
        name = f"{proj}_weight_quantizer"
        return torch.stack([self.quantize_weight(_cached_transpose(self, proj, e), name, e).transpose(0, 1) for e in range(param.shape[0])])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.quantizers_off():
            return self._original_class.forward(self, hidden_states)
        hidden_states = self.gate_up_proj_input_quantizer(hidden_states.view(self.gate_up_proj.shape[0], -1, self.hidden_size))
        gate_up = torch.bmm(hidden_states, self._stacked("gate_up_proj"))
        gate, up = gate_up.chunk(2, dim=-1)
        h = self.down_proj_input_quantizer(up * self.act_fn(gate))
        return torch.bmm(h, self._stacked("down_proj")).view(-1, self.hidden_size)


__all__ = ["QuantConv1D", "QuantLlama4TextExperts"]
