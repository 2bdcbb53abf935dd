"""Quantized nn.Conv1d / Conv2d / Conv3d (weights per output channel, axis 0)."""

from __future__ import annotations

import torch
from torch import nn

from ..quant_module import QuantModule, QuantModuleRegistry


class _QuantConvNd(QuantModule):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.quantizers_off():
            return self._conv_forward(input, self.weight, self.bias)
        out = self._conv_forward(self.input_quantizer(input), self.quantize_weight(self.weight), self.bias)
        return self.output_quantizer(out)


for _cls in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
    # module-level names, so the mixins pickle by reference like every other class here
    _mixin = type(f"_Quant{_cls.__name__}", (_QuantConvNd,), {"__module__": __name__})
    globals()[_mixin.__name__] = _mixin
    QuantModuleRegistry.register(_cls, f"nn.{_cls.__name__}")(_mixin)
