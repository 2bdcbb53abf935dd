"""Quantized nn.Conv1d / Conv2d / Conv3d (weights per output channel, axis 0)."""

from __future__ import annotations

import torch
from torch import nn

from ..quant_module import QuantModule, QuantModuleRegistry


class _QuantConvNd(QuantModule):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = self._conv_forward(self.input_quantizer(input), self.quantize_weight(self.weight), self.bias)
        return self.output_quantizer(out)


for _cls in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
    QuantModuleRegistry.register(_cls, f"nn.{_cls.__name__}")(type(f"_Quant{_cls.__name__}", (_QuantConvNd,), {}))
