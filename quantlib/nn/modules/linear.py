"""Quantized nn.Linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..quant_module import QuantModule, QuantModuleRegistry


@QuantModuleRegistry.register(nn.Linear, "nn.Linear")
class _QuantLinear(QuantModule):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.quantizers_off():
            return F.linear(input, self.weight, self.bias)
        out = F.linear(self.input_quantizer(input), self.quantize_weight(self.weight), self.bias)
        return self.output_quantizer(out)
